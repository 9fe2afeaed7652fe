"""The web's TLS: a server context from a certificate and key, TLS 1.3 at the least."""

from __future__ import annotations

import ssl
from pathlib import Path

from farm.errors import BadParameter

LOOPBACK = "127.0.0.1"


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """An SSL context serving ``cert`` with ``key``; older TLS versions are refused."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        ctx.load_cert_chain(str(cert), str(key))
    except FileNotFoundError as exc:
        raise BadParameter(f"TLS file {exc.filename} does not exist (FARM_TLS_CERT/KEY)") from None
    except (ssl.SSLError, OSError) as exc:
        raise BadParameter(
            f"cannot use the TLS certificate {cert} with key {key}: {exc}; give a PEM "
            "certificate chain and its unencrypted PEM private key"
        ) from None
    return ctx


def bind_host(host: str, tls: bool) -> str:
    """The address to bind: the configured one, else loopback without TLS, all with TLS."""
    if host:
        return host
    return "0.0.0.0" if tls else LOOPBACK
