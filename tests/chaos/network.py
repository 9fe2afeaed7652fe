"""The chaos farm's network: one namespace per worker on a private bridge that reaches only
Redis and S3 on the host, a partition being that namespace's link taken down.

Where namespaces cannot be made (not root, no `ip`), every worker shares loopback and a
partition cannot be injected; ``Network.reason`` says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

IP = shutil.which("ip") or "/usr/sbin/ip"
IPTABLES = shutil.which("iptables") or "/usr/sbin/iptables"
NSENTER = shutil.which("nsenter") or "/usr/bin/nsenter"
#: the bridge's /24 is 10.213.N.0 with N picked per run (other runs may hold other N)
SUBNET_PREFIX = "10.213"


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


@dataclass
class Network:
    """``Network(run_id).create()`` makes the bridge; ``add(i)`` a worker's namespace; ``remove()``
    undoes everything it made (also after a partial create)."""

    run_id: str
    ports: tuple[int, ...] = ()
    namespaces: list[str] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)  # namespace -> host side of its veth
    reason: str = ""
    _bridge: str = ""
    _rules: list[list[str]] = field(default_factory=list)

    @property
    def isolated(self) -> bool:
        return bool(self._bridge)

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{int(self.run_id, 16) % 250 + 1}"

    @property
    def host_ip(self) -> str:
        """Where a worker reaches Redis and S3: the bridge's address, or loopback."""
        return f"{self.subnet}.1" if self.isolated else "127.0.0.1"

    def create(self) -> Network:
        if os.geteuid() != 0:
            self.reason = "not root: network namespaces need CAP_NET_ADMIN"
            return self
        if not os.path.exists(IP):
            self.reason = f"no `ip` command at {IP}"
            return self
        bridge = f"tcb{self.run_id}"
        try:
            _run(IP, "link", "add", bridge, "type", "bridge")
            self._bridge = bridge
            _run(IP, "addr", "add", f"{self.subnet}.1/24", "dev", bridge)
            _run(IP, "link", "set", bridge, "up")
        except (RuntimeError, OSError) as err:
            self.remove()
            self.reason = f"cannot make a bridge: {err}"
        return self

    def allow_only(self, *ports: int) -> None:
        """From the namespaces, the host answers on these TCP ports and nothing else."""
        if not self.isolated:
            return
        if not os.path.exists(IPTABLES):
            self.reason = f"no iptables at {IPTABLES}: the host's other ports stay reachable"
            return
        tag = ["-m", "comment", "--comment", f"tessera-chaos-{self.run_id}"]
        for rule in (
            *(["-i", self._bridge, "-p", "tcp", "--dport", str(p), *tag, "-j", "ACCEPT"]
              for p in ports),
            ["-i", self._bridge, *tag, "-j", "DROP"],
        ):  # fmt: skip
            _run(IPTABLES, "-A", "INPUT", *rule)
            self._rules.append(rule)

    def add(self, index: int) -> str | None:
        """A namespace for worker ``index`` (its name), or None where all share loopback."""
        if not self.isolated:
            return None
        ns, host_end, ns_end = (f"tchaos-{self.run_id}-{index}", f"tcv{self.run_id}{index}",
                                f"tcp{self.run_id}{index}")  # fmt: skip
        _run(IP, "netns", "add", ns)
        self.namespaces.append(ns)
        _run(IP, "link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        self.links[ns] = host_end
        _run(IP, "link", "set", ns_end, "netns", ns)
        _run(IP, "link", "set", host_end, "master", self._bridge, "up")
        inside = [IP, "netns", "exec", ns, IP]
        _run(*inside, "link", "set", "lo", "up")
        _run(*inside, "link", "set", ns_end, "name", "eth0")
        _run(*inside, "addr", "add", f"{self.subnet}.{10 + index}/24", "dev", "eth0")
        _run(*inside, "link", "set", "eth0", "up")
        return ns

    def prefix(self, ns: str | None) -> list[str]:
        """The argv prefix that runs a command inside ``ns``: its network only (`ip netns exec`
        would also remount /sys, hiding the cgroup filesystem the Blender sandbox needs)."""
        return [NSENTER, f"--net=/run/netns/{ns}", "--"] if ns else []

    def reachable(self, ns: str, host: str, port: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from inside ``ns`` to host:port opens within the timeout."""
        probe = f"exec 3<>/dev/tcp/{host}/{port}"
        argv = [*self.prefix(ns), "timeout", str(timeout_s), "bash", "-c", probe]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    def partition(self, ns: str, up: bool) -> None:
        _run(IP, "link", "set", self.links[ns], "up" if up else "down")

    def remove(self) -> list[str]:
        """Remove every namespace, link, rule and the bridge made; the errors, if any."""
        errors = []
        for rule in self._rules:
            try:
                _run(IPTABLES, "-D", "INPUT", *rule)
            except (RuntimeError, OSError) as err:
                errors.append(str(err))
        self._rules.clear()
        for ns in self.namespaces:
            for step in (
                [IP, "link", "del", self.links[ns]] if ns in self.links else None,
                [IP, "netns", "del", ns],
            ):
                if step is None:
                    continue
                try:
                    _run(*step)
                except (RuntimeError, OSError) as err:
                    errors.append(str(err))
        self.namespaces.clear()
        self.links.clear()
        if self._bridge:
            try:
                _run(IP, "link", "del", self._bridge)
            except (RuntimeError, OSError) as err:
                errors.append(str(err))
            self._bridge = ""
        return errors

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still present (should be none after remove())."""
        found = subprocess.run([IP, "-o", "link"], capture_output=True, text=True).stdout
        names = subprocess.run([IP, "netns", "list"], capture_output=True, text=True).stdout
        return [
            word.rstrip(":").split("@")[0]
            for word in (found + names).split()
            if self.run_id in word and (word.startswith(("tcb", "tcv", "tcp", "tchaos-")))
        ]
