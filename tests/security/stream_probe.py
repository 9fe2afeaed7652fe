"""Run inside a session's sandbox: reports on stdout (JSON) what this sandbox can reach.

Arguments: redis port, storage folder, another session's display number, this session's
display number. Standard library only (it runs under the sandbox's interpreter).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


def connect(family: int, address: object) -> str:
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(address)  # type: ignore[arg-type]
        except OSError:
            return "refused"
    return "reached"


def x_display(number: str) -> str:
    # an X client tries the abstract socket, then the socket file
    if connect(socket.AF_UNIX, f"\0/tmp/.X11-unix/X{number}") == "reached":
        return "reached"
    return connect(socket.AF_UNIX, f"/tmp/.X11-unix/X{number}")


def child(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "stopped" if done.returncode != 0 or "done" not in done.stdout else "ran"


def main() -> None:
    port, storage, other, own = sys.argv[1:5]
    print(
        json.dumps(
            {
                "uid": os.getuid(),
                "farm_env": sorted(k for k in os.environ if k.startswith("FARM_")),
                "redis_tcp": connect(socket.AF_INET, ("127.0.0.1", int(port))),
                "storage": os.path.exists(storage),
                "other_display": x_display(other),
                "own_display": x_display(own),
                "processes": len([p for p in os.listdir("/proc") if p.isdigit()]),
                # 1 GiB touched page by page, against the session's memory limit
                "memory": child(
                    "b = bytearray(1 << 30); b[::4096] = b'x' * len(b[::4096]); print('done')"
                ),
                # 200 processes against the session's pids limit (each lets go of the
                # pipe it inherited: the probe reads to its end, not for 20 s)
                "pids": child(
                    "import os, time\n"
                    "for _ in range(200):\n"
                    "    if os.fork() == 0:\n"
                    "        os.closerange(0, 3); time.sleep(20); os._exit(0)\n"
                    "print('done')\n"
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
