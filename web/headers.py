"""Security headers on every response, and no server version: one place for the browser rules."""

from __future__ import annotations

from aiohttp import web

from web.appkeys import SETTINGS

#: scripts and styles only from the web's own files (no inline script or style attribute);
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


def _tls(request: web.Request) -> bool:
    return request.secure or request.app[SETTINGS].tls_cert is not None


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, the router's 404s and file responses included, gets the headers."""
    for name, value in HEADERS.items():
        response.headers.setdefault(name, value)
    if _tls(request):
        response.headers.setdefault("Strict-Transport-Security", HSTS)
    response.headers["Server"] = SERVER
    if request.path.startswith("/api/"):
        # API answers (tokens, job data) are never kept by shared caches
        response.headers.setdefault("Cache-Control", "no-store")
