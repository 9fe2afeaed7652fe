"""The allocator's policies, one case at a time, against the real scripts."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from farm.alloc.allocator import DeviceOffer, Request, SlotAllocator
from farm.errors import Forbidden, LeaseLost, NeverFits, NoCapacity

T4 = DeviceOffer("gpu-t4", "t4", "Tesla T4", 15360, 8, 2)
L4 = DeviceOffer("gpu-l4", "l4", "NVIDIA L4", 23034, 16, 2)
A100 = DeviceOffer("gpu-a100", "a100", "NVIDIA A100", 81920, 0, 4)


class Clock:
    def __init__(self) -> None:
        self.ms = 5_000_000

    def __call__(self) -> int:
        return self.ms


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def alloc(redis_url: str, clock: Clock) -> SlotAllocator:
    a = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=10, clock_ms=clock)
    a.register("agent", "host-1", [T4, L4, A100], ttl_s=3600)
    return a


def test_renders_pack_onto_the_busiest_device_that_fits(alloc: SlotAllocator) -> None:
    first = alloc.acquire("r1", Request("render", vram_mib=8000, render_slots=1))
    second = alloc.acquire("r2", Request("render", vram_mib=8000, render_slots=1))
    # the second goes where the first left the least room, not to an empty device
    assert second.device == first.device


def test_streams_spread_over_the_least_loaded_encoders(alloc: SlotAllocator) -> None:
    devices = [alloc.acquire(f"s{i}", Request("stream", encoder_sessions=1)).device
               for i in range(4)]  # fmt: skip
    assert set(devices) == {"gpu-t4", "gpu-l4"}  # never the A100: it has no NVENC


def test_a_request_that_can_never_fit_is_refused_at_once_with_the_reason(
    alloc: SlotAllocator,
) -> None:
    with pytest.raises(NeverFits) as err:
        alloc.acquire("s", Request("stream", encoder_sessions=1, classes=("a100",)), wait_s=30)
    assert "1 encoder session(s)" in err.value.message and "a100" in err.value.message
    with pytest.raises(NeverFits):
        alloc.acquire("r", Request("render", vram_mib=100_000))


def test_a_request_that_could_fit_later_waits_then_is_refused(alloc: SlotAllocator) -> None:
    held = [alloc.acquire(f"r{i}", Request("render", render_slots=1, classes=("t4",)))
            for i in range(2)]  # fmt: skip
    with pytest.raises(NoCapacity):
        alloc.acquire("r3", Request("render", render_slots=1, classes=("t4",)), wait_s=0.2)
    alloc.release(held[0])
    assert alloc.acquire("r3", Request("render", render_slots=1, classes=("t4",))).device == T4.id


def test_a_waiter_told_to_stop_gives_up_at_once(alloc: SlotAllocator) -> None:
    # a worker SIGTERMed while it waits for a device must not wait out the 30 s (chaos run)
    for i in range(2):
        alloc.acquire(f"r{i}", Request("render", render_slots=1, classes=("t4",)))
    stop = threading.Event()
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(NoCapacity) as err:
        alloc.acquire("r3", Request("render", render_slots=1, classes=("t4",)), wait_s=60,
                      stop=stop)  # fmt: skip
    timer.join()
    assert time.monotonic() - t0 < 10, "the waiter kept waiting after it was told to stop"
    assert "stopped waiting" in err.value.message


def test_tokens_grow_and_a_reissued_device_fences_the_old_holder(
    alloc: SlotAllocator, clock: Clock
) -> None:
    old = alloc.acquire("r1", Request("render", render_slots=2, device_ids=(T4.id,)))
    clock.ms += 11_000  # past the TTL without a renewal
    new = alloc.acquire("r2", Request("render", render_slots=2, device_ids=(T4.id,)))
    assert new.token > old.token
    assert not alloc.check(old) and alloc.check(new)
    with pytest.raises(LeaseLost) as lost:
        alloc.renew(old)
    assert lost.value.fields["why"] == "expired"


def test_the_projects_device_policy_is_applied_inside_the_acquire(alloc: SlotAllocator) -> None:
    alloc.set_policy("film", "member", ["t4", "l4"])
    alloc.set_policy("film", "admin", ["gpu"])
    assert alloc.policy("film") == {"admin": ("gpu",), "member": ("t4", "l4"), "viewer": ()}
    # only an A100 holds 40 GB, and members may not use it: the policy says so, not "never"
    member = Request("render", vram_mib=40_000, project="film", role="member")
    with pytest.raises(Forbidden) as err:
        alloc.acquire("m", member, wait_s=30)
    assert "may use device classes: t4, l4; not 'a100'" in err.value.message
    for refused in (
        Request("render", classes=("a100",), project="film", role="member"),
        Request("render", device_ids=(A100.id,), project="film", role="member"),  # a worker's
        Request("render", project="film", role="viewer"),  # viewers lease nothing by default
    ):
        with pytest.raises(Forbidden):
            alloc.acquire("m", refused)
    # what members may use they get; what fits nowhere is still "never"
    small = Request("render", render_slots=1, project="film", role="member")
    assert alloc.acquire("m", small).device in (T4.id, L4.id)
    with pytest.raises(NeverFits):
        alloc.acquire("m", Request("render", vram_mib=100_000, project="film", role="member"))
    # "gpu" is every GPU class; another project's members, and operators (no role), use any
    admin = Request("render", vram_mib=40_000, project="film", role="admin")
    assert alloc.acquire("a", admin).device == A100.id
    other = Request("render", vram_mib=30_000, project="other", role="member")
    assert alloc.acquire("o", other).device == A100.id
    assert alloc.acquire("op", Request("render", vram_mib=10_000, classes=("a100",))).device
    alloc.check_policy("film", "member", "gpu")  # a GPU job: some GPU class is allowed
    with pytest.raises(Forbidden):
        alloc.check_policy("film", "member", "cpu")


def test_a_consumer_hosts_encoder_budget_caps_sessions_across_its_gpus(
    redis_url: str, clock: Clock
) -> None:
    alloc = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=10, clock_ms=clock)
    rtx = [DeviceOffer(f"gpu-rtx-{i}", "rtx4090", "RTX 4090", 24564, 16, 2) for i in range(2)]
    alloc.register("agent", "gamer-box", rtx, ttl_s=3600, host_encoder_budget=3)
    for i in range(3):
        alloc.acquire(f"s{i}", Request("stream", encoder_sessions=1))
    with pytest.raises(NoCapacity):
        alloc.acquire("s4", Request("stream", encoder_sessions=1))


def test_unavailable_devices_and_unexplained_memory_are_not_granted(
    alloc: SlotAllocator,
) -> None:
    sick = DeviceOffer(T4.id, "t4", "Tesla T4", 15360, 8, 2, available=False,
                       unavailable_reason="GPU is lost")  # fmt: skip
    busy = DeviceOffer(L4.id, "l4", "NVIDIA L4", 23034, 16, 2, unexplained_vram_mib=20_000)
    alloc.register("agent", "host-1", [sick, busy, A100], ttl_s=3600)
    with pytest.raises(NoCapacity):
        alloc.acquire("s", Request("stream", vram_mib=4000, encoder_sessions=1))
    assert alloc.acquire("s", Request("stream", vram_mib=2000, encoder_sessions=1)).device == L4.id


def test_the_fence_refuses_a_lease_whose_device_went_silent(redis_url: str, clock: Clock) -> None:
    alloc = SlotAllocator(redis.Redis.from_url(redis_url), ttl_s=10, clock_ms=clock)
    alloc.register("short-lived", "host-9", [T4], ttl_s=1)
    lease = alloc.acquire("r", Request("render", render_slots=1))
    assert alloc.check(lease)
    clock.ms += 2_000  # the lease has 8 s left, but its device's only agent stopped beating
    assert not alloc.check(lease)
