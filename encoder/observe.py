"""What a stream service reports to Prometheus: its sessions' figures, read when scraped."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from encoder.session import SessionState
from farm import metrics

if TYPE_CHECKING:
    from encoder.service import StreamService


class StreamMetrics:
    """Sets the ``tessera_stream_*`` series from the service's running sessions.

    Rates (fps) are the frames encoded since the previous scrape over the time between them, so
    Prometheus' own scrape interval is the averaging window.
    """

    def __init__(self) -> None:
        #: session id -> (monotonic time, frames encoded) at the previous scrape
        self._last: dict[str, tuple[float, int]] = {}

    async def update(self, service: StreamService) -> None:
        now = time.monotonic()
        running = [s for s in service.sessions.values() if s.state is SessionState.RUNNING]
        device = service.device.id
        per_encoder = Counter(s.encoder_name for s in running)
        metrics.STREAM_SESSIONS.clear()
        for encoder, count in per_encoder.items():
            metrics.STREAM_SESSIONS.labels(device, encoder).set(count)
        metrics.STREAM_VIEWERS.labels(device).set(sum(len(s.viewers) for s in running))
        seen = set()
        for session in running:
            pipeline = session.pipeline
            if pipeline is None:
                continue
            seen.add(session.id)
            encoded = pipeline.encoded
            then, before = self._last.get(session.id, (session.created_monotonic, 0))
            if encoded > before:
                metrics.STREAM_FRAMES.labels(session.encoder_name).inc(encoded - before)
            if now > then:
                metrics.STREAM_FPS.labels(session.id).set((encoded - before) / (now - then))
            self._last[session.id] = (now, encoded)
            metrics.STREAM_BITRATE.labels(session.id).set(pipeline.encoder.bitrate_bps)
            controller = session.viewers.get(session.control.controller or "")
            if controller is not None:
                rtt = await controller.round_trip_s()
                if rtt is not None:
                    metrics.observe_round_trip(session.id, rtt)
        for gone in set(self._last) - seen:
            del self._last[gone]
            metrics.forget_stream_session(gone)
