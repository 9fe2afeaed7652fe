"""A lease holder process for the contention test: acquire, hold while renewing, release, again.

    python -m tests.farm.slot_holder REDIS_URL HOLDER_NAME SEED

Each grant is recorded (JSON) on the ``GRANTS`` list before the holder uses it, so the test can
account for every lease; the test kills holders with SIGKILL at any point of this loop. A holder
whose renewal fails before the expiry its last grant or renewal promised (on Redis's clock)
exits with a message: the allocator let a live lease go.
"""

from __future__ import annotations

import json
import random
import sys
import time

import redis

from farm.alloc.allocator import Request, SlotAllocator
from farm.errors import LeaseLost, NoCapacity

#: short, so a dead holder's lease runs out quickly; live holders renew well within it
LEASE_TTL_S = 1.0
RENEW_EVERY_S = 0.2
#: how long a holder keeps a lease (uniform; often past one TTL, so renewals matter)
HOLD_S = (0.05, 1.6)
#: acquire's own polling (with back-off) waits this long before giving up and trying again
WAIT_S = 5.0
#: list of JSON grant records: lease id, holder, device, token, amounts
GRANTS = "test:contention:grants"
REQUESTS = (
    Request("render", vram_mib=6000, render_slots=1),
    Request("render", vram_mib=10000, render_slots=1),
    Request("stream", vram_mib=4000, encoder_sessions=1),
    Request("stream", vram_mib=2000, encoder_sessions=2),
)


def run(url: str, holder: str, seed: int) -> None:
    conn = redis.Redis.from_url(url)
    alloc = SlotAllocator(conn, ttl_s=LEASE_TTL_S)
    rng = random.Random(seed)
    while True:
        request = rng.choice(REQUESTS)
        try:
            lease = alloc.acquire(holder, request, wait_s=WAIT_S)
        except NoCapacity:
            continue
        record = {
            "id": lease.id,
            "holder": holder,
            "device": lease.device,
            "token": lease.token,
            "vram": request.vram_mib,
            "enc": request.encoder_sessions,
            "slots": request.render_slots,
        }
        conn.rpush(GRANTS, json.dumps(record))
        hold_until = time.monotonic() + rng.uniform(*HOLD_S)
        try:
            while (left := hold_until - time.monotonic()) > 0:
                time.sleep(min(RENEW_EVERY_S, left))  # the work the lease stands for
                lease = alloc.renew(lease)
        except LeaseLost as exc:
            # Legitimate only when this holder stalled past its lease's expiry (a loaded
            # machine). Redis's clock now is at or after the failed renewal's.
            seconds, micros = conn.time()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
            if now_ms < lease.expires_ms:
                sys.exit(
                    f"{holder}: lease {lease.id} lost ({exc.fields.get('why')}) at {now_ms}, "
                    f"before the expiry {lease.expires_ms} its last renewal promised"
                )
            continue
        alloc.release(lease)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
