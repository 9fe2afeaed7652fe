/*
 * Tessera's gamepad shim: a virtual controller for a session's app where the host has no
 * /dev/uinput (a VM, a container or a Kubernetes pod without the device, a service that is not
 * root). Loaded into the app with LD_PRELOAD (encoder/appbox.py); the stream service makes a
 * unix socket where the pad's device node would be, /dev/input/jsN and /dev/input/eventN in
 * the session's sandbox (encoder/gamepad.py, SocketPad), and writes the pad's events into every
 * connection: `struct js_event` on jsN, `struct input_event` on eventN.
 *
 * The shim makes those sockets look like the kernel's nodes to the app:
 *   open()   of /dev/input/jsN or eventN connects to the socket there; where the path is no
 *            socket (a real node: the host has uinput) the real open() runs;
 *   stat()   of such a socket says a character device of the joystick major (13), minor N (js)
 *            or 64 + N (event), as the kernel numbers them (SDL tells pads apart by st_rdev);
 *   ioctl()  on a connected fd answers the joystick and evdev queries (version, name, axes and
 *            buttons, their maps and ranges) for the pad the service drives: the same
 *            controller, codes and ranges as its uinput one (encoder/gamepad.py);
 *   read(), poll(), select() and epoll need nothing: the fd is a real socket.
 * Paths are matched as written, absolute (as SDL and the joystick libraries open them).
 * close() forgets a connected fd. A connected fd duplicated (dup, F_DUPFD) answers no ioctl on
 * its copy (an app that queries a copy sees no pad there).
 *
 * Nothing here is trusted by the service: the app may write anything into the socket, and the
 * service only reads it to throw it away.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/input.h>
#include <linux/joystick.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <unistd.h>

#define INPUT_DIR "/dev/input/"
#define MAX_PADS 4 /* the Gamepad API's indexes 0-3, as encoder/gamepad.py MAX_PADS */
#define MAX_FDS 65536
#define JOYSTICK_MAJOR 13
#define EVDEV_MINOR_BASE 64

enum kind { NONE = 0, JS = 1, EVDEV = 2 };

/* the controller's codes, as encoder/gamepad.py's uinput one declares them */
static const unsigned short KEYS[] = {
    BTN_SOUTH, BTN_EAST, BTN_NORTH, BTN_WEST, BTN_TL, BTN_TR,
    BTN_SELECT, BTN_START, BTN_MODE, BTN_THUMBL, BTN_THUMBR,
};
static const unsigned char AXES[] = {
    ABS_X, ABS_Y, ABS_Z, ABS_RX, ABS_RY, ABS_RZ, ABS_HAT0X, ABS_HAT0Y,
};
#define N_KEYS (sizeof KEYS / sizeof KEYS[0])
#define N_AXES (sizeof AXES / sizeof AXES[0])
#define STICK_MAX 32767
#define TRIGGER_MAX 255

/* each connected fd: its kind and its pad's index (fds past MAX_FDS are never shimmed) */
static unsigned char kinds[MAX_FDS];
static unsigned char pads[MAX_FDS];

#define REAL(name) static __typeof__(name) *real_##name; \
    if (!real_##name) real_##name = (__typeof__(name) *)dlsym(RTLD_NEXT, #name)

/* JS or EVDEV where ``path`` names a pad's node, its index in ``index``; NONE otherwise */
static enum kind node_kind(const char *path, int *index) {
    const char *rest;
    enum kind kind;
    if (!path || strncmp(path, INPUT_DIR, sizeof INPUT_DIR - 1) != 0) return NONE;
    rest = path + sizeof INPUT_DIR - 1;
    if (strncmp(rest, "js", 2) == 0) {
        kind = JS;
        rest += 2;
    } else if (strncmp(rest, "event", 5) == 0) {
        kind = EVDEV;
        rest += 5;
    } else {
        return NONE;
    }
    if (rest[0] < '0' || rest[0] >= '0' + MAX_PADS || rest[1] != '\0') return NONE;
    *index = rest[0] - '0';
    return kind;
}

/* a connected socket for a pad's node, or -1 (errno set) where ``path`` holds no socket */
static int connect_node(const char *path, int flags, enum kind kind, int index) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    int fd, type = SOCK_STREAM;
    if (flags & O_CLOEXEC) type |= SOCK_CLOEXEC;
    if (flags & O_NONBLOCK) type |= SOCK_NONBLOCK;
    strncpy(addr.sun_path, path, sizeof addr.sun_path - 1);
    fd = socket(AF_UNIX, type, 0);
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    if (fd < MAX_FDS) {
        kinds[fd] = (unsigned char)kind;
        pads[fd] = (unsigned char)index;
    }
    return fd;
}

