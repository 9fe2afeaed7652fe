"""ICE servers handed to viewers: STUN as configured, TURN with short-lived credentials of the
TURN REST scheme (username ``<expiry>:<user>``, password base64(HMAC-SHA1(secret, username)))."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Any

from farm.settings import Settings


def _urls(text: str) -> list[str]:
    return [url.strip() for url in text.split(",") if url.strip()]


def turn_credentials(secret: str, user: str, ttl_s: float, now_s: float) -> tuple[str, str]:
    """(username, credential) a TURN server with ``static-auth-secret`` accepts until
    ``now_s + ttl_s``."""
    username = f"{int(now_s + ttl_s)}:{user}"
    digest = hmac.new(secret.encode(), username.encode(), hashlib.sha1).digest()
    return username, base64.b64encode(digest).decode()


def ice_servers(settings: Settings, user: str, now_s: float | None = None) -> list[dict[str, Any]]:
    """RTCIceServer dicts (``urls``, ``username``, ``credential``) for one viewer."""
    servers: list[dict[str, Any]] = []
    stun = _urls(settings.stun_urls)
    if stun:
        servers.append({"urls": stun})
    turn = _urls(settings.turn_urls)
    if turn and settings.turn_secret:
        username, credential = turn_credentials(
            settings.turn_secret,
            user or "viewer",
            settings.turn_ttl_s,
            time.time() if now_s is None else now_s,
        )
        servers.append({"urls": turn, "username": username, "credential": credential})
    return servers
