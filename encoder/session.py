"""One stream session: its lease, its source (display + app, or test pattern), one capture and
one encode whatever the number of viewers, control of the input, and its end."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Coroutine
from enum import StrEnum
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from encoder.audio import AudioFeed
from encoder.catalog import App
from encoder.control import InputControl
from encoder.messages import RateLimit, Rejected, parse
from encoder.peers import Viewer
from encoder.pipeline import EncodedFrame, Pipeline
from encoder.recording import Recording, recording_key
from encoder.source import SandboxedSource, Source, XAppSource, make_source
from encoder.videoencoder import EncoderConfig, Packet, VideoEncoder, open_encoder, start_bitrate
from encoder.wsviewer import WsViewer
from encoder.xinput import XInput
from farm import metrics, redisclock
from farm.alloc.allocator import Lease, SlotAllocator
from farm.alloc.devices import Device
from farm.alloc.renewals import Renewals
from farm.errors import BadParameter, FarmError, IllegalTransition, LeaseLost, NotFound
from farm.settings import Settings
from farm.storage.factory import farm_storage

log = logging.getLogger("tessera.stream")

P = ParamSpec("P")
R = TypeVar("R")

#: how long after its capture failed a display's X server is looked at again, to tell a crash
#: (the server dies a few ms after it dropped its clients) from a capture error
DYING_S = 0.25

ROLES = ("player", "spectator")


class SessionState(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    ENDING = "ending"
    ENDED = "ended"


TRANSITIONS: dict[SessionState, frozenset[SessionState]] = {
    SessionState.STARTING: frozenset({SessionState.RUNNING, SessionState.ENDING}),
    SessionState.RUNNING: frozenset({SessionState.ENDING}),
    SessionState.ENDING: frozenset({SessionState.ENDED}),
    SessionState.ENDED: frozenset(),
}


class StreamSession:
    """A session on this service's device, admitted by ``lease``.

    It ends on request, ``grace_s`` after its last viewer left (or after it started without
    any), when its lease is lost, or when its app or capture stops; ending stops the app and
    the display and releases the lease.
    """

    def __init__(
        self,
        app: App,
        device: Device,
        lease: Lease,
        allocator: SlotAllocator,
        settings: Settings,
        ice_servers: Callable[[str], list[dict[str, Any]]],
        on_ended: Callable[[StreamSession], None],
        project: str = "",
        owner: str = "",
        session_id: str | None = None,
        renewals: Renewals | None = None,
    ) -> None:
        self.id = session_id or uuid.uuid4().hex[:16]
        self.app, self.device, self.lease = app, device, lease
        self.allocator, self.settings = allocator, settings
        #: the service's renewals (its sessions' leases renewed in one call a tick), or its own
        self.renewals = renewals or Renewals(allocator)
        self.ice_servers = ice_servers
        self.on_ended = on_ended
        self.project, self.owner = project, owner
        self.created = time.time()
        #: the same moment on the monotonic clock (rates such as fps count from it)
        self.created_monotonic = time.monotonic()
        self.state = SessionState.STARTING
        self.reason = ""
        self.viewers: dict[str, Viewer | WsViewer] = {}
        #: messages dropped from viewers, by reason (encoder/messages.py)
        self.dropped: Counter[str] = Counter()
        self._rates: dict[str, RateLimit] = {}
        self.source: Source = make_source(app, settings, f"stream-{self.id}")
        #: the session's sound for its viewers and recording (None: the app has none, or it is
        #: off)
        self.audio: AudioFeed | None = None
        self.pipeline: Pipeline | None = None
        # every callback handed out holds the session weakly: an ended session is freed at once
        # by reference counting, not later by the cycle collector (issue #18: 100 -> 416 MiB)
        self.control = InputControl(
            self.id, app, _weak(self._input_target), _weak(self._video_size),
            _weak(self._resize), send=_weak(self._send_to), record=_weak(self.record),
            recording=_weak(self._recording_on), pad_devices=_weak(self._pad_devices),
        )  # fmt: skip
        #: the MP4 being written while the controlling viewer records (encoder/recording.py)
        self.recording: Recording | None = None
        #: the stored recordings: key and frames of each
        self.recorded: list[dict[str, Any]] = []
        self.frames_out = 0
        self.keyframes_out = 0
        self.ended = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._idle: asyncio.TimerHandle | None = None
        self._renewal: asyncio.Task[None] | None = None
        self._ending: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self._recovering: asyncio.Task[None] | None = None
        #: times the display, app and capture were started again after a crash
        self.restarts = 0
        self._tasks: set[asyncio.Task[None]] = set()

    # --- life ------------------------------------------------------------------------------

    def _move(self, new: SessionState) -> None:
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"session {self.id} cannot go from {self.state} to {new}")
        self.state = new

    async def start(self) -> None:
        """Start the source and the encoder; the session serves viewers once this returns."""
        self._starting = asyncio.ensure_future(asyncio.to_thread(self._start_blocking))
        try:
            await self._starting
        except BaseException as exc:
            reason = exc.message if isinstance(exc, FarmError) else repr(exc)
            await self.end(f"failed to start: {reason}")
            raise
        if self.state is not SessionState.STARTING:
            return
        self._move(SessionState.RUNNING)
        self._renewal = asyncio.create_task(self._renew(), name=f"renew-{self.id}")
        self._arm_idle()
        log.info("event=session_started session=%s app=%s device=%s encoder=%s size=%dx%d "
                 "fps=%d lease=%s token=%d", self.id, self.app.name, self.device.id,
                 self.encoder_name, self.app.width, self.app.height, self.app.fps,
                 self.lease.id, self.lease.token)  # fmt: skip

    def _start_blocking(self) -> None:
        source = self.source
        source.start(functools.partial(_weak(self._source_exited), source))
        assert self.source.grabber is not None
        if source.has_audio:
            if self.audio is None:
                self.audio = AudioFeed(self._loop)
                self.audio.on_packets = _weak(self._record_sound)
            source.start_audio(self.audio)
        s = self.settings
        min_bps, max_bps = s.stream_min_kbps * 1000, s.stream_max_kbps * 1000
        app = self.app
        # locals, not self: the pipeline keeps this function (no cycle back to the session)
        gpu_index, input_format = self.device.index, source.input_format

        def make_encoder(width: int, height: int) -> VideoEncoder:
            config = EncoderConfig(
                width=width,
                height=height,
                fps=app.fps,
                bitrate_bps=start_bitrate(width, height, app.fps, min_bps, max_bps),
                min_bps=min_bps,
                max_bps=max_bps,
                gpu_index=gpu_index,
                input_format=input_format,
            )
            return open_encoder(s.nvenc, config)

        mine: list[weakref.ref[Pipeline]] = []  # weakly: the pipeline keeps this closure

        me = weakref.ref(self)

        def failed(reason: str) -> None:
            session = me()
            # not a pipeline a restart replaced
            if session is not None and mine and mine[0]() is session.pipeline:
                session._lost(f"capture or encoding stopped: {reason}", app_exited=False)

        self.pipeline = Pipeline(
            self.source.grabber, self.source.slot, make_encoder, app.width, app.height,
            self._loop, _weak(self._fan_out), failed, name=self.id,
        )  # fmt: skip
        mine.append(weakref.ref(self.pipeline))
        self.pipeline.start()

    def _input_target(self) -> XInput | None:
        return self.source.input

    def _pad_devices(self) -> tuple[Path, int, int] | None:
        return self.source.pad_devices

    def _recording_on(self) -> bool:
        return self.recording is not None

    def _source_exited(self, source: Source, reason: str) -> None:
        # called from the app's watcher thread
        me = weakref.ref(self)

        def lost() -> None:
            session = me()
            if session is not None and source is session.source:  # not one a restart replaced
                session._lost(reason, app_exited=True)

        with contextlib.suppress(RuntimeError):  # the loop is closed: the service stopped
            self._loop.call_soon_threadsafe(lost)

    # --- surviving -------------------------------------------------------------------------

    def _lost(self, reason: str, app_exited: bool, looked_again: bool = False) -> None:
        """The app exited or the capture stopped: a dead display (Xvfb) or a failed capture is
        restarted (display, app, capture, encoder; the viewers stay) up to
        FARM_STREAM_CAPTURE_RETRIES times; an app that quit by itself ends the session."""
        if self._recovering is not None or self._ending is not None:
            return  # one crash reports twice (app and capture): one restart answers both
        display = self._display_name()
        if not (app_exited or looked_again) and display and _x_server_answers(display):
            # a dying X server resets its clients before it closes its listening socket:
            # look again once it had time to finish dying
            self._loop.call_later(DYING_S, _look_again, weakref.ref(self), self.source, reason)
            return
        if display is not None and not _x_server_answers(display):
            reason = f"the display {display} (Xvfb) of app {self.app.name} crashed"
        elif app_exited:
            self.end_soon(reason)
            return
        if self.state is not SessionState.RUNNING:
            self.end_soon(reason)
            return
        if self.restarts >= self.settings.stream_capture_retries:
            tried = f" (started again {self.restarts} times)" if self.restarts else ""
            self.end_soon(reason + tried)
            return
        self._recovering = asyncio.create_task(self._restart(reason), name=f"restart-{self.id}")

    async def _restart(self, reason: str) -> None:
        self.restarts += 1
        log.warning("event=session_restarting session=%s reason=%r restart=%d", self.id, reason,
                    self.restarts)  # fmt: skip
        try:
            pipeline, self.pipeline = self.pipeline, None
            if pipeline is not None:
                await asyncio.to_thread(pipeline.stop)
            # the new display's app gets the same home folder: what the user put there, or the
            # app wrote, survives the restart
            home = self.source.home
            await asyncio.to_thread(self.source.stop, keep_home=True)
            self.source = make_source(self.app, self.settings, f"stream-{self.id}", home)
            await asyncio.to_thread(self._start_blocking)
        except Exception as exc:
            why = exc.message if isinstance(exc, FarmError) else repr(exc)
            self.end_soon(f"{reason}; starting it again failed: {why}")
            return
        finally:
            self._recovering = None
        self.request_keyframe()  # the viewers go on from a fresh keyframe
        log.info("event=session_restarted session=%s restart=%d", self.id, self.restarts)

    def _display_name(self) -> str | None:
        source = self.source
        with contextlib.suppress(FarmError):
            if isinstance(source, SandboxedSource):
                return source.box.display
            if isinstance(source, XAppSource):
                return source.display.name
        return None

    def _idle_expired(self) -> None:
        if not self.viewers:
            self.end_soon(f"no viewers for {self.settings.stream_grace_s:g} s")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def end_soon(self, reason: str) -> asyncio.Task[None]:
        """Start ending (once); the task ends with the session."""
        if self._ending is None:
            self._ending = asyncio.create_task(self._end(reason), name=f"end-{self.id}")
        return self._ending

    async def end(self, reason: str) -> None:
        """Stop viewers, encoder, app and display; release the lease. Idempotent."""
        await asyncio.shield(self.end_soon(reason))

    async def _end(self, reason: str) -> None:
        self._move(SessionState.ENDING)
        self.reason = reason
        if self._starting is not None and not self._starting.done():
            # a start in progress finishes first, so that nothing it starts is left running
            await asyncio.wait({self._starting})
        if self._recovering is not None and not self._recovering.done():
            await asyncio.wait({self._recovering})
        if self._idle is not None:
            self._idle.cancel()
        if self._renewal is not None and self._renewal is not asyncio.current_task():
            self._renewal.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewal
        for viewer in list(self.viewers.values()):
            await viewer.close()
        self.viewers.clear()
        self.control.controller = None
        self.control.close()
        pipeline = self.pipeline
        if pipeline is not None:
            await asyncio.to_thread(pipeline.stop)
        await asyncio.to_thread(self.source.stop)
        if self.recording is not None:
            recording, self.recording = self.recording, None
            await self._store(recording)
        try:
            await asyncio.to_thread(self.allocator.release, self.lease)
        except FarmError as exc:
            # the lease then expires by itself within its TTL
            log.warning("event=lease_release_failed session=%s error=%r", self.id, exc.message)
        self._move(SessionState.ENDED)
        self.ended.set()
        log.info("event=session_ended session=%s reason=%r frames=%d", self.id, reason,
                 self.frames_out)  # fmt: skip
        self.on_ended(self)

    async def _renew(self) -> None:
        while True:
            await self.renewals.next_tick()
            try:
                self.lease = await self.renewals.renew(self.lease)
            except LeaseLost as exc:
                self.end_soon(f"lease lost: {exc.fields.get('why', exc.message)}")
                return
            except FarmError as exc:
                # Redis away: keep trying while the lease may still be ours
                log.warning("event=lease_renew_failed session=%s error=%r", self.id, exc.message)
                # the lease's expiry is on Redis's clock (the allocator's scripts)
                now_ms = redisclock.now_nowait(self.allocator.conn) * 1000
                if now_ms > self.lease.expires_ms:
                    self.end_soon(f"lease not renewed: {exc.message}")
                    return

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
        self._idle = self._loop.call_later(self.settings.stream_grace_s, _weak(self._idle_expired))

    # --- viewers ---------------------------------------------------------------------------

    async def add_viewer(self, offer_sdp: str, role: str, name: str = "") -> tuple[Viewer, str]:
        if role not in ROLES:
            raise BadParameter(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if self.state is not SessionState.RUNNING:
            raise NotFound(f"session {self.id} is {self.state}", session=self.id)
        viewer_id = uuid.uuid4().hex[:12]
        viewer = Viewer(
            viewer_id,
            role,
            name,
            self.ice_servers(name or viewer_id),
            on_keyframe_request=_weak(self.request_keyframe),
            on_bitrate_estimate=_weak(self._estimated),
            on_message=_weak(self._message),
            on_closed=_weak(self._viewer_closed),
            fps=self.app.fps,
            audio=self.audio.track() if self.audio is not None else None,
            bitrate=_weak(self.sent_bitrate),
        )
        try:
            answer = await viewer.answer(offer_sdp)
        except BaseException:
            await viewer.close()
            raise
        if self.state is not SessionState.RUNNING:
            await viewer.close()
            raise NotFound(f"session {self.id} ended while the viewer joined", session=self.id)
        self._joined(viewer, role)
        # a peer that never connects (no ICE, a wrong fingerprint) must not hold the session
        self._loop.call_later(
            self.settings.stream_connect_timeout_s, _weak(self._check_connected), viewer
        )
        return viewer, answer

    def add_ws_viewer(self, ws: Any, role: str, name: str = "") -> WsViewer:
        """A viewer on an open WebSocket (the fallback transport); ``run()`` it to serve it."""
        if role not in ROLES:
            raise BadParameter(f"role must be one of {', '.join(ROLES)}, not {role!r}")
        if self.state is not SessionState.RUNNING:
            raise NotFound(f"session {self.id} is {self.state}", session=self.id)
        viewer = WsViewer(
            uuid.uuid4().hex[:12],
            role,
            name,
            ws,
            on_keyframe_request=_weak(self.request_keyframe),
            on_message=_weak(self._message),
            on_closed=_weak(self._viewer_closed),
            fps=self.app.fps,
            audio=self.audio.track() if self.audio is not None else None,
        )
        self._joined(viewer, role)
        return viewer

    def _joined(self, viewer: Viewer | WsViewer, role: str) -> None:
        viewer.role = self.control.joined(viewer.id, role)
        self.viewers[viewer.id] = viewer
        self._rates[viewer.id] = RateLimit(self.settings.stream_input_rate)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        log.info("event=viewer_joined session=%s viewer=%s role=%s controlling=%s transport=%s",
                 self.id, viewer.id, viewer.role, self.controller == viewer.id,
                 getattr(viewer, "transport", "webrtc"))  # fmt: skip

    def _check_connected(self, viewer: Viewer) -> None:
        if self.viewers.get(viewer.id) is not viewer:
            return
        if viewer.pc.connectionState == "connected" or viewer.track.sent > 0:
            return
        log.info("event=viewer_never_connected session=%s viewer=%s state=%s after_s=%g",
                 self.id, viewer.id, viewer.pc.connectionState,
                 self.settings.stream_connect_timeout_s)  # fmt: skip
        self._forget(viewer)
        self._spawn(viewer.close())

    def viewer(self, viewer_id: str) -> Viewer | WsViewer:
        viewer = self.viewers.get(viewer_id)
        if viewer is None:
            raise NotFound(f"no viewer {viewer_id} in session {self.id}", viewer=viewer_id)
        return viewer

    async def remove_viewer(self, viewer_id: str) -> None:
        viewer = self.viewer(viewer_id)
        await viewer.close()
        self._forget(viewer)

    def _viewer_closed(self, viewer: Viewer | WsViewer) -> None:
        if self.viewers.get(viewer.id) is viewer:
            self._forget(viewer)
            self._spawn(viewer.close())

    def _forget(self, viewer: Viewer | WsViewer) -> None:
        self.viewers.pop(viewer.id, None)
        self._rates.pop(viewer.id, None)
        self.control.left(viewer.id)
        log.info("event=viewer_left session=%s viewer=%s viewers=%d", self.id, viewer.id,
                 len(self.viewers))  # fmt: skip
        if not self.viewers and self.state is SessionState.RUNNING:
            self._arm_idle()
        self._apply_estimates()

    def _send_to(self, viewer_id: str, message: dict[str, Any]) -> None:
        viewer = self.viewers.get(viewer_id)
        if viewer is not None:
            viewer.send(message)

    @property
    def controller(self) -> str | None:
        """The viewer whose input counts, if any."""
        return self.control.controller

    def hand_control(self, viewer_id: str) -> None:
        viewer = self.viewer(viewer_id)
        old = self.viewers.get(self.controller or "")
        if old is not None and old is not viewer:
            old.role = "spectator"
        self.control.hand_to(viewer_id)
        viewer.role = "player"
        for v in self.viewers.values():
            v.send({"t": "control", "controlling": v.id == viewer_id})

    def _message(self, viewer: Viewer | WsViewer, raw: object) -> dict[str, Any] | None:
        """One message from a viewer: limited, parsed and handled; a bad one is dropped and
        counted (the viewer stays connected)."""
        rate = self._rates.get(viewer.id)
        try:
            message = parse(raw, self.settings.stream_message_max_bytes)
            # input is limited; a ping (the round trip the player shows) is not
            if message["t"] != "ping" and rate is not None and not rate.take():
                raise Rejected("rate_limited")
        except Rejected as exc:
            self.dropped[exc.reason] += 1
            metrics.STREAM_MESSAGES_DROPPED.labels(exc.reason).inc()
            if self.dropped[exc.reason] in (1, 100, 10_000):  # a flood logs a few lines only
                log.info("event=message_dropped session=%s viewer=%s reason=%s count=%d",
                         self.id, viewer.id, exc.reason, self.dropped[exc.reason])  # fmt: skip
            return None
        if message["t"] == "keyframe":  # a WebSocket viewer's decoder fell behind (a PLI)
            viewer.keyframe_requests += 1
            self.request_keyframe()
            return None
        return self.control.handle(viewer.id, message)

    # --- media -----------------------------------------------------------------------------

    def _fan_out(self, frame: EncodedFrame) -> None:
        self.frames_out += 1
        if frame.keyframe:
            self.keyframes_out += 1
        for viewer in self.viewers.values():
            viewer.track.push(frame.packet, frame.keyframe)
        if self.recording is not None:
            self.recording.write(frame.packet, frame.keyframe, self._video_size())

    def _record_sound(self, packets: list[Packet]) -> None:
        if self.recording is not None and self.audio is not None:
            for packet in packets:
                self.recording.write_sound(packet, self.audio.capture_us(packet.pts))

    def record(self, on: bool) -> None:
        """Start or stop recording (the controlling viewer asked); every viewer is told."""
        if on and self.recording is None and self.state is SessionState.RUNNING:
            folder = self.settings.work_dir / "recordings"
            folder.mkdir(parents=True, exist_ok=True)
            width, height = self._video_size()
            part = len(self.recorded) + 1
            path = folder / f"{self.id}-{part}.mp4"
            opus_head = self.audio.extradata if self.audio is not None else None
            self.recording = Recording(path, width, height, self.app.fps, opus_head)
            self.request_keyframe()
        elif not on and self.recording is not None:
            self._spawn(self._store(self.recording))
            self.recording = None
        else:
            return
        log.info("event=recording session=%s on=%s", self.id, on)
        for viewer in self.viewers.values():
            viewer.send({"t": "recording", "on": on})

    async def _store(self, recording: Recording) -> None:
        """Store a finished recording under the session's project's prefix."""
        name = recording.path.stem
        key = recording_key(self.project, name)
        try:
            stored = await asyncio.to_thread(recording.store, farm_storage(self.settings), key)
        except FarmError as exc:
            log.warning("event=recording_not_stored session=%s error=%r", self.id, exc.message)
            return
        if stored is not None:
            self.recorded.append(
                {"key": stored, "frames": recording.frames, "sound": recording.sound_packets}
            )
            log.info("event=recording_stored session=%s key=%s frames=%d", self.id, stored,
                     recording.frames)  # fmt: skip

    def request_keyframe(self) -> None:
        if self.pipeline is not None:
            self.pipeline.request_keyframe()

    def sent_bitrate(self) -> int:
        """The video bitrate the encoder produces now (bit/s): the pace of viewers' bursts."""
        if self.pipeline is None:
            return self.settings.stream_min_kbps * 1000
        return self.pipeline.encoder.bitrate_bps

    def _estimated(self, viewer: Viewer | WsViewer, bps: int) -> None:
        self._apply_estimates()

    def _apply_estimates(self) -> None:
        # one encode serves every viewer: follow the slowest receiver
        estimates = [v.estimate_bps for v in self.viewers.values() if v.estimate_bps]
        if estimates and self.pipeline is not None:
            self.pipeline.set_bitrate(min(estimates))

    def _video_size(self) -> tuple[int, int]:
        return (
            self.pipeline.size if self.pipeline is not None else (self.app.width, self.app.height)
        )

    def _resize(self, width: int, height: int) -> tuple[int, int] | None:
        """The display (or, without one, the video) at the viewer's size; the display's."""
        screen = self.source.resize(width, height)
        if screen is None:
            width, height = min(self.app.width, width), min(self.app.height, height)
        else:
            width, height = screen
        if self.pipeline is not None:
            self.pipeline.resize(width, height)
        return screen

    # --- reading ---------------------------------------------------------------------------

    @property
    def encoder_name(self) -> str:
        return self.pipeline.codec_name if self.pipeline is not None else ""

    def pids(self) -> list[int]:
        return self.source.pids()

    def to_json(self) -> dict[str, Any]:
        width, height = self._video_size()
        return {
            "session_id": self.id,
            "app": self.app.name,
            "device_id": self.device.id,
            "width": width,
            "height": height,
            "fps": self.app.fps,
            "state": str(self.state),
            "reason": self.reason,
            "viewers": [v.to_json(v.id == self.controller) for v in self.viewers.values()],
            "created": self.created,
            "encoder": self.encoder_name,
            "project": self.project,
            "owner": self.owner,
            "lease": {"id": self.lease.id, "token": self.lease.token},
            "stats": self.stats(),
            "recording": self.recording is not None,
            "recordings": self.recorded,
            "sound": self.audio is not None,
            # viewers hold the picture back for the sound (the player's lip sync)
            "lip_sync": self.audio is not None and self.app.lip_sync,
        }

    def stats(self) -> dict[str, Any]:
        p = self.pipeline
        return {
            "frames_captured": p.grabber.frames if p else 0,
            "frames_encoded": p.encoded if p else 0,
            "frames_skipped": p.slot.skipped if p else 0,
            "frames_sent": self.frames_out,
            "keyframes": self.keyframes_out,
            "encode_ms": round(p.encode_ms, 3) if p else 0.0,
            "bitrate_kbps": p.encoder.bitrate_bps // 1000 if p else 0,
            "denied_inputs": self.control.denied,
            "messages_dropped": dict(self.dropped),
            "restarts": self.restarts,
        }


def _x_server_answers(display: str) -> bool:
    """An X server accepts connections on ``display``'s local socket (a crashed one leaves
    its socket file behind, refusing)."""
    path = f"/tmp/.X11-unix/X{display.lstrip(':').split('.')[0]}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            return False
    return True


def _look_again(session: weakref.ref[StreamSession], source: Source, reason: str) -> None:
    """The second look at a display whose capture failed while it still answered, unless a
    restart has replaced it meanwhile (its app's exit said it was gone): that look would be at
    the new display, which answers, and restart it for nothing, or end the session once the
    retries were spent (seen beside a CPU hog: the restart finished before the look)."""
    me = session()
    if me is not None and me.source is source:
        me._lost(reason, False, True)


def _weak(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` of an object, held weakly: what keeps the callback does not keep the object
    (no reference cycle); once the object is gone, calling it does nothing (a timer of an
    ended session firing late) and returns None."""
    ref = weakref.WeakMethod(method)

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        bound = ref()
        if bound is None:
            return cast(R, None)
        return bound(*args, **kwargs)

    return call
