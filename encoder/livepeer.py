"""A live-preview viewer's WebRTC peer (aiortc): one video track showing a frame's current
state, sent as soon as it changes and repeated while it does not (a viewer's decoder and a
keyframe request always get a picture). aiortc encodes it (VP8 or H.264, its own encoders):
a preview changes a few times a second at most, so one small encode per viewer is cheap."""

from __future__ import annotations

import asyncio
import contextlib
import fractions
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import av
import numpy as np
import numpy.typing as npt
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from encoder.peers import PeerEndsOnce, peer_connection, take_offer

log = logging.getLogger("tessera.live.webrtc")

#: the picture is sent again after this long unchanged, s (a lost keyframe is repaired by it)
REPEAT_S = 0.5
#: RTP video clock, Hz
CLOCK_HZ = 90_000


class Picture(Protocol):
    """What the track shows: the image (height x width x 3 RGB uint8) and its version."""

    @property
    def image(self) -> npt.NDArray[np.uint8]: ...

    @property
    def version(self) -> int: ...


class PictureTrack(MediaStreamTrack):
    """The current state of ``picture``: a frame at once, then one each time ``changed`` is
    set (or every REPEAT_S)."""

    kind = "video"

    def __init__(self, picture: Picture, changed: asyncio.Event) -> None:
        super().__init__()
        self.picture = picture
        self.changed = changed
        self._sent_version = -1
        self._start = time.monotonic()
        self.sent = 0

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        if self._sent_version == self.picture.version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wait_change(), REPEAT_S)
        if self.readyState != "live":
            raise MediaStreamError
        self._sent_version = self.picture.version
        frame = av.VideoFrame.from_ndarray(_even(self.picture.image), format="rgb24")
        frame.pts = int((time.monotonic() - self._start) * CLOCK_HZ)
        frame.time_base = fractions.Fraction(1, CLOCK_HZ)
        self.sent += 1
        return frame

    async def _wait_change(self) -> None:
        while self._sent_version == self.picture.version and self.readyState == "live":
            self.changed.clear()
            await self.changed.wait()

    def stop(self) -> None:
        super().stop()
        self.changed.set()


class PreviewPeer(PeerEndsOnce):
    """One viewer's peer connection, sending ``track``; ``on_closed`` once it fails or ends."""

    def __init__(
        self,
        track: PictureTrack,
        ice_servers: list[dict[str, Any]],
        on_closed: Callable[[PreviewPeer], None],
    ) -> None:
        self.track = track
        self.on_closed = on_closed
        self.pc = peer_connection(ice_servers)
        self.pc.on("connectionstatechange", self._on_state)

    @property
    def connected(self) -> bool:
        return bool(self.pc.connectionState == "connected")

    async def answer(self, offer_sdp: str) -> str:
        """The complete answer (ICE gathered) to a viewer's complete offer."""
        transceiver = self.pc.addTransceiver(self.track, direction="sendonly")
        await take_offer(self.pc, transceiver, offer_sdp)
        await self.pc.setLocalDescription(await self.pc.createAnswer())
        return str(self.pc.localDescription.sdp)

    async def close(self) -> None:
        self.track.stop()
        await self.pc.close()
        self._notify_closed()


def _even(image: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """The image with an odd width or height padded by its last column or row (4:2:0 video
    needs even sizes)."""
    height, width = image.shape[:2]
    if height % 2 == 0 and width % 2 == 0:
        return np.ascontiguousarray(image)
    return np.pad(image, ((0, height % 2), (0, width % 2), (0, 0)), mode="edge")
