"""Users, projects, roles, who may launch desktop apps, API tokens and browser sessions (Redis)."""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from farm import keys, redisclock
from farm.cells import check_cell
from farm.errors import BadParameter, NotFound
from farm.redisclient import Redis, guard

ROLES = ("admin", "member", "viewer")
#: what a role may do, weakest first: a role may do what every role after it may
ROLE_RANK = {"viewer": 0, "member": 1, "admin": 2}
#: the weakest role that may launch desktop-like apps where a project says nothing: a shell in a
#: session is the widest thing a member can run, so only a project's admins by default
DESKTOP_ROLE = "admin"
#: what a project may choose instead (viewers never control a session)
DESKTOP_ROLES = ("admin", "member")
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
    #: the cell each of their projects is pinned to, in a farm of cells (farm.cells)
    cells: dict[str, str] = field(default_factory=dict)

    def role(self, project: str) -> str | None:
        return self.roles.get(project)

    def projects_in(self, cell: str) -> list[str]:
        """Their projects that live in ``cell`` (all of them in a farm of one cell), sorted."""
        return sorted(p for p in self.roles if not cell or self.cells.get(p, cell) == cell)


@dataclass(frozen=True)
class IssuedToken:
    token_id: str
    token: str
    user: str


class Accounts:
    """The account records in Redis; every method is one or a few blocking Redis calls.

    In a farm of cells ``conn`` is the control Redis every cell shares (FARM_CONTROL_REDIS_URL)
    and ``cell`` the cell of the caller (FARM_CELL): a project it makes is pinned to that cell,
    and one made before the farm had cells to the first cell that loads one of its members."""

    def __init__(self, conn: Redis, cell: str = "") -> None:
        self.conn = conn
        self.cell = cell
        #: project -> its cell, once read: a pin never changes, so a web (or the front door)
        #: reads each project's once, not on every request
        self._pins: dict[str, str] = {}

    # --- users and projects -------------------------------------------------------------------

    def ensure_project(self, project: str, name: str | None = None, cell: str = "") -> None:
        """Make ``project`` if it is new, pinned to ``cell`` (else to this caller's cell, in a
        farm of cells); a project's pin never changes."""
        check_name("project", project)
        pipe = self.conn.pipeline()
        pipe.sadd(keys.PROJECTS, project)
        pipe.hsetnx(keys.project(project), "name", name or project)
        pipe.hsetnx(keys.project(project), "created", time.time())
        if cell or self.cell:
            pipe.hsetnx(keys.project(project), "cell", check_cell(cell) if cell else self.cell)
        guard(pipe.execute)

    def project_exists(self, project: str) -> bool:
        return bool(guard(self.conn.hexists, keys.project(project), "created"))

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

    def set_role(self, user: str, project: str, role: str, cell: str = "") -> None:
        """``user`` gets ``role`` in ``project``, which is made if new (pinned to ``cell``)."""
        check_role(role)
        self.ensure_project(project, cell=cell)
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
        return User(name, admin == "1", dict(roles), self._cells(list(roles)) if self.cell else {})

    def _cells(self, projects: list[str]) -> dict[str, str]:
        """The cell of each project, pinning those that have none yet to this one."""
        unread = [p for p in projects if p not in self._pins]
        if unread:
            pipe = self.conn.pipeline(transaction=False)
            for p in unread:
                pipe.hget(keys.project(p), "cell")
            found = dict(zip(unread, guard(pipe.execute), strict=True))
            unpinned = [p for p, c in found.items() if not c]
            if unpinned:
                pipe = self.conn.pipeline(transaction=False)
                for p in unpinned:
                    pipe.hsetnx(keys.project(p), "cell", self.cell)
                    pipe.hget(keys.project(p), "cell")
                found.update(zip(unpinned, guard(pipe.execute)[1::2], strict=True))
            self._pins.update((p, c) for p, c in found.items() if c)
        return {p: self._pins[p] for p in projects if p in self._pins}

    def project_cell(self, project: str) -> str | None:
        """The cell ``project`` is pinned to; None for one not pinned yet (or no such project)."""
        if project not in self._pins:
            cell: str | None = guard(self.conn.hget, keys.project(project), "cell")
            if not cell:
                return None
            self._pins[project] = cell
        return self._pins[project]

    def project_names(self, projects: list[str]) -> dict[str, str]:
        pipe = self.conn.pipeline()
        for p in projects:
            pipe.hget(keys.project(p), "name")
        names = guard(pipe.execute) if projects else []
        return {p: n or p for p, n in zip(projects, names, strict=True)}

    # --- desktop apps -------------------------------------------------------------------------

    def desktop_role(self, project: str) -> str:
        """The weakest role of ``project`` that may launch desktop-like apps (a shell)."""
        stored = guard(self.conn.hget, keys.project(project), "desktop_role")
        return stored if stored in ROLE_RANK else DESKTOP_ROLE

    def set_desktop_role(self, project: str, role: str) -> None:
        if role not in DESKTOP_ROLES:
            raise BadParameter(
                f"desktop_apps must be one of {', '.join(DESKTOP_ROLES)} (the weakest role that "
                f"may launch desktop apps), not {role!r}"
            )
        guard(self.conn.hset, keys.project(project), "desktop_role", role)

    def may_launch_desktop(self, user: User, project: str) -> bool:
        if user.admin:
            return True
        role = user.role(project)
        return role is not None and ROLE_RANK[role] >= ROLE_RANK[self.desktop_role(project)]

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
        """The token stops working, and so does every browser session made with it."""
        sha = guard(self.conn.hget, keys.TOKEN_IDS, token_id)
        if sha is None:
            raise NotFound(f"no token with id {token_id!r}", token_id=token_id)
        user = guard(self.conn.hget, keys.token(sha), "user")
        sessions = guard(self.conn.smembers, keys.token_sessions(token_id))
        pipe = self.conn.pipeline()
        pipe.delete(keys.token(sha))
        pipe.hdel(keys.TOKEN_IDS, token_id)
        for s in sessions:
            pipe.delete(keys.web_session(s))
            if user:
                pipe.zrem(keys.user_sessions(user), s)
        pipe.delete(keys.token_sessions(token_id))
        guard(pipe.execute)

    def user_for_token(self, token: str) -> str | None:
        if not token.startswith(TOKEN_PREFIX):
            return None
        name: str | None = guard(self.conn.hget, keys.token(digest(token)), "user")
        return name

    def token_id_for(self, token: str) -> str | None:
        if not token.startswith(TOKEN_PREFIX):
            return None
        token_id: str | None = guard(self.conn.hget, keys.token(digest(token)), "id")
        return token_id

    # --- browser sessions -------------------------------------------------------------------

    def create_session(self, user: str, ttl_s: float, token_id: str = "") -> str:
        """A new session cookie for ``user``, made with the token ``token_id`` (it ends when
        that token is revoked). Only its sha256 is stored."""
        session = secrets.token_urlsafe(32)
        sha = digest(session)
        now = redisclock.now(self.conn)  # any web replica lists and ends it
        expires = now + ttl_s
        pipe = self.conn.pipeline()
        pipe.hset(keys.web_session(sha), mapping={"user": user, "token_id": token_id,
                                                  "created": now, "expires": expires})  # fmt: skip
        pipe.pexpire(keys.web_session(sha), int(ttl_s * 1000))
        pipe.zadd(keys.user_sessions(user), {sha: expires})
        pipe.zremrangebyscore(keys.user_sessions(user), "-inf", now)
        if token_id:
            pipe.sadd(keys.token_sessions(token_id), sha)
        guard(pipe.execute)
        return session

    def user_for_session(self, session: str) -> str | None:
        """The session's user, while the session lives and the token it was made with does."""
        key = keys.web_session(digest(session))
        pipe = self.conn.pipeline(transaction=False)
        pipe.type(key)
        pipe.hgetall(key)
        kind, data = guard(pipe.execute, raise_on_error=False)
        if kind == "string":
            # a session of the farm before sessions knew their token: it logs in again
            guard(self.conn.delete, key)
            return None
        if isinstance(data, Exception) or not data or "user" not in data:
            return None
        token_id = data.get("token_id", "")
        if token_id and not guard(self.conn.hexists, keys.TOKEN_IDS, token_id):
            return None
        name: str = data["user"]
        return name

    def end_session(self, session: str) -> None:
        self.end_session_by_id(digest(session))

    def session_owner(self, session_id: str) -> str | None:
        if not re.fullmatch(r"[0-9a-f]{64}", session_id):
            return None
        owner: str | None = guard(self.conn.hget, keys.web_session(session_id), "user")
        return owner

    def end_session_by_id(self, session_id: str) -> bool:
        """End the session whose sha256 is ``session_id``; False when there was none."""
        data = guard(self.conn.hgetall, keys.web_session(session_id))
        pipe = self.conn.pipeline()
        pipe.delete(keys.web_session(session_id))
        if data.get("user"):
            pipe.zrem(keys.user_sessions(data["user"]), session_id)
        if data.get("token_id"):
            pipe.srem(keys.token_sessions(data["token_id"]), session_id)
        guard(pipe.execute)
        return bool(data)

    def sessions(self, user: str) -> list[dict[str, Any]]:
        """The user's live browser sessions, newest first: id (the cookie's sha256, not the
        cookie), token id, created and expires (epoch s)."""
        now = redisclock.now(self.conn)
        ids = guard(self.conn.zrevrangebyscore, keys.user_sessions(user), "+inf", now)
        pipe = self.conn.pipeline()
        for sha in ids:
            pipe.hgetall(keys.web_session(sha))
        out = []
        for sha, data in zip(ids, guard(pipe.execute) if ids else [], strict=True):
            if not data:
                continue
            out.append({"session_id": sha, "user": user, "token_id": data.get("token_id", ""),
                        "created": float(data.get("created", 0)),
                        "expires": float(data.get("expires", 0))})  # fmt: skip
        out.sort(key=lambda s: -s["created"])
        return out

    # --- membership ---------------------------------------------------------------------------

    def members(self, project: str) -> dict[str, str]:
        out: dict[str, str] = guard(self.conn.hgetall, keys.project_members(project))
        return out

    def remove_member(self, user: str, project: str) -> None:
        """``user`` leaves ``project``: their tokens and sessions no longer reach it."""
        if guard(self.conn.hget, keys.project_members(project), user) is None:
            raise NotFound(f"{user!r} is not a member of project {project!r}", user=user,
                           project=project)  # fmt: skip
        pipe = self.conn.pipeline()
        pipe.hdel(keys.project_members(project), user)
        pipe.hdel(keys.user_projects(user), project)
        guard(pipe.execute)

    # --- first start ------------------------------------------------------------------------

    def bootstrap_admin(self, user: str = "admin", project: str = "default") -> IssuedToken:
        """An admin of the whole farm with a fresh token (``farm up`` prints it)."""
        self.ensure_user(user, admin=True)
        self.set_role(user, project, "admin")
        return self.create_token(user)
