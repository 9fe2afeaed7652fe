"""moto's S3 server mode in a child process on 127.0.0.1: a real HTTP S3 endpoint for tests."""

from __future__ import annotations

import select
import subprocess
import sys

from farm import lifetime

#: the child prints its port once listening, then serves until its stdin closes
_SERVE = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer("127.0.0.1", 0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""

#: seconds moto may take to import and listen (a loaded CI machine)
START_TIMEOUT_S = 60.0

#: what boto3 needs to talk to moto (any key works; moto checks none)
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "tessera-test",
    "AWS_SECRET_ACCESS_KEY": "tessera-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MotoServer(lifetime.ChildHandle):
    """``with MotoServer() as s3: s3.endpoint`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.endpoint = ""

    def start(self) -> MotoServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        line = self.proc.stdout.readline().strip() if ready else "nothing in time"
        if not line.isdigit():
            self.stop()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        self.endpoint = f"http://127.0.0.1:{int(line)}"
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
