"""Live-preview passes in Redis: the latest pass per tile for viewers joining, a capped stream
of passes for viewers watching, and both gone after their TTL."""

from __future__ import annotations

from redis import Redis

from farm import keys, livepreview
from farm.livepreview import TilePass


def _pass(tile: int, index: int, frame: int = 1) -> TilePass:
    return TilePass(frame=frame, tile=tile, attempt=1, x=tile * 8, y=0, w=8, h=8, frame_w=16,
                    frame_h=8, index=index, passes=3, samples=4 ** (index - 1),
                    total_samples=16, jpeg=livepreview.encode_jpeg(b"jpeg%d" % index))  # fmt: skip


def test_a_viewer_joining_gets_each_tiles_latest_pass_then_what_lands(rconn: Redis) -> None:
    job = "j1"
    assert livepreview.snapshot(rconn, job) == ("0", [])
    livepreview.publish(rconn, job, _pass(0, 1), ttl_s=60)
    livepreview.publish(rconn, job, _pass(0, 2), ttl_s=60)
    after = livepreview.publish(rconn, job, _pass(1, 1), ttl_s=60)
    at, current = livepreview.snapshot(rconn, job)
    assert at == after
    assert [(p.tile, p.index) for p in current] == [(0, 2), (1, 1)]
    assert current[0].ts > 0  # stamped when published: latency is measured from here
    assert livepreview.follow(rconn, job, at, block_ms=10) == []
    livepreview.publish(rconn, job, _pass(1, 2), ttl_s=60)
    landed = livepreview.follow(rconn, job, at, block_ms=10)
    assert [(p.tile, p.index, p.jpeg) for _, p in landed] == [(1, 2, _pass(1, 2).jpeg)]
    # a new frame is what a joining viewer sees
    livepreview.publish(rconn, job, _pass(0, 1, frame=2), ttl_s=60)
    assert [(p.frame, p.tile) for p in livepreview.snapshot(rconn, job)[1]] == [(2, 0)]


def test_what_the_preview_keeps_expires_and_its_stream_is_capped(rconn: Redis) -> None:
    job = "j2"
    for i in range(livepreview.STREAM_MAXLEN * 2):
        livepreview.publish(rconn, job, _pass(0, 1 + i % 3), ttl_s=30)
    assert rconn.xlen(keys.live_passes(job)) <= livepreview.STREAM_MAXLEN * 1.5
    for key in (keys.live_passes(job), keys.live_frame(job, 1)):
        assert 0 < rconn.pttl(key) <= 30_000


def test_a_pass_round_trips_through_json() -> None:
    p = _pass(3, 2)
    assert TilePass.from_json(p.to_json()) == p
    assert "jpeg" not in p.meta() and p.meta()["samples"] == 4
    assert not p.done and _pass(0, 3).done
