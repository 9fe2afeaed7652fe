"""The security headers every page of the farm is served with, by the web and by the stream
service alike (the player is a page of both): one place for the browser rules."""

from __future__ import annotations

from collections.abc import MutableMapping

#: scripts and styles only from the service's own files (no inline script or style attribute);
#: media and images may be blob:/data: (the player's stream, thumbnails); never framed
CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",
        "media-src 'self' blob:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Permissions-Policy": "camera=(), microphone=(), geolocation=()",
}
#: a year; sent only over TLS (a plain-HTTP answer must not pin the host to HTTPS)
HSTS = "max-age=31536000"
#: what the Server header says (aiohttp's default names itself and its version)
SERVER = "tessera"


def apply(headers: MutableMapping[str, str], path: str, tls: bool) -> None:
    """Set the rules on a response's ``headers`` (those a handler set itself stay)."""
    for name, value in HEADERS.items():
        headers.setdefault(name, value)
    if tls:
        headers.setdefault("Strict-Transport-Security", HSTS)
    headers["Server"] = SERVER
    if path.startswith("/api/"):
        # API answers (tokens, job data) are never kept by shared caches
        headers.setdefault("Cache-Control", "no-store")
