"""Waiting out a store's transient fault (a full disk, EIO, S3 5xx or timeouts) with back-off."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from farm.errors import StorageUnavailable

log = logging.getLogger("tessera.worker")

T = TypeVar("T")

#: the first wait after a transient fault, doubled after each, up to MAX_DELAY_S
FIRST_DELAY_S = 0.5
#: the longest wait between tries: below a third of the default lease TTL (15 s), so the
#: caller's ``keep`` renews its leases in time
MAX_DELAY_S = 4.0


def retry_storage(
    action: Callable[[], T], *, budget_s: float, what: str, keep: Callable[[], None]
) -> T:
    """``action()``, tried again while it raises StorageUnavailable, for up to ``budget_s``
    (FARM_STORAGE_RETRY_S); then StorageUnavailable saying for how long it failed.

    ``keep`` runs before each new try: it renews the caller's leases and raises (LeaseLost)
    when they are gone, which ends the waiting. No try counts as an attempt of the task."""
    deadline = time.monotonic() + budget_s
    delay = FIRST_DELAY_S
    tries = 0
    while True:
        try:
            return action()
        except StorageUnavailable as exc:
            tries += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise StorageUnavailable(
                    f"{what}: the storage kept failing for {budget_s:.0f} s "
                    f"(FARM_STORAGE_RETRY_S): {exc.message}",
                    **exc.fields,
                    tries=tries,
                ) from exc
            wait = min(delay, left)
            log.warning("event=storage_retry what=%r tries=%d wait_s=%.1f error=%r", what, tries,
                        wait, exc.message)  # fmt: skip
            time.sleep(wait)
            delay = min(delay * 2, MAX_DELAY_S)
            keep()
