"""Lua function libraries (farm/luafunctions.py): loaded once where missing, versions side by
side, and the same code as plain scripts on a server without functions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from farm.alloc import scripts
from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
from farm.luafunctions import Library
from farm.redisserver import RedisServer

PRELUDE = "local function bump(k, by) return redis.call('INCRBY', k, by) end\n"


def _library(step: int) -> Library:
    return Library(
        "counter",
        PRELUDE + f"local STEP = {step}\n",
        {"bump": "return bump(KEYS[1], STEP)", "refuse": "return redis.error_reply('no room')"},
    )


def _libraries(conn: redis.Redis) -> set[str]:
    # each library is a flat list of names and values (RESP2)
    return {
        dict(zip(lib[::2], lib[1::2], strict=True))["library_name"] for lib in conn.function_list()
    }


def test_a_server_without_the_library_loads_it_and_runs_the_call_once(
    rconn: redis.Redis,
) -> None:
    # a fresh Redis, or one restarted without persistence: no function is there
    rconn.function_flush()
    library = _library(1)
    bump = library.bind(rconn, "bump")
    assert bump(keys=["n"]) == 1
    assert library.name in _libraries(rconn)
    assert bump(keys=["n"]) == 2
    # the allocator's library too, from any client's first call
    alloc = SlotAllocator(rconn, ttl_s=10)
    alloc.register("agent", "host", [DeviceOffer("gpu-0", "t4", "T4", 16000, 2, 1)], ttl_s=60)
    assert scripts.LIBRARY.name in _libraries(rconn)


def test_two_versions_of_a_library_are_called_side_by_side(rconn: redis.Redis) -> None:
    # a rolling upgrade: old and new code each call their own functions on one server
    old, new = _library(1), _library(10)
    assert old.name != new.name
    old.bind(rconn, "bump")(keys=["n"])
    new.bind(rconn, "bump")(keys=["n"])
    assert old.bind(rconn, "bump")(keys=["n"]) == 12
    assert {old.name, new.name} <= _libraries(rconn)


def test_a_functions_own_error_is_its_reply_not_a_missing_library(rconn: redis.Redis) -> None:
    library = _library(1)
    library.bind(rconn, "bump")(keys=["n"])
    rconn.function_delete(library.name)
    with pytest.raises(redis.ResponseError, match="no room"):
        library.bind(rconn, "refuse")()
    # loaded on the miss, the error is the function's own answer
    assert library.name in _libraries(rconn)


def test_calls_sent_with_a_pipeline_load_a_missing_library_and_keep_their_errors(
    rconn: redis.Redis,
) -> None:
    """A worker's renewal sends two libraries' calls in one pipeline: a call that missed its
    library is made again on its own (which loads it), once; a function's own error is raised."""
    rconn.function_flush()
    library = _library(1)
    bump, refuse = library.bind(rconn, "bump"), library.bind(rconn, "refuse")
    for expected in (1, 2):
        pipe = rconn.pipeline(transaction=False)
        bump.queue(pipe, keys=["n"])
        refuse.queue(pipe)
        first, second = pipe.execute(raise_on_error=False)
        assert bump.reply(first, keys=["n"]) == expected
        with pytest.raises(redis.ResponseError, match="no room"):
            refuse.reply(second)
    assert library.name in _libraries(rconn)


@pytest.fixture(scope="module")
def no_functions_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server that answers FUNCTION and FCALL as Redis 6 does: unknown commands."""
    work = tmp_path_factory.mktemp("redis6")
    wrapper = Path(work) / "redis-server-6"
    wrapper.write_text(
        '#!/bin/sh\nexec redis-server "$@" --rename-command FCALL "" --rename-command FUNCTION ""\n'
    )
    wrapper.chmod(0o755)
    with RedisServer(work, binary=str(wrapper)) as server:
        yield server.url


def test_a_server_without_functions_runs_the_same_code_as_scripts(no_functions_url: str) -> None:
    conn = redis.Redis.from_url(no_functions_url, decode_responses=True)
    with pytest.raises(redis.ResponseError, match="unknown command"):
        conn.fcall("anything", 0)
    assert _library(1).bind(conn, "bump")(keys=["n"]) == 1
    alloc = SlotAllocator(conn, ttl_s=10)
    alloc.register("agent", "host", [DeviceOffer("gpu-0", "t4", "T4", 16000, 2, 1)], ttl_s=60)
    lease = alloc.acquire("h", Request("stream", vram_mib=1000, encoder_sessions=1))
    assert alloc.check(alloc.renew(lease))
    assert alloc.release(lease)
    assert alloc.devices()[0].used_encoder_sessions == 0
    conn.close()


def test_a_client_whose_acl_refuses_function_load_runs_scripts(
    rconn: redis.Redis, redis_url: str
) -> None:
    # a managed Redis may grant scripts but not FUNCTION LOAD
    rconn.function_flush()
    rconn.acl_setuser(
        "scripts-only", enabled=True, nopass=True, keys=["*"], channels=["*"],
        commands=["+@all", "-function"],
    )  # fmt: skip
    limited = redis.Redis.from_url(redis_url, username="scripts-only")
    try:
        with pytest.raises(redis.ResponseError, match=r"(?i)permission"):
            limited.function_load(_library(1).source)
        assert _library(1).bind(limited, "bump")(keys=["n"]) == 1
        assert _libraries(rconn) == set()
    finally:
        limited.close()
        rconn.acl_deluser("scripts-only")
