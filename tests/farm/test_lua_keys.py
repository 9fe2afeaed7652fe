"""The Lua scripts name every Redis key as farm/keys.py spells it: no script source spells a key
itself, and the keys the scripts build in Redis are the ones Python builds."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType

import redis

from farm import jobscripts, keys
from farm.alloc import scripts
from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
from tests.conftest import REPO

#: the modules that render keys into their Lua, and every key they render
RENDERING: tuple[ModuleType, ...] = (scripts, jobscripts)


def _lua_modules() -> list[Path]:
    """Every source file of the farm's packages holding Lua (a ``redis.call``)."""
    found = []
    for package in ("farm", "web", "workers", "encoder"):
        for path in sorted((REPO / package).rglob("*.py")):
            if "redis.call" in path.read_text():
                found.append(path)
    return found


def test_no_lua_source_spells_a_key_itself() -> None:
    sources = _lua_modules()
    names = {str(p.relative_to(REPO)) for p in sources}
    assert {"farm/alloc/scripts.py", "farm/jobscripts.py"} <= names, names
    spelled = [str(p.relative_to(REPO)) for p in sources if f"{keys.PREFIX}:" in p.read_text()]
    assert spelled == [], f"Lua sources spelling a key instead of taking farm.keys': {spelled}"


def _lua_names(module: ModuleType) -> list[str]:
    """The farm.keys names whose Lua definitions ``module`` renders (``keys.NAME`` lines)."""
    out = []
    for line in module.KEYS_LUA.splitlines():
        if line.startswith("keys."):
            out.append(line.split()[0].removeprefix("keys."))
        elif line.startswith("function keys."):
            out.append(line.removeprefix("function keys.").split("(")[0])
    return out


def test_the_scripts_keys_are_the_ones_farm_keys_spells(rconn: redis.Redis) -> None:
    for module in RENDERING:
        names = _lua_names(module)
        assert names, module.__name__
        expressions, expected = [], []
        for name in names:
            value = getattr(keys, name)
            if isinstance(value, str):
                expressions.append(f"keys.{name}")
                expected.append(value)
            else:
                args = [f"a{i}" for i in range(len(inspect.signature(value).parameters))]
                lua_args = ", ".join(f"ARGV[{i + 1}]" for i in range(len(args)))
                expressions.append(f"keys.{name}({lua_args})")
                expected.append(value(*args))
        script = module.KEYS_LUA + f"return {{{', '.join(expressions)}}}"
        got = rconn.eval(script, 0, "a0", "a1")
        assert got == expected, module.__name__


def test_what_the_allocator_writes_lives_under_farm_keys_names(redis_url: str) -> None:
    conn = redis.Redis.from_url(redis_url, decode_responses=True)
    alloc = SlotAllocator(conn, ttl_s=10)
    alloc.register("agent-1", "host-1", [DeviceOffer("gpu-0", "t4", "Tesla T4", 15360, 2, 2)], 60)
    alloc.set_policy("film", "member", ["gpu"])
    stream = alloc.acquire("s", Request("stream", encoder_sessions=1, project="film",
                                        role="member", preempt=True))  # fmt: skip
    render = alloc.acquire("r", Request("render", render_slots=1, project="film", job="j1"))
    alloc.release(render)
    alloc.devices()
    expected = {
        keys.DEVICES, keys.DEVICE_ALIVE, keys.DEVICE_CLASSES, keys.DEVICE_SHAPES,
        keys.LEASE_EXPIRY, keys.USAGE_PROJECTS, keys.device("gpu-0"), keys.device_leases("gpu-0"),
        keys.agent("agent-1"), keys.host("host-1"), keys.host_devices("host-1"),
        keys.lease(stream.id), keys.project_policy("film"), keys.usage("film"),
        keys.usage_totals("film"),
        *(keys.placement(c, k) for c in ("t4", "*") for k in ("render", "stream")),
    }  # fmt: skip
    written = set(conn.keys("*"))
    assert written == expected, (written - expected, expected - written)
    conn.close()
