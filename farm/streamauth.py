"""Stream tokens: what the web signs (HMAC-SHA256 with FARM_STREAM_SECRET) for each call it
makes to a stream service, and what the service checks; operators' tokens too.

A token is ``<payload>.<signature>``, both base64url; the payload is JSON::

    {"v": 1, "kind": "viewer", "project": "p", "session": "sid" or "" (a new session),
     "role": "controller" | "spectator", "desktop": false, "project_role": "member",
     "exp": 1767225600}

``desktop`` says the project's policy lets this user launch desktop-like apps (a shell: project
admins only unless the project says otherwise); the web decides it, the service obeys it.
``project_role`` is the user's role in the project (admin, member, viewer): the session's
lease asks the allocator as that role, so the project's device policy holds on the service.

``kind: operator`` reaches every route of the service (no project or session);
``operator_token(secret, ttl_s)`` makes one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import asdict, dataclass, replace

from farm.errors import Forbidden, SetupError, Unauthorized

VERSION = 1
KINDS = ("viewer", "operator")
ROLES = ("controller", "spectator")
#: the least secret length FARM_STREAM_SECRET may have (bytes of text)
MIN_SECRET = 32


@dataclass(frozen=True)
class StreamClaims:
    kind: str
    exp: float
    project: str = ""
    session: str = ""
    role: str = "spectator"
    desktop: bool = False
    project_role: str = ""
    v: int = VERSION

    @property
    def operator(self) -> bool:
        return self.kind == "operator"

    def for_session(self, session_id: str) -> StreamClaims:
        return replace(self, session=session_id)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def check_secret(secret: str) -> None:
    if len(secret) < MIN_SECRET:
        raise SetupError(
            f"FARM_STREAM_SECRET must be set to the same random secret (at least {MIN_SECRET} "
            "characters) for the web and every stream service; `farm up` makes one, or run "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
        )


def sign(secret: str, claims: StreamClaims) -> str:
    payload = _b64(json.dumps(asdict(claims), separators=(",", ":"), sort_keys=True).encode())
    mac = hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest()
    return f"{payload}.{_b64(mac)}"


def viewer_token(
    secret: str,
    project: str,
    session: str,
    role: str,
    ttl_s: float,
    desktop: bool = False,
    project_role: str = "",
    now: float | None = None,
) -> str:
    """A token for one project's session (``session=""``: creating one), as ``role``, for a
    user whose role in the project is ``project_role``; it expires ``ttl_s`` after ``now``
    (this host's time when None; the web gives Redis's, which the stream service checks it
    with)."""
    if role not in ROLES:
        raise ValueError(f"stream role {role!r} is not one of {ROLES}")
    claims = StreamClaims(
        "viewer",
        (time.time() if now is None else now) + ttl_s,
        project,
        session,
        role,
        desktop,
        project_role,
    )
    return sign(secret, claims)


def operator_token(secret: str, ttl_s: float, now: float | None = None) -> str:
    exp = (time.time() if now is None else now) + ttl_s
    return sign(secret, StreamClaims("operator", exp, role="controller"))


def verify(secret: str, token: str, now: float | None = None) -> StreamClaims:
    """The claims of a token signed with ``secret`` and not expired; Unauthorized otherwise."""
    payload, _, mac = token.partition(".")
    try:
        given = _unb64(mac)
    except ValueError:
        raise Unauthorized("the stream token is malformed") from None
    want = hmac.new(secret.encode(), payload.encode(), hashlib.sha256).digest()
    if not mac or not hmac.compare_digest(given, want):
        raise Unauthorized("the stream token is not signed by this farm")
    try:
        data = json.loads(_unb64(payload))
        claims = StreamClaims(**data)
    except (ValueError, TypeError):
        raise Unauthorized("the stream token is malformed") from None
    if claims.v != VERSION or claims.kind not in KINDS or claims.role not in ROLES:
        raise Unauthorized("the stream token is of an unknown kind")
    if claims.exp < (time.time() if now is None else now):
        raise Unauthorized("the stream token has expired; ask the web for a new one")
    return claims


def require_session(claims: StreamClaims, session_id: str) -> None:
    """The token is for ``session_id`` (operators reach every session)."""
    if not claims.operator and claims.session != session_id:
        raise Forbidden("this stream token is for another session", session_id=session_id)


def require_controller(claims: StreamClaims) -> None:
    if claims.role != "controller":
        raise Forbidden("a spectator cannot control, end or launch a session")
