"""Lua code that Redis keeps as a function library: helpers defined once, one FCALL per call.

A script sent with EVALSHA runs its whole text on every call, so the helpers a family of
scripts shares (key spellings, the allocator's placement and usage code, the job store's
transition table) were created again each time: 5 to 12 us of every call inside Redis. A
library is loaded once (``FUNCTION LOAD``); each call runs only its own function.

A library's name and its functions' names carry a digest of its text, as EVALSHA names a
script by its hash: two versions of the farm (a rolling upgrade) each call their own code, and
a call to a server without the library (a fresh or restarted Redis without persistence, a
replica promoted before it had it) loads it and calls again. A server without functions
(Redis before 7), or a client whose ACL user may not load them, runs the same code as plain
scripts (EVALSHA).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import redis

from farm.redisclient import Redis

__all__ = ["Function", "Library"]

_NAME = re.compile(r"[A-Za-z0-9_]+")


class Library:
    """Lua functions sharing one prelude (its local helpers and constants).

    ``bodies`` maps a function's short name to its code, written as a script's: it reads
    ``KEYS`` and ``ARGV`` and returns its reply. ``scripts[name]`` is the prelude and that body
    as one script, the same code for a server without functions.
    """

    def __init__(self, name: str, prelude: str, bodies: Mapping[str, str]) -> None:
        for n in (name, *bodies):
            if not _NAME.fullmatch(n):
                raise ValueError(f"Lua function name {n!r}: letters, digits and _ only")
        text = prelude + "".join(f"\n-- {n}\n{body}" for n, body in sorted(bodies.items()))
        self.digest = hashlib.sha1(text.encode()).hexdigest()[:12]
        self.name = f"{name}_{self.digest}"
        self.scripts = {n: prelude + body for n, body in bodies.items()}
        registrations = "".join(
            f"\nredis.register_function('{self.function_name(n)}', function(KEYS, ARGV)\n"
            f"{body}\nend)\n"
            for n, body in sorted(bodies.items())
        )
        self.source = f"#!lua name={self.name}\n{prelude}\n{registrations}"

    def function_name(self, name: str) -> str:
        """What FCALL calls: the library's name, the function's, the digest."""
        return f"{self.name.rsplit('_', 1)[0]}_{name}_{self.digest}"

    def bind(self, conn: Redis, name: str) -> Function:
        if name not in self.scripts:
            raise KeyError(f"no Lua function {name!r} in library {self.name}")
        return Function(conn, self, name)


class Function:
    """One function of a library on one client: called like redis-py's Script
    (``fn(keys=[...], args=[...])``); redis-py's errors pass through (wrap it in ``guard``)."""

    def __init__(self, conn: Redis, library: Library, name: str) -> None:
        self.conn = conn
        self.library = library
        self.name = library.function_name(name)
        self._script = conn.register_script(library.scripts[name])
        #: False once the server answered that it has no functions: plain scripts from then on
        self._functions = True

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        if not self._functions:
            return self._script(keys=keys, args=args)
        try:
            return self.conn.fcall(self.name, len(keys), *keys, *args)
        except redis.ResponseError as exc:
            if _no_functions(exc):
                return self._as_script(keys, args)
            if "function not found" not in str(exc).lower():
                raise
        # this server lacks the library: load it (every loader writes the same text) and call
        # again; the call failed before it ran, so nothing was done twice
        try:
            self.conn.function_load(self.library.source, replace=True)
        except redis.ResponseError as exc:
            if not _no_functions(exc):
                raise
            return self._as_script(keys, args)
        return self.conn.fcall(self.name, len(keys), *keys, *args)

    def queue(self, pipe: Any, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> None:
        """Send this call with ``pipe`` (a pipeline of this client's server, executed with
        ``raise_on_error=False``): one round trip with the pipeline's other calls. Read its
        reply with ``reply``."""
        if self._functions:
            pipe.fcall(self.name, len(keys), *keys, *args)
        else:
            self._script(keys=keys, args=args, client=pipe)

    def reply(self, value: Any, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        """The reply of a call sent with ``queue``: where the server lacked the library (it
        did not run), the call made again on its own, which loads it; another refusal is
        raised."""
        if isinstance(value, redis.ResponseError):
            why = str(value).lower()
            if _no_functions(value) or "function not found" in why:
                return self(keys, args)
            raise value
        return value

    def _as_script(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        self._functions = False
        return self._script(keys=keys, args=args)


def _no_functions(error: redis.ResponseError) -> bool:
    """The server has no functions (Redis before 7: an unknown command) or this client may
    not use them (an ACL without FCALL or FUNCTION LOAD): plain scripts, then."""
    why = str(error).lower()
    return "unknown command" in why or "noperm" in why or "no permissions" in why
