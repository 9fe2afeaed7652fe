# The container engine the stack test uses, sourced by deploy/stack/build-images and
# deploy/stack/test-stack.
#
# Docker when a Docker engine answers (`docker info`); otherwise Debian's podman as root with a
# private configuration under $STACK_DIR: its own storage root (images and the pip cache stay
# there between runs), its own network folder, and what podman needs inside a container of
# this machine's kind, found by trial:
#   runtime runc      crun 1.8 refuses hybrid cgroups (v1 plus a cgroup2 at .../unified)
#   cgroupfs, file    no systemd here: no systemd cgroup manager, journald or timers
#   default_ulimits   podman asks for nofile 1048576 and nproc above this container's hard
#                     limits (no CAP_SYS_RESOURCE): ask for what there is
#   overlay           native kernel overlayfs over ext4 (no fuse-overlayfs, no vfs copies)
#   netavark          bridge networks with DNS (aardvark-dns) and iptables NAT
# Nothing here touches /etc/containers or the host's own podman storage.

STACK_DIR="${STACK_DIR:-/var/tmp/tessera-stack}"
export STACK_DIR

if [[ -z "${STACK_ENGINE:-}" ]]; then
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
        STACK_ENGINE=docker
    else
        STACK_ENGINE=podman
    fi
fi
export STACK_ENGINE

if [[ "$STACK_ENGINE" == podman ]]; then
    mkdir -p "$STACK_DIR/podman"
    nofile="$(ulimit -Hn)"
    [[ "$nofile" == unlimited || "$nofile" -gt 1048576 ]] && nofile=1048576
    # podman lowers its own process limit to 32768 before it starts the runtime
    nproc="$(ulimit -Hu)"
    [[ "$nproc" == unlimited || "$nproc" -gt 32768 ]] && nproc=32768
    cat >"$STACK_DIR/podman/storage.conf" <<EOF
[storage]
driver = "overlay"
graphroot = "$STACK_DIR/podman/storage"
runroot = "$STACK_DIR/podman/run"
EOF
    cat >"$STACK_DIR/podman/containers.conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
network_config_dir = "$STACK_DIR/podman/networks"
EOF
    export CONTAINERS_STORAGE_CONF="$STACK_DIR/podman/storage.conf"
    export CONTAINERS_CONF="$STACK_DIR/podman/containers.conf"
    ENGINE=(podman)
    COMPOSE=(podman-compose)
else
    ENGINE=(docker)
    COMPOSE=(docker compose)
fi
