"""The playout-delay RTP header extension on the service's video: min = max = 0 asks the browser
to show each frame as soon as it is decoded (Chromium's low-latency renderer) instead of holding
it in its jitter buffer to smooth playback; aiortc neither offers nor writes it."""

from __future__ import annotations

from typing import Any

from aiortc import codecs, rtp
from aiortc.rtcrtpparameters import RTCRtpHeaderExtensionParameters, RTCRtpParameters

URI = "http://www.webrtc.org/experiments/rtp-hdrext/playout-delay"
#: min and max playout delay, 12 bits each in 10 ms units: both zero
ZERO_DELAY = b"\x00\x00\x00"


def enable() -> None:
    """Agree the extension for video in every answer this process makes and write it on every
    RTP packet of a sender that agreed it (once per process; later calls do nothing)."""
    video = codecs.HEADER_EXTENSIONS["video"]
    if any(ext.uri == URI for ext in video):
        return
    video.append(RTCRtpHeaderExtensionParameters(id=max(e.id for e in video) + 1, uri=URI))
    configure, pack = rtp.HeaderExtensionsMap.configure, rtp.HeaderExtensionsMap.set

    def configured(self: rtp.HeaderExtensionsMap, parameters: RTCRtpParameters) -> None:
        configure(self, parameters)
        ids = [ext.id for ext in parameters.headerExtensions if ext.uri == URI]
        self._playout_delay_id = ids[0] if ids else None  # type: ignore[attr-defined]

    def packed(self: rtp.HeaderExtensionsMap, values: Any) -> tuple[int, bytes]:
        profile, value = pack(self, values)
        ext_id = getattr(self, "_playout_delay_id", None)
        if ext_id is None:
            return profile, value
        extensions = rtp.unpack_header_extensions(profile, value) if value else []
        extensions.append((ext_id, ZERO_DELAY))
        return rtp.pack_header_extensions(extensions)

    setattr(rtp.HeaderExtensionsMap, "configure", configured)  # noqa: B010
    setattr(rtp.HeaderExtensionsMap, "set", packed)  # noqa: B010
