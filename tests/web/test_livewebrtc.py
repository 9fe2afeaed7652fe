"""Who a web process takes as a live-preview WebRTC viewer: none with the path off, none over
a cap (the page then watches over JPEG/SSE; tests/web/test_live_preview.py watches that)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web

from farm.errors import NoCapacity, OverLimit
from farm.settings import Settings
from web.appkeys import SETTINGS
from web.livewebrtc import LivePeers


def _peers(settings: Settings, **viewers: int) -> LivePeers:
    """A registry whose jobs (name -> count) have that many viewers."""
    app = web.Application()
    app[SETTINGS] = settings
    peers = LivePeers(app)
    feeds: dict[str, Any] = {
        job: SimpleNamespace(peers=set(range(n))) for job, n in viewers.items()
    }
    peers.feeds = feeds
    return peers


def test_the_path_off_refuses_every_viewer() -> None:
    with pytest.raises(NoCapacity, match="JPEG/SSE only"):
        _peers(Settings().with_(live_webrtc_per_job=0)).check("a")


def test_the_caps_per_job_and_per_web() -> None:
    settings = Settings().with_(live_webrtc_per_job=2, live_webrtc_peers=3)
    _peers(settings, a=1).check("a")  # room on both
    with pytest.raises(OverLimit) as full_job:
        _peers(settings, a=2).check("a")
    assert full_job.value.fields["allowed"] == 2
    _peers(settings, a=2).check("b")  # another job of the same web
    with pytest.raises(NoCapacity, match="3 WebRTC previews"):
        _peers(settings, a=2, b=1).check("c")
