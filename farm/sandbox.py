"""Untrusted programs in a sandbox: bubblewrap namespaces, an unprivileged uid, one cgroup each.

A member's stream app or Blender file runs through ``spawn``: a bubblewrap (``bwrap``) instance
with its own mount, PID, IPC, UTS, cgroup and (unless asked) network namespaces, a filesystem
of read-only runtime binds plus what the caller names, a private /tmp and home, only the
environment it is given, and an unprivileged uid that is not the service's. Its processes live
in a cgroup made for the instance (memory, process count, CPU), joined before anything runs
and killed as a whole at the end.

As root (a container, or ``farm up`` as root) bwrap does the mounts and ``setpriv`` drops to
``sandbox_uid``:``sandbox_gid`` with no capabilities and ``no_new_privs``. As another user
bwrap maps that user to the sandbox uid in a new user namespace (the kernel must allow
unprivileged user namespaces); on the host the processes then keep the service's uid.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from farm.errors import SetupError
from farm.lifetime import arm_parent_death_signal
from farm.settings import Settings

log = logging.getLogger("tessera.sandbox")
_LIBC = ctypes.CDLL(None, use_errno=True)

#: the sandbox's home folder, a private tmpfs
HOME = Path("/home/sandbox")
#: the cgroup v1 controllers a sandbox uses, by the file each limit is written to
V1_CONTROLLERS = ("memory", "pids", "cpu")
#: a cgroup folder under the service's own cgroup holding one folder per sandbox instance
CGROUP_PARENT = "tessera-sandbox"
#: CFS period the CPU quota is a share of
CPU_PERIOD_US = 100_000
#: setns(2)'s flag for an IPC namespace
CLONE_NEWIPC = 0x08000000
#: how long killing a cgroup's processes may take before giving up on removing it
KILL_TIMEOUT_S = 5.0
#: files of /etc a dynamically linked program, fontconfig or an X client may read
ETC_FILES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "fonts", "localtime",
    "nsswitch.conf", "X11", "xdg", "ssl", "ca-certificates", "mime.types", "terminfo",
)  # fmt: skip
#: /etc files only a sandbox with network gets (name resolution)
ETC_NETWORK_FILES = ("resolv.conf", "hosts", "host.conf", "gai.conf")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

#: folders the sandbox makes itself (tmpfs, proc, dev) or that hold only files bound in
SPECIAL = frozenset(Path(p) for p in ("/tmp", "/proc", "/dev", "/home"))

Bind = tuple[Path, Path]
"""(host path, path inside the sandbox)."""


@dataclass(frozen=True)
class Limits:
    """What one instance may use; 0 = no limit on that dimension."""

    memory_mib: int = 0
    pids: int = 0
    cpu_cores: float = 0.0


@dataclass(frozen=True)
class SandboxSpec:
    """One sandbox instance: what it sees, its environment and its limits."""

    name: str
    """Names the instance in logs and its cgroup (letters, digits, ``_.-``)."""
    ro_binds: tuple[Bind, ...] = ()
    rw_binds: tuple[Bind, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    network: bool = False
    limits: Limits = Limits()
    uid: int = 64000
    gid: int = 64000
    chdir: Path = HOME
    devices: tuple[Path, ...] = ()
    """Device nodes passed through (``/dev/nvidia0``); /dev otherwise holds only the basics."""
    device_dirs: tuple[Bind, ...] = ()
    """Host folders whose device nodes the sandbox may use, bound live (a stream session's
    ``/dev/input``, where the service adds a virtual gamepad's nodes once a viewer plugs one)."""
    as_caller: bool = False
    """Run as the caller's own uid, through a user namespace, even as root (no ``setpriv``): for
    a local user's own files (``farm render FILE``), which the sandbox uid may not read. The
    mounts and limits are the same; on the host the processes keep the caller's uid."""


def runtime_binds(*packages: str) -> tuple[Bind, ...]:
    """Read-only binds of what a Python or X program needs: /usr and its merged-usr links,
    pieces of /etc, this interpreter and venv, and the source folders of ``packages``
    (importable top-level names, e.g. ``encoder``) so ``python -m encoder.game`` runs."""
    paths: list[Path] = [Path("/usr")]
    paths += [Path(p) for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")]
    paths += [Path("/etc") / name for name in ETC_FILES]
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}:
        paths.append(Path(prefix))
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise SetupError(f"package {name} is not importable here; it cannot be bound")
        paths += [Path(p) for p in spec.submodule_search_locations]
    binds: dict[Path, Bind] = {}
    for path in paths:
        if path.exists() or path.is_symlink():
            binds.setdefault(path, (path, path))
    return tuple(binds.values())


def network_binds() -> tuple[Bind, ...]:
    """The /etc files of name resolution, for an instance with ``network=True``."""
    paths = [Path("/etc") / name for name in ETC_NETWORK_FILES]
    return tuple((p, p) for p in paths if p.exists())


def owned_dir(path: Path, spec: SandboxSpec) -> Path:
    """``path`` created (mode 0700) and owned by the sandbox's uid, for a read-write bind."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.geteuid() == 0:
        os.chown(path, spec.uid, spec.gid)
    path.chmod(0o700)
    return path


# --- cgroups -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupLayout:
    """Where instance cgroups are made: one parent per v1 controller, or one v2 parent."""

    version: Literal[1, 2]
    parents: tuple[Path, ...]


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, filesystem type, super options) of every mount this process sees."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _source, options = [*right.split(), "", "", ""][:3]
            found.append((left.split()[4], fstype, options))
    return found


def _own_cgroups() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under ``""`` its v2 path."""
    own: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                own[name] = path
    return own


def cgroup_layout(configured: str = "") -> CgroupLayout:
    """The cgroup parent(s) of sandbox instances.

    ``configured`` (FARM_SANDBOX_CGROUP) names a delegated cgroup v2 folder; empty = under
    this process's own cgroup: cgroup v1 where memory, pids and cpu are mounted there (hybrid
    hosts), else the unified v2 hierarchy.
    """
    if configured:
        return CgroupLayout(2, (Path(configured),))
    mounts, own = _mounts(), _own_cgroups()
    v1: list[Path] = []
    for controller in V1_CONTROLLERS:
        for point, fstype, options in mounts:
            if fstype == "cgroup" and controller in options.split(","):
                v1.append(Path(point + own.get(controller, "/").rstrip("/")) / CGROUP_PARENT)
                break
    if len(v1) == len(V1_CONTROLLERS):
        return CgroupLayout(1, tuple(v1))
    for point, fstype, _options in mounts:
        if fstype == "cgroup2":
            return CgroupLayout(2, (Path(point + own.get("", "/").rstrip("/")) / CGROUP_PARENT,))
    raise SetupError(
        "no cgroup filesystem with memory, pids and cpu controllers is mounted; mount "
        "/sys/fs/cgroup (cgroup v2) read-write in the service's container",
        hint="docker: --cgroupns=private and a writable /sys/fs/cgroup; k8s: see README Security",
    )


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _prepare_v2_parent(parent: Path) -> None:
    """``parent`` with memory, pids and cpu enabled for its children.

    cgroup v2 lets a cgroup hand controllers to children only while it holds no processes.
    The service's own cgroup usually holds the service; when it is the root of a container's
    cgroup namespace the service's processes move to a leaf beside the sandboxes, as container
    runtimes do for nested containers.
    """
    parent.mkdir(exist_ok=True)
    wanted = " ".join(f"+{c}" for c in V1_CONTROLLERS)
    try:
        _write(parent.parent / "cgroup.subtree_control", wanted)
    except OSError as exc:
        own = parent.parent
        if exc.errno != 16 or _own_cgroups().get("") != "/":  # EBUSY: processes inside
            raise
        leaf = own / "tessera-service"
        leaf.mkdir(exist_ok=True)
        for pid in (own / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                _write(leaf / "cgroup.procs", pid)
        _write(own / "cgroup.subtree_control", wanted)
    _write(parent / "cgroup.subtree_control", wanted)


class Cgroup:
    """One sandbox instance's cgroup (a folder per v1 controller, or one v2 folder)."""

    def __init__(self, layout: CgroupLayout, name: str) -> None:
        self.layout = layout
        self.dirs = tuple(parent / name for parent in layout.parents)

    @classmethod
    def create(cls, layout: CgroupLayout, name: str, limits: Limits) -> Cgroup:
        try:
            if layout.version == 2:
                _prepare_v2_parent(layout.parents[0])
            for parent in layout.parents:
                parent.mkdir(exist_ok=True)
            group = cls(layout, name)
            for folder in group.dirs:
                folder.mkdir()
            group._limit(limits)
        except OSError as exc:
            raise SetupError(
                f"cannot create the sandbox cgroup under {layout.parents[0]}: {exc.strerror}; "
                "the service needs a writable cgroup (v1 memory, pids, cpu, or a delegated "
                "v2 folder in FARM_SANDBOX_CGROUP)",
                path=str(layout.parents[0]),
            ) from exc
        return group

    def _limit(self, limits: Limits) -> None:
        memory = limits.memory_mib << 20
        quota = int(limits.cpu_cores * CPU_PERIOD_US)
        if self.layout.version == 2:
            (d,) = self.dirs
            if memory:
                _write(d / "memory.max", str(memory))
                with contextlib.suppress(OSError):
                    _write(d / "memory.swap.max", "0")
            if limits.pids:
                _write(d / "pids.max", str(limits.pids))
            if quota:
                _write(d / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            return
        memory_dir, pids_dir, cpu_dir = self.dirs
        if memory:
            _write(memory_dir / "memory.limit_in_bytes", str(memory))
            # without swap accounting the limit holds RAM only; with it, RAM + swap
            with contextlib.suppress(OSError):
                _write(memory_dir / "memory.memsw.limit_in_bytes", str(memory))
        if limits.pids:
            _write(pids_dir / "pids.max", str(limits.pids))
        if quota:
            _write(cpu_dir / "cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu_dir / "cpu.cfs_quota_us", str(quota))

    def joiner(self) -> Callable[[], None]:
        """A ``preexec_fn`` putting the forked child into this cgroup before it execs."""
        paths = [str(d / "cgroup.procs") for d in self.dirs]

        def join() -> None:
            pid = str(os.getpid()).encode()
            for path in paths:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        return join

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (v2 ``cgroup.kill`` where the kernel has it)."""
        if self.layout.version == 2:
            with contextlib.suppress(OSError):
                _write(self.dirs[0] / "cgroup.kill", "1")
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)  # the kernel reaps asynchronously; poll until the group is empty

    def remove(self) -> None:
        self.kill()
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("event=cgroup_left path=%s error=%s", d, exc.strerror)

    def peak_memory_bytes(self) -> int | None:
        name = "memory.peak" if self.layout.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int((self.dirs[0] / name).read_text())
        except (OSError, ValueError):
            return None


# --- the sandbox -------------------------------------------------------------------------------


def _bind_args(flag: str, binds: Iterable[Bind]) -> list[str]:
    args: list[str] = []
    for host, inside in binds:
        if host == inside and host.is_symlink():
            # keep merged-usr links (/lib -> usr/lib) as links, not a second copy of /usr
            args += ["--symlink", os.readlink(host), str(inside)]
        else:
            args += [flag, str(host), str(inside)]
    return args


def _parent_dirs(targets: Iterable[Path]) -> list[str]:
    """``--dir`` of every folder above a bind target, mode 0755: bwrap would make them 0700
    (as root), keeping the sandbox user from reaching /root/.pyenv/... or /srv/venv/..."""
    parents: set[Path] = set()
    for target in targets:
        parents.update(p for p in target.parents if p != Path("/") and p not in SPECIAL)
    args: list[str] = []
    for parent in sorted(parents, key=lambda p: len(p.parts)):
        args += ["--perms", "0755", "--dir", str(parent)]
    return args


def _identity_files(spec: SandboxSpec) -> tuple[int, int]:
    """memfds holding a passwd and group that name only the sandbox user (X clients ask)."""
    fds = []
    for text in (
        f"sandbox:x:{spec.uid}:{spec.gid}:sandbox:{HOME}:/bin/sh\n",
        f"sandbox:x:{spec.gid}:\n",
    ):
        fd = os.memfd_create("sandbox-identity", 0)
        os.write(fd, text.encode())
        os.lseek(fd, 0, os.SEEK_SET)
        fds.append(fd)
    return fds[0], fds[1]


def bwrap_argv(
    spec: SandboxSpec, argv: Sequence[str], identity: tuple[int, int], as_root: bool
) -> list[str]:
    """The bubblewrap command line running ``argv`` as ``spec`` describes."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SetupError("bubblewrap is not installed: apt-get install bubblewrap")
    args = [
        bwrap, "--die-with-parent", "--new-session",
        "--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try",
        "--hostname", "sandbox", "--clearenv",
        "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--tmpfs", "/tmp",
        "--dir", "/home",
        "--perms", "0777", "--tmpfs", str(HOME),
        *_parent_dirs([Path("/etc/passwd"), *(inside for _, inside in spec.ro_binds),
                       *(inside for _, inside in spec.rw_binds)]),
        "--ro-bind-data", str(identity[0]), "/etc/passwd",
        "--ro-bind-data", str(identity[1]), "/etc/group",
    ]  # fmt: skip
    if not spec.network:
        args.append("--unshare-net")
    if not as_root:
        args += ["--unshare-user", "--uid", str(spec.uid), "--gid", str(spec.gid)]
    args += _bind_args("--ro-bind", spec.ro_binds)
    args += _bind_args("--bind", spec.rw_binds)
    for device in spec.devices:
        args += ["--dev-bind", str(device), str(device)]
    args += _bind_args("--dev-bind", spec.device_dirs)
    env = {"HOME": str(HOME), "PATH": "/usr/local/bin:/usr/bin:/bin", "USER": "sandbox"}
    for key, value in {**env, **spec.env}.items():
        args += ["--setenv", key, value]
    args += ["--chdir", str(spec.chdir), "--"]
    if as_root:
        args += [
            "/usr/bin/setpriv", f"--reuid={spec.uid}", f"--regid={spec.gid}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--",
        ]  # fmt: skip
    return args + list(argv)


class Sandboxed:
    """A running sandbox instance: its bwrap process and its cgroup (None without a sandbox)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], cgroup: Cgroup | None) -> None:
        self.name = name
        self.proc = proc
        self.cgroup = cgroup

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pids(self) -> list[int]:
        """Every process of the instance (its cgroup's), as host pids."""
        if self.cgroup is None:
            return [self.proc.pid] if self.proc.poll() is None else []
        return self.cgroup.pids()

    def ipc_namespace(self) -> Path | None:
        """The /proc path of the instance's IPC namespace (None without one)."""
        mine = os.stat("/proc/self/ns/ipc").st_ino
        for pid in self.pids():
            path = Path(f"/proc/{pid}/ns/ipc")
            with contextlib.suppress(OSError):
                if path.stat().st_ino != mine:
                    return path
        return None

    def kill(self) -> None:
        """SIGKILL the whole instance: every process of its cgroup."""
        if self.cgroup is not None:
            self.cgroup.kill()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    def close(self) -> None:
        """Kill the instance, reap bwrap and remove the cgroup; safe to call twice."""
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(KILL_TIMEOUT_S)
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None
        log.info("event=sandbox_closed sandbox=%s pid=%d", self.name, self.proc.pid)


def spawn(settings: Settings, spec: SandboxSpec, argv: Sequence[str], **popen: Any) -> Sandboxed:
    """Start ``argv`` in a new sandbox instance (``popen``: stdio, pass_fds for Popen).

    With FARM_SANDBOX=none the program runs on the host as the service's user, with only
    ``spec.env`` and in ``spec.chdir`` where that folder exists: no isolation at all.
    """
    if not _NAME.fullmatch(spec.name):
        raise ValueError(f"sandbox name {spec.name!r} is not [A-Za-z0-9_.-]{{1,64}}")
    if settings.sandbox == "none":
        env = {"HOME": str(HOME), "PATH": "/usr/local/bin:/usr/bin:/bin", **spec.env}
        cwd = spec.chdir if spec.chdir.is_dir() else None
        proc = subprocess.Popen(
            list(argv), env=env, cwd=cwd, start_new_session=True,
            preexec_fn=lambda: arm_parent_death_signal(signal.SIGKILL), **popen,
        )  # fmt: skip
        return Sandboxed(spec.name, proc, None)
    as_root = os.geteuid() == 0 and not spec.as_caller
    layout = cgroup_layout(settings.sandbox_cgroup)
    group = Cgroup.create(layout, f"{spec.name}-{uuid.uuid4().hex[:8]}", spec.limits)
    identity = _identity_files(spec)
    join = group.joiner()

    def preexec() -> None:
        join()
        arm_parent_death_signal(signal.SIGKILL)
        # folders bwrap makes for bind targets (/root of /root/.pyenv) must be traversable
        os.umask(0o022)

    try:
        pass_fds = tuple(popen.pop("pass_fds", ())) + identity
        proc = subprocess.Popen(
            bwrap_argv(spec, argv, identity, as_root), pass_fds=pass_fds,
            start_new_session=True, preexec_fn=preexec, **popen,
        )  # fmt: skip
    except BaseException:
        group.remove()
        raise
    finally:
        for fd in identity:
            os.close(fd)
    log.info("event=sandbox_started sandbox=%s pid=%d uid=%d network=%s memory_mib=%d "
             "pids=%d cpu_cores=%g", spec.name, proc.pid, spec.uid, spec.network,
             spec.limits.memory_mib, spec.limits.pids, spec.limits.cpu_cores)  # fmt: skip
    return Sandboxed(spec.name, proc, group)


def join_ipc_namespace(path: Path) -> None:
    """Move the calling thread (only it) into the IPC namespace at ``path``: shared memory it
    makes from then on is the sandbox's, so an X server there can attach it (MIT-SHM)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _LIBC.setns(fd, CLONE_NEWIPC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot join the sandbox's IPC namespace: {os.strerror(err)}")
    finally:
        os.close(fd)


def check(settings: Settings) -> None:
    """Raise SetupError naming what keeps sandboxes from starting here (bubblewrap missing,
    namespaces or cgroups not permitted); called when `farm stream` and `farm worker` start."""
    if settings.sandbox == "none":
        log.warning(
            "event=sandbox_off FARM_SANDBOX=none: members' apps and .blend files run as the "
            "service's own user with its files, network and processes in reach; use this only "
            "on a single-user machine"
        )
        return
    if shutil.which("bwrap") is None:
        raise SetupError("bubblewrap is not installed: apt-get install bubblewrap")
    if os.geteuid() == 0 and shutil.which("setpriv", path="/usr/bin") is None:
        raise SetupError("setpriv is not installed: apt-get install util-linux")
    spec = SandboxSpec(
        "check", ro_binds=runtime_binds(), limits=Limits(memory_mib=64, pids=16),
        uid=settings.sandbox_uid, gid=settings.sandbox_gid,
    )  # fmt: skip
    box = spawn(settings, spec, ["/bin/true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _out, err = box.proc.communicate(timeout=30)
    finally:
        box.close()
    if box.proc.returncode != 0:
        detail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise SetupError(
            f"the sandbox cannot start here (bwrap: {detail[0]}); "
            + (
                "run the service with CAP_SYS_ADMIN and seccomp/AppArmor allowing mount and "
                "unshare (compose: cap_add SYS_ADMIN, security_opt seccomp=unconfined and "
                "apparmor=unconfined)"
                if os.geteuid() == 0
                else "allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1"
                " and user.max_user_namespaces > 0) or run the service as root in its container"
            ),
            detail=detail[0],
        )
