"""A live-preview job's frame converging as a WebRTC video: the viewer's offer in, the answer
out, one peer per viewer fed by one feed per job (the frame composed from the passes in Redis,
farm.livepreview), within caps per job and per web process; peers close when the job ends, the
page goes, or no pass lands for FARM_LIVE_WEBRTC_IDLE_S. The JPEG/SSE path (web/livepreview.py)
is the fallback the page uses when this one is refused or does not connect."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from encoder.livepeer import PictureTrack, PreviewPeer
from encoder.turn import ice_servers
from farm import livepreview
from farm.errors import Conflict, FarmError, NoCapacity, NotFound, OverLimit
from farm.models import JobStatus
from farm.states import JOB_FINAL
from farm.tiling import TileGrid
from web import jsonio
from web.appkeys import SETTINGS, STORE, blocking, user_of, waiting
from web.events import BLOCK_MS
from web.jobs import job_for
from web.livecomposite import Composite

log = logging.getLogger("tessera.web.live")

OFFER_FIELDS = {"type": str, "sdp": str}


class Feed:
    """One job's frame for its WebRTC viewers: composed from the passes as they land."""

    def __init__(self, app: web.Application, status: JobStatus) -> None:
        self.app = app
        self.job_id = status.id
        self.composite = Composite(status.spec.width, status.spec.height, _tile_count(status))
        self.changed = asyncio.Event()
        self.peers: set[PreviewPeer] = set()
        self.task: asyncio.Task[None] | None = None
        self.last_pass_s = time.monotonic()

    async def load(self) -> str:
        """The frame's current state (before the first viewer's answer: a viewer joining
        mid-frame gets it in the first video frame); the stream id to follow from."""
        conn = self.app[STORE].conn
        after, current = await blocking(self.app, livepreview.snapshot, conn, self.job_id)
        for tile_pass in current:
            self.composite.add(tile_pass)
        return after

    def follow(self, after: str) -> None:
        if self.task is None:
            self.task = asyncio.create_task(self._follow(after))

    async def _follow(self, after: str) -> None:
        conn = self.app[STORE].conn
        idle_s = self.app[SETTINGS].live_webrtc_idle_s
        try:
            while self.peers:
                batch = await waiting(
                    self.app, livepreview.follow, conn, self.job_id, after, BLOCK_MS
                )
                if batch:
                    self.last_pass_s = time.monotonic()
                for entry_id, tile_pass in batch:
                    after = entry_id
                    if self.composite.add(tile_pass):
                        self.changed.set()
                if batch:
                    continue
                if time.monotonic() - self.last_pass_s > idle_s:
                    log.info("event=live_webrtc_idle job=%s", self.job_id)
                    break
                try:
                    state = await blocking(self.app, self.app[STORE].state, self.job_id)
                except NotFound:
                    break
                if state in JOB_FINAL:
                    break
        except FarmError as exc:  # Redis gone for good: the page falls back to its SSE path
            log.warning("event=live_webrtc_feed_failed job=%s error=%s", self.job_id, exc)
        finally:
            await self.close()

    async def close(self) -> None:
        for peer in list(self.peers):
            await peer.close()


