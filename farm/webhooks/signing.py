"""Webhook signatures: HMAC-SHA256 of ``<timestamp>.<body>`` with the hook's secret.

The receiver recomputes it from the ``X-Tessera-Timestamp`` header and the raw body, compares
in constant time, and refuses a timestamp far from its clock (a replayed request).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: the prefix of every hook secret, so one pasted into the wrong place is recognisable
SECRET_PREFIX = "whsec_"
#: the signature scheme's version, the prefix of X-Tessera-Signature's value
SCHEME = "v1"
#: how far from the receiver's clock a timestamp may be before ``verify`` refuses it
TOLERANCE_S = 300


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """The X-Tessera-Signature value for ``body`` sent at ``timestamp`` (epoch s)."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"{SCHEME}={mac.hexdigest()}"


def verify(
    secret: str, timestamp: str, signature: str, body: bytes, now: float,
    tolerance_s: float = TOLERANCE_S,
) -> bool:  # fmt: skip
    """The receiver's check: the signature is ours for this body and timestamp, and the
    timestamp is within ``tolerance_s`` of ``now``."""
    try:
        sent = int(timestamp)
    except ValueError:
        return False
    if abs(now - sent) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, sent, body), signature)