/* the shimmed fd for ``path``, or -1 where the real open() is to run */
static int shim_open(const char *path, int flags) {
    int index, fd;
    enum kind kind = node_kind(path, &index);
    if (kind == NONE) return -1;
    fd = connect_node(path, flags, kind, index);
    /* no socket there (a real node, or nothing): the real open() says what it is */
    return fd;
}

static int mode_of(va_list ap, int flags) {
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    va_list ap;
    int mode, fd;
    REAL(open);
    va_start(ap, flags);
    mode = mode_of(ap, flags);
    va_end(ap);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real_open(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    va_list ap;
    int mode, fd;
    REAL(open64);
    va_start(ap, flags);
    mode = mode_of(ap, flags);
    va_end(ap);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real_open64(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    int mode, fd;
    REAL(openat);
    va_start(ap, flags);
    mode = mode_of(ap, flags);
    va_end(ap);
    if ((fd = shim_open(path, flags)) >= 0) return fd; /* absolute paths only match */
    return real_openat(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...) {
    va_list ap;
    int mode, fd;
    REAL(openat64);
    va_start(ap, flags);
    mode = mode_of(ap, flags);
    va_end(ap);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real_openat64(dirfd, path, flags, mode);
}

/* the fortified entry points (_FORTIFY_SOURCE) that open() calls without a mode reach */
int __open_2(const char *path, int flags) {
    int fd;
    REAL(__open_2);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real___open_2(path, flags);
}

int __open64_2(const char *path, int flags) {
    int fd;
    REAL(__open64_2);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real___open64_2(path, flags);
}

int __openat_2(int dirfd, const char *path, int flags) {
    int fd;
    REAL(__openat_2);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real___openat_2(dirfd, path, flags);
}

int __openat64_2(int dirfd, const char *path, int flags) {
    int fd;
    REAL(__openat64_2);
    if ((fd = shim_open(path, flags)) >= 0) return fd;
    return real___openat64_2(dirfd, path, flags);
}

int close(int fd) {
    REAL(close);
    if (fd >= 0 && fd < MAX_FDS) kinds[fd] = NONE;
    return real_close(fd);
}

/* a pad's socket shown as the kernel's character device */
static void as_device(const char *path, mode_t *mode, dev_t *rdev) {
    int index;
    enum kind kind = node_kind(path, &index);
    if (kind == NONE || !S_ISSOCK(*mode)) return;
    *mode = S_IFCHR | (*mode & 07777);
    *rdev = makedev(JOYSTICK_MAJOR, kind == JS ? index : EVDEV_MINOR_BASE + index);
}

static void fd_as_device(int fd, mode_t *mode, dev_t *rdev) {
    if (fd < 0 || fd >= MAX_FDS || kinds[fd] == NONE || !S_ISSOCK(*mode)) return;
    *mode = S_IFCHR | (*mode & 07777);
    *rdev = makedev(JOYSTICK_MAJOR,
                    kinds[fd] == JS ? pads[fd] : EVDEV_MINOR_BASE + pads[fd]);
}

int stat(const char *path, struct stat *st) {
    REAL(stat);
    int rc = real_stat(path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int stat64(const char *path, struct stat64 *st) {
    REAL(stat64);
    int rc = real_stat64(path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int lstat(const char *path, struct stat *st) {
    REAL(lstat);
    int rc = real_lstat(path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int lstat64(const char *path, struct stat64 *st) {
    REAL(lstat64);
    int rc = real_lstat64(path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int fstatat(int dirfd, const char *path, struct stat *st, int flags) {
    REAL(fstatat);
    int rc = real_fstatat(dirfd, path, st, flags);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int fstatat64(int dirfd, const char *path, struct stat64 *st, int flags) {
    REAL(fstatat64);
    int rc = real_fstatat64(dirfd, path, st, flags);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int fstat(int fd, struct stat *st) {
    REAL(fstat);
    int rc = real_fstat(fd, st);
    if (rc == 0) fd_as_device(fd, &st->st_mode, &st->st_rdev);
    return rc;
}

int fstat64(int fd, struct stat64 *st) {
    REAL(fstat64);
    int rc = real_fstat64(fd, st);
    if (rc == 0) fd_as_device(fd, &st->st_mode, &st->st_rdev);
    return rc;
}

/* programs built against glibc before 2.33 reach stat() through these */
int __xstat(int ver, const char *path, struct stat *st) {
    REAL(__xstat);
    int rc = real___xstat(ver, path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int __xstat64(int ver, const char *path, struct stat64 *st) {
    REAL(__xstat64);
    int rc = real___xstat64(ver, path, st);
    if (rc == 0) as_device(path, &st->st_mode, &st->st_rdev);
    return rc;
}

int __fxstat(int ver, int fd, struct stat *st) {
    REAL(__fxstat);
    int rc = real___fxstat(ver, fd, st);
    if (rc == 0) fd_as_device(fd, &st->st_mode, &st->st_rdev);
    return rc;
}

int __fxstat64(int ver, int fd, struct stat64 *st) {
    REAL(__fxstat64);
    int rc = real___fxstat64(ver, fd, st);
    if (rc == 0) fd_as_device(fd, &st->st_mode, &st->st_rdev);
    return rc;
}

/* ---- the queries ---------------------------------------------------------------------------- */

static int copy_out(void *arg, size_t room, const void *data, size_t size) {
    size_t n = size < room ? size : room;
    memcpy(arg, data, n);
    return (int)n;
}

static int name_out(void *arg, size_t room, int index) {
    char name[80];
    int n = snprintf(name, sizeof name, "Tessera virtual pad %d", index);
    return copy_out(arg, room, name, (size_t)n + 1);
}

static int fail(int error) {
    errno = error;
    return -1;
}

static int axis_range(unsigned char code, int *low, int *high) {
    switch (code) {
    case ABS_Z:
    case ABS_RZ:
        *low = 0, *high = TRIGGER_MAX;
        return 1;
    case ABS_HAT0X:
    case ABS_HAT0Y:
        *low = -1, *high = 1;
        return 1;
    case ABS_X:
    case ABS_Y:
    case ABS_RX:
    case ABS_RY:
        *low = -STICK_MAX, *high = STICK_MAX;
        return 1;
    }
    return 0;
}

static int js_ioctl(int index, unsigned long request, void *arg) {
    unsigned int nr = _IOC_NR(request), size = _IOC_SIZE(request);
    switch (nr) {
    case _IOC_NR(JSIOCGVERSION):
        *(unsigned int *)arg = JS_VERSION;
        return 0;
    case _IOC_NR(JSIOCGAXES):
        *(unsigned char *)arg = N_AXES;
        return 0;
    case _IOC_NR(JSIOCGBUTTONS):
        *(unsigned char *)arg = N_KEYS;
        return 0;
    case _IOC_NR(JSIOCGNAME(0)):
        return name_out(arg, size, index);
    case _IOC_NR(JSIOCGAXMAP): {
        unsigned char map[ABS_CNT] = {0};
        memcpy(map, AXES, N_AXES);
        copy_out(arg, size, map, sizeof map);
        return 0;
    }
    case _IOC_NR(JSIOCGBTNMAP): {
        unsigned short map[KEY_MAX - BTN_MISC + 1] = {0};
        memcpy(map, KEYS, sizeof KEYS);
        copy_out(arg, size, map, sizeof map);
        return 0;
    }
    case _IOC_NR(JSIOCGCORR):
        memset(arg, 0, sizeof(struct js_corr) * N_AXES);
        return 0;
    case _IOC_NR(JSIOCSCORR):
    case _IOC_NR(JSIOCSAXMAP):
    case _IOC_NR(JSIOCSBTNMAP):
        return 0; /* a correction or a map set is accepted and has no effect */
    }
    return fail(EINVAL);
}

static void set_bit(unsigned char *bits, unsigned int bit) {
    bits[bit / 8] |= (unsigned char)(1u << (bit % 8));
}

static int evdev_ioctl(int index, unsigned long request, void *arg) {
    unsigned int nr = _IOC_NR(request), size = _IOC_SIZE(request);
    if (nr >= _IOC_NR(EVIOCGABS(0)) && nr < _IOC_NR(EVIOCGABS(ABS_CNT))
        && _IOC_DIR(request) == _IOC_READ) {
        struct input_absinfo info = {0};
        int low, high;
        if (!axis_range((unsigned char)(nr - _IOC_NR(EVIOCGABS(0))), &low, &high))
            return fail(EINVAL);
        info.minimum = low, info.maximum = high;
        copy_out(arg, size, &info, sizeof info);
        return 0;
    }
    if (nr >= _IOC_NR(EVIOCSABS(0))) /* 0xc0 + code: the rest of the 8 bits */
        return 0; /* a range set is accepted and has no effect */
    if (nr >= _IOC_NR(EVIOCGBIT(0, 0)) && nr < _IOC_NR(EVIOCGBIT(EV_MAX + 1, 0))) {
        unsigned char bits[KEY_MAX / 8 + 1] = {0};
        unsigned int ev = nr - _IOC_NR(EVIOCGBIT(0, 0)), i, length = 0;
        if (ev == 0) {
            set_bit(bits, EV_SYN), set_bit(bits, EV_KEY), set_bit(bits, EV_ABS);
            length = EV_MAX / 8 + 1;
        } else if (ev == EV_KEY) {
            for (i = 0; i < N_KEYS; i++) set_bit(bits, KEYS[i]);
            length = KEY_MAX / 8 + 1;
        } else if (ev == EV_ABS) {
            for (i = 0; i < N_AXES; i++) set_bit(bits, AXES[i]);
            length = ABS_MAX / 8 + 1;
        }
        return copy_out(arg, size, bits, length);
    }
    switch (nr) {
    case _IOC_NR(EVIOCGVERSION):
        *(int *)arg = EV_VERSION;
        return 0;
    case _IOC_NR(EVIOCGID): {
        struct input_id id = {.bustype = BUS_VIRTUAL, .vendor = 0x045E, .product = 0x028E,
                              .version = 1};
        memcpy(arg, &id, sizeof id);
        return 0;
    }
    case _IOC_NR(EVIOCGNAME(0)):
        return name_out(arg, size, index);
    case _IOC_NR(EVIOCGPHYS(0)):
    case _IOC_NR(EVIOCGUNIQ(0)):
        return fail(ENOENT); /* a virtual device has neither */
    case _IOC_NR(EVIOCGPROP(0)):
    case _IOC_NR(EVIOCGKEY(0)): /* every button up: the service sends what is held */
    case _IOC_NR(EVIOCGLED(0)):
    case _IOC_NR(EVIOCGSND(0)):
    case _IOC_NR(EVIOCGSW(0)):
        memset(arg, 0, size);
        return (int)size;
    case _IOC_NR(EVIOCGEFFECTS):
        *(int *)arg = 0; /* no force feedback */
        return 0;
    case _IOC_NR(EVIOCGRAB):
    case _IOC_NR(EVIOCREVOKE):
    case _IOC_NR(EVIOCSCLOCKID):
    case _IOC_NR(EVIOCGMASK):
    case _IOC_NR(EVIOCSMASK):
        return 0;
    }
    return fail(EINVAL);
}

int ioctl(int fd, unsigned long request, ...) {
    va_list ap;
    void *arg;
    REAL(ioctl);
    va_start(ap, request);
    arg = va_arg(ap, void *);
    va_end(ap);
    if (fd >= 0 && fd < MAX_FDS && kinds[fd] != NONE) {
        if (kinds[fd] == JS && _IOC_TYPE(request) == 'j') return js_ioctl(pads[fd], request, arg);
        if (kinds[fd] == EVDEV && _IOC_TYPE(request) == 'E')
            return evdev_ioctl(pads[fd], request, arg);
    }
    return real_ioctl(fd, request, arg);
}
