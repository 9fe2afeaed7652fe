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


def sign_all(secrets_: list[str], timestamp: int, body: bytes) -> str:
    """The header with one signature per secret, comma-separated (the new secret's first,
    then the previous one's during a rotation's grace period)."""
    return ",".join(sign(s, timestamp, body) for s in secrets_)


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
    mine = sign(secret, sent, body)
    # any of the header's signatures (two while a rotated secret's grace period runs)
    return any(hmac.compare_digest(mine, given.strip()) for given in signature.split(","))
