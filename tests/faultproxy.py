"""An HTTP/1.1 proxy on loopback that injects faults between the farm and its S3 endpoint.

Faults are queued per request: a 403, 500 or 503 answer, a connection reset part way through the
request body, a reset after the upstream answered (the reply is lost) or half way through its
body (the reply is cut), or a delay. Every
request's method, path and headers are recorded.
"""

from __future__ import annotations

import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

#: kinds of fault; ``delay`` waits ``delay_s`` and then forwards the request
KINDS = ("403", "500", "503", "reset_mid_body", "drop_reply", "cut_reply", "delay")


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body_len: int


@dataclass
class Fault:
    kind: str
    count: int
    match: Callable[[Request], bool]
    delay_s: float = 0.0


@dataclass
class FaultLog:
    requests: list[Request] = field(default_factory=list)
    injected: list[tuple[str, Request]] = field(default_factory=list)
    #: each request the upstream answered, with its status (also when the reply was then lost)
    answered: list[tuple[Request, int]] = field(default_factory=list)


class FaultProxy:
    """``with FaultProxy(upstream_url) as proxy: proxy.url`` forwards to the upstream; it
    listens on ``listen`` (loopback unless another address must reach it)."""

    def __init__(self, upstream: str, listen: str = "127.0.0.1") -> None:
        host_port = upstream.split("://", 1)[-1].rstrip("/")
        host, port = host_port.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.faults: list[Fault] = []
        self.log = FaultLog()
        #: delay before every request is forwarded (a slow endpoint)
        self.slow_s = 0.0
        self._lock = threading.Lock()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        self.server = socketserver.ThreadingTCPServer((listen, 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://{listen}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def inject(
        self,
        kind: str,
        count: int = 1,
        match: Callable[[Request], bool] = lambda r: True,
        delay_s: float = 0.0,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"fault {kind!r} is not one of {KINDS}")
        with self._lock:
            self.faults.append(Fault(kind, count, match, delay_s))

    def clear(self) -> None:
        with self._lock:
            self.faults.clear()
            self.slow_s = 0.0

    def _take(self, req: Request) -> Fault | None:
        with self._lock:
            self.log.requests.append(req)
            for fault in self.faults:
                if fault.count > 0 and fault.match(req):
                    fault.count -= 1
                    self.log.injected.append((fault.kind, req))
                    return fault
        return None

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    # --- one client connection ----------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        up_reader: _Reader | None = None
        reader = _Reader(client)
        try:
            while True:
                head = reader.head()
                if head is None:
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = _headers(lines[1:])
                length = int(headers.get("content-length", "0"))
                if headers.get("expect", "").lower() == "100-continue":
                    # answer it here (botocore otherwise waits a second), forward without it
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    kept = [x for x in lines if not x.lower().startswith("expect:")]
                    head = "\r\n".join(kept).encode("latin-1")
                req = Request(method, path, headers, length)
                fault = self._take(req)
                if self.slow_s:
                    time.sleep(self.slow_s)
                kind = fault.kind if fault else "pass"
                if kind in ("403", "500", "503"):
                    reader.exactly(length)
                    client.sendall(_error_reply(int(kind)))
                    continue
                if upstream is None or up_reader is None:
                    upstream = socket.create_connection(self.upstream)
                    up_reader = _Reader(upstream)
                if kind == "delay" and fault is not None:
                    time.sleep(fault.delay_s)
                if kind == "reset_mid_body":
                    upstream.sendall(head + reader.exactly(length // 2))
                    _reset(client)
                    return
                upstream.sendall(head + reader.exactly(length))
                reply = up_reader.response(method)
                with self._lock:
                    self.log.answered.append((req, int(reply.split(b" ", 2)[1])))
                if kind == "drop_reply":
                    _reset(client)
                    return
                if kind == "cut_reply":  # the head and half the body, then a reset
                    body_at = reply.index(b"\r\n\r\n") + 4
                    client.sendall(reply[: body_at + (len(reply) - body_at) // 2])
                    _reset(client)
                    return
                client.sendall(reply)
        except (OSError, ValueError):
            return
        finally:
            if upstream is not None:
                upstream.close()
            client.close()


class _Reader:
    """Reads HTTP messages off a socket, keeping what arrived past the current one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(1 << 16)
        self.buf += chunk
        return bool(chunk)

    def head(self) -> bytes | None:
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                return None
        end = self.buf.index(b"\r\n\r\n") + 4
        head, self.buf = self.buf[:end], self.buf[end:]
        return head

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ValueError("connection closed inside a body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill():
                raise ValueError("connection closed inside a chunk")
        end = self.buf.index(b"\r\n") + 2
        out, self.buf = self.buf[:end], self.buf[end:]
        return out

    def response(self, method: str) -> bytes:
        head = self.head()
        if head is None:
            raise ValueError("upstream closed")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = _headers(lines[1:])
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return head
        if headers.get("transfer-encoding", "").lower() == "chunked":
            out = head
            while True:
                size_line = self.line()
                out += size_line
                size = int(size_line.split(b";")[0], 16)
                out += self.exactly(size + 2) if size else self._trailer()
                if size == 0:
                    return out
        return head + self.exactly(int(headers.get("content-length", "0")))

    def _trailer(self) -> bytes:
        out = b""
        while (line := self.line()) != b"\r\n":
            out += line
        return out + line


def _headers(lines: list[str]) -> dict[str, str]:
    out = {}
    for line in lines:
        if ":" in line:
            name, value = line.split(":", 1)
            out[name.strip().lower()] = value.strip()
    return out


def _error_reply(status: int) -> bytes:
    code = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}[status]
    reason = {403: "Forbidden", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>injected by the fault proxy</Message></Error>"
    ).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (linger 0), as a crashed peer or middlebox would."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