class LivePeers:
    """The web process's live-preview peers, by job, within the settings' caps."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.feeds: dict[str, Feed] = {}
        #: peers being closed (a task is kept until it is done)
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def count(self) -> int:
        return sum(len(feed.peers) for feed in self.feeds.values())

    def check(self, job_id: str) -> None:
        """Refuse (503, 429) a viewer this web would not take now: WebRTC off, or a cap."""
        settings = self.app[SETTINGS]
        if settings.live_webrtc_per_job <= 0:
            raise NoCapacity("this farm sends the live preview over JPEG/SSE only",
                             reason="disabled")  # fmt: skip
        feed = self.feeds.get(job_id)
        if feed is not None and len(feed.peers) >= settings.live_webrtc_per_job:
            raise OverLimit(
                f"{settings.live_webrtc_per_job} viewers watch this job over WebRTC already; "
                "watch over JPEG/SSE",
                limit="live_webrtc_per_job",
                allowed=settings.live_webrtc_per_job,
            )
        if self.count >= settings.live_webrtc_peers:
            raise NoCapacity(f"this web serves {settings.live_webrtc_peers} WebRTC previews "
                             "already; watch over JPEG/SSE", reason="full")  # fmt: skip

    async def add(self, status: JobStatus, offer_sdp: str, user: str) -> str:
        settings = self.app[SETTINGS]
        self.check(status.id)
        feed = self.feeds.get(status.id)
        after = ""
        if feed is None:
            feed = Feed(self.app, status)
            after = await feed.load()
            # another viewer's request may have made the feed meanwhile: one feed a job
            feed = self.feeds.setdefault(status.id, feed)
            try:
                self.check(status.id)  # requests that came in during the load count
            except FarmError:
                if not feed.peers and self.feeds.get(status.id) is feed:
                    del self.feeds[status.id]
                raise
        track = PictureTrack(feed.composite, feed.changed)
        peer = PreviewPeer(track, ice_servers(settings, user), self._closed(feed))
        feed.peers.add(peer)
        if after:
            feed.follow(after)
        try:
            answer = await peer.answer(offer_sdp)
        except BaseException:
            await peer.close()
            raise
        asyncio.get_running_loop().call_later(settings.live_webrtc_idle_s, self._unconnected, peer)
        log.info("event=live_webrtc_viewer job=%s user=%s viewers=%d", status.id, user,
                 len(feed.peers))  # fmt: skip
        return answer

    def _closed(self, feed: Feed) -> Callable[[PreviewPeer], None]:
        def closed(peer: PreviewPeer) -> None:
            feed.peers.discard(peer)
            if not feed.peers and self.feeds.get(feed.job_id) is feed:
                del self.feeds[feed.job_id]
            self._close(peer)

        return closed

    def _unconnected(self, peer: PreviewPeer) -> None:
        if not peer.connected:
            log.info("event=live_webrtc_unconnected")
            self._close(peer)

    def _close(self, peer: PreviewPeer) -> None:
        task = asyncio.ensure_future(peer.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for feed in list(self.feeds.values()):
            await feed.close()
            if feed.task is not None:
                feed.task.cancel()


LIVE_PEERS = web.AppKey("live_peers", LivePeers)


async def live_peers_ctx(app: web.Application) -> AsyncIterator[None]:
    app[LIVE_PEERS] = LivePeers(app)
    try:
        yield
    finally:
        await app[LIVE_PEERS].close()


async def ice(request: web.Request) -> web.Response:
    """The STUN/TURN servers for the viewer's offer (the stream service's configuration); 503
    or 429 where this web would not take the viewer now (WebRTC off, a cap reached): the page
    watches over JPEG/SSE without making an offer."""
    status = await job_for(request)
    request.app[LIVE_PEERS].check(status.id)
    settings = request.app[SETTINGS]
    return web.json_response({"iceServers": ice_servers(settings, user_of(request).name)})


async def offer(request: web.Request) -> web.Response:
    """The viewer's SDP offer (``{"type": "offer", "sdp": ...}``, ICE gathered) in, the answer
    out; viewers of the job's project only (job_for), within the caps (429, 503)."""
    status = await job_for(request)
    body = await jsonio.read_object(request, OFFER_FIELDS, required=("sdp",))
    state = await blocking(request.app, request.app[STORE].state, status.id)
    if state in JOB_FINAL:
        raise Conflict(f"job {status.id} has ended: its frames are delivered, not previewed",
                       job_id=status.id)  # fmt: skip
    sdp = await request.app[LIVE_PEERS].add(status, body["sdp"], user_of(request).name)
    return web.json_response({"type": "answer", "sdp": sdp})


def _tile_count(status: JobStatus) -> int:
    with contextlib.suppress(FarmError):
        return TileGrid.parse(status.spec.tiles).count
    return 1
