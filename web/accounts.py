"""Users, projects, roles, device policies, API tokens and browser sessions, kept in Redis."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field

from farm import keys
from farm.errors import BadParameter, NotFound
from farm.redisclient import Redis, guard
from farm.settings import DEVICE_KINDS

ROLES = ("admin", "member", "viewer")
#: what a role may do, weakest first: a role may do what every role after it may
ROLE_RANK = {"viewer": 0, "member": 1, "admin": 2}
#: device classes each role may use where a project sets no policy of its own
DEFAULT_POLICY: dict[str, tuple[str, ...]] = {
    "admin": DEVICE_KINDS,
    "member": DEVICE_KINDS,
    "viewer": (),
}
#: prefix of every API token, so one pasted into the wrong place is recognisable
TOKEN_PREFIX = "tsr_"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def digest(secret: str) -> str:
    """The stored form of a token or session id (both are high-entropy random strings)."""
    return hashlib.sha256(secret.encode()).hexdigest()


def check_name(kind: str, name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise BadParameter(
            f"{kind} name {name!r} must be 1 to 64 letters, digits or . _ @ -, "
            "starting with a letter or digit"
        )
    return name


def check_role(role: str) -> str:
    if role not in ROLES:
        raise BadParameter(f"role {role!r} is not one of {', '.join(ROLES)}")
    return role


@dataclass(frozen=True)
class User:
    """A user as a request sees them: global admin flag and their role in each project."""

    name: str
    admin: bool
    roles: dict[str, str] = field(default_factory=dict)

    def role(self, project: str) -> str | None:
        return self.roles.get(project)


@dataclass(frozen=True)
class IssuedToken:
    token_id: str
    token: str
    user: str


class Accounts:
    """The account records in Redis; every method is one or a few blocking Redis calls."""

    def __init__(self, conn: Redis) -> None:
        self.conn = conn

    # --- users and projects -------------------------------------------------------------------

    def ensure_project(self, project: str, name: str | None = None) -> None:
        check_name("project", project)
        pipe = self.conn.pipeline()
        pipe.sadd(keys.PROJECTS, project)
        pipe.hsetnx(keys.project(project), "name", name or project)
        pipe.hsetnx(keys.project(project), "created", time.time())
        guard(pipe.execute)

    def ensure_user(self, user: str, *, admin: bool = False) -> None:
        check_name("user", user)
        pipe = self.conn.pipeline()
        pipe.sadd(keys.USERS, user)
        pipe.hsetnx(keys.user(user), "created", time.time())
        if admin:
            pipe.hset(keys.user(user), "admin", 1)
        else:
            pipe.hsetnx(keys.user(user), "admin", 0)
        guard(pipe.execute)

    def set_role(self, user: str, project: str, role: str) -> None:
        check_role(role)
        self.ensure_project(project)
        self.ensure_user(user)
        pipe = self.conn.pipeline()
        pipe.hset(keys.project_members(project), user, role)
        pipe.hset(keys.user_projects(user), project, role)
        guard(pipe.execute)

    def user(self, name: str) -> User | None:
        pipe = self.conn.pipeline()
        pipe.hget(keys.user(name), "admin")
        pipe.hgetall(keys.user_projects(name))
        admin, roles = guard(pipe.execute)
        if admin is None:
            return None
        return User(name, admin == "1", dict(roles))

    def project_names(self, projects: list[str]) -> dict[str, str]:
        pipe = self.conn.pipeline()
        for p in projects:
            pipe.hget(keys.project(p), "name")
        names = guard(pipe.execute) if projects else []
        return {p: n or p for p, n in zip(projects, names, strict=True)}

    # --- device policy ----------------------------------------------------------------------

    def policy(self, project: str) -> dict[str, tuple[str, ...]]:
        stored = guard(self.conn.hgetall, keys.project_policy(project))
        out = dict(DEFAULT_POLICY)
        for role, devices in stored.items():
            out[role] = tuple(d for d in devices.split(",") if d)
        return out

    def set_policy(self, project: str, role: str, devices: list[str]) -> None:
        check_role(role)
        for d in devices:
            if d not in DEVICE_KINDS:
                raise BadParameter(f"device {d!r} is not one of {', '.join(DEVICE_KINDS)}")
        guard(self.conn.hset, keys.project_policy(project), role, ",".join(devices))

    # --- API tokens ---------------------------------------------------------------------------

    def create_token(self, user: str) -> IssuedToken:
        """A new token for ``user``; only its sha256 is stored, so it is shown once."""
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token_id = secrets.token_hex(6)
        sha = digest(token)
        pipe = self.conn.pipeline()
        pipe.hset(keys.token(sha), mapping={"id": token_id, "user": user, "created": time.time()})
        pipe.hset(keys.TOKEN_IDS, token_id, sha)
        guard(pipe.execute)
        return IssuedToken(token_id, token, user)

    def revoke_token(self, token_id: str) -> None:
        sha = guard(self.conn.hget, keys.TOKEN_IDS, token_id)
        if sha is None:
            raise NotFound(f"no token with id {token_id!r}", token_id=token_id)
        pipe = self.conn.pipeline()
        pipe.delete(keys.token(sha))
        pipe.hdel(keys.TOKEN_IDS, token_id)
        guard(pipe.execute)

    def user_for_token(self, token: str) -> str | None:
        if not token.startswith(TOKEN_PREFIX):
            return None
        name: str | None = guard(self.conn.hget, keys.token(digest(token)), "user")
        return name

    # --- browser sessions -------------------------------------------------------------------

    def create_session(self, user: str, ttl_s: float) -> str:
        session = secrets.token_urlsafe(32)
        guard(self.conn.set, keys.web_session(digest(session)), user, px=int(ttl_s * 1000))
        return session

    def user_for_session(self, session: str) -> str | None:
        name: str | None = guard(self.conn.get, keys.web_session(digest(session)))
        return name

    def end_session(self, session: str) -> None:
        guard(self.conn.delete, keys.web_session(digest(session)))

    # --- first start ------------------------------------------------------------------------

    def bootstrap_admin(self, user: str = "admin", project: str = "default") -> IssuedToken:
        """An admin of the whole farm with a fresh token (``farm up`` prints it)."""
        self.ensure_user(user, admin=True)
        self.set_role(user, project, "admin")
        return self.create_token(user)
