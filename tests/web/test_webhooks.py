"""Webhooks: a receiver on loopback gets each job event once, signed with its hook's secret,
also across an outage (retries, the same delivery ids), a dispatcher crash and two web
processes; only a project's admins manage hooks; private addresses need the operator's leave."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from farm import jobstore, keys, metrics
from farm.accounts import Accounts
from farm.errors import BadParameter
from farm.models import TileTask
from farm.settings import Settings
from farm.states import JobState
from farm.webhooks import addresses, hooks, signing
from farm.webhooks.dispatcher import CONSUMER, GROUP, Dispatcher, backoff_s
from tests.blendscenes import make_scene
from tests.clocks import host_clock, off_by, process_clock
from tests.conftest import REPO
from tests.farmprocs import WorkerProcess, eventually, submit
from tests.web.conftest import Tokens, api, bearer, make_job, wait_for_worker

ALL = ["job.submitted", "frame.done", "frame.done", "job.done"]


@dataclass
class Received:
    delivery: str
    event: str
    body: dict[str, Any]
    signed: bool


class Receiver:
    """A webhook receiver on 127.0.0.1: checks each request's signature against ``secret``,
    answers 500 to the next ``failing`` requests, and keeps the first body of each delivery
    id it accepted (a real receiver's dedup)."""

    def __init__(self) -> None:
        self.secret = ""
        self.failing = 0
        self.received: list[Received] = []
        self.accepted: dict[str, dict[str, Any]] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> Receiver:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        h = request.headers
        signed = signing.verify(self.secret, h["X-Tessera-Timestamp"],
                                h["X-Tessera-Signature"], raw, time.time())  # fmt: skip
        body = json.loads(raw)
        self.received.append(Received(h["X-Tessera-Delivery"], h["X-Tessera-Event"], body, signed))
        if not signed:
            return web.Response(status=401)
        if self.failing > 0:
            self.failing -= 1
            return web.Response(status=500)
        self.accepted.setdefault(h["X-Tessera-Delivery"], body)
        return web.Response(status=204)

    def accepted_events(self) -> list[str]:
        return sorted(b["event"] for b in self.accepted.values())


def fast(settings: Settings, **changes: Any) -> Settings:
    """Retries in tenths of seconds (the defaults wait 10 s and more)."""
    values: dict[str, Any] = {"webhook_allow_private": 1, "webhook_backoff_s": 0.1,
                              "webhook_backoff_max_s": 0.4, "webhook_max_attempts": 50}  # fmt: skip
    return settings.with_(**{**values, **changes})


def run_job(store: jobstore.JobStore, job_id: str, frames: tuple[int, ...] = (1, 2)) -> None:
    """Render a job of one tile per frame as workers would, through the job store's scripts."""
    for frame in frames:
        task = TileTask(job_id, frame, 0, 1)
        assert store.start_tile(task) == "ok"
        assert store.finish_tile(task, 1) == "frame_ready"
        assert store.finish_frame(job_id, frame) == "ok"


# --- pure parts ---------------------------------------------------------------------------------


def test_a_signature_holds_only_for_its_secret_body_and_a_fresh_timestamp() -> None:
    secret, body, now = signing.new_secret(), b'{"event":"job.done"}', 1_800_000_000
    sig = signing.sign(secret, now, body)
    assert sig.startswith("v1=") and secret.startswith("whsec_")
    assert signing.verify(secret, str(now), sig, body, now + 10)
    assert not signing.verify(signing.new_secret(), str(now), sig, body, now)  # another secret
    assert not signing.verify(secret, str(now), sig, body + b" ", now)  # another body
    assert not signing.verify(secret, str(now + 1), sig, body, now)  # another timestamp
    assert not signing.verify(secret, str(now), sig, body, now + 301)  # replayed later


def test_the_readmes_verification_snippet_accepts_the_farms_signature() -> None:
    """Receivers copy the README's Python: it must accept what the farm signs, nothing else."""
    text = (REPO / "README.md").read_text()
    snippet = text.split("```python\nimport hashlib, hmac, time\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {}
    exec("import hashlib, hmac, time\n" + snippet, scope)
    secret, body, now = signing.new_secret(), b'{"event":"job.failed"}', int(time.time())
    headers = {"X-Tessera-Timestamp": str(now),
               "X-Tessera-Signature": signing.sign(secret, now, body)}  # fmt: skip
    assert scope["verified"](secret, headers, body)
    assert not scope["verified"](signing.new_secret(), headers, body)
    assert not scope["verified"](secret, headers, body + b"x")
    old = {"X-Tessera-Timestamp": str(now - 600),
           "X-Tessera-Signature": signing.sign(secret, now - 600, body)}  # fmt: skip
    assert not scope["verified"](secret, old, body)


def test_back_off_doubles_with_jitter_up_to_its_cap() -> None:
    low = [backoff_s(n, 10, 3600, lambda: 0.0) for n in range(1, 12)]
    high = [backoff_s(n, 10, 3600, lambda: 1.0) for n in range(1, 12)]
    assert high[:4] == [10, 20, 40, 80] and high[-1] == 3600
    assert low == [h / 2 for h in high]


@pytest.mark.parametrize(
    ("address", "public"),
    [("127.0.0.1", False), ("10.1.2.3", False), ("192.168.0.9", False), ("172.16.0.1", False),
     ("169.254.169.254", False), ("100.64.0.1", False), ("::1", False), ("fe80::1", False),
     ("fd00::1", False), ("::ffff:127.0.0.1", False), ("0.0.0.0", False), ("8.8.8.8", True),
     ("2606:4700:4700::1111", True)],
)  # fmt: skip
def test_only_public_addresses_unless_the_operator_allows_private(
    address: str, public: bool
) -> None:
    assert (addresses.refusal(address, allow_private=False) == "") is public
    if address != "0.0.0.0":
        assert addresses.refusal(address, allow_private=True) == ""


@pytest.mark.parametrize(
    ("url", "says"),
    [("ftp://example.com/h", "http:// or https://"), ("https://", "needs a host"),
     ("https://u:p@example.com/", "no credentials"), ("https://example.com/" + "a" * 2100, "2048"),
     ("http://127.0.0.1:8080/h", "loopback"), ("http://localhost/h", "loopback"),
     ("http://[::1]/h", "loopback"), ("http://169.254.169.254/latest", "private"),
     ("https://example.com/a b", "spaces")],
)  # fmt: skip
def test_bad_webhook_urls_are_refused(url: str, says: str) -> None:
    with pytest.raises(BadParameter) as caught:
        hooks.check_url(url, allow_private=False)
    assert says in str(caught.value)
    assert hooks.check_url("https://hooks.example.com/tessera?x=1", False)


# --- the API -------------------------------------------------------------------------------------


async def test_only_project_admins_manage_hooks_and_the_secret_is_shown_once(
    web_settings: Settings, tokens: Tokens, redis_url: str
) -> None:
    conn = jobstore.connect(redis_url)
    accounts = Accounts(conn)
    accounts.set_role("pat", "A", "admin")
    pat = bearer(accounts.create_token("pat").token)
    conn.close()
    base = "/api/projects/A/webhooks"
    public = {"url": "https://hooks.example.com/tessera"}
    async with api(web_settings.with_(webhook_max_per_project=2)) as client:
        made = await client.post(base, json={**public, "events": ["job.done"]}, headers=pat)
        assert made.status == 201, await made.text()
        hook = await made.json()
        assert hook["secret"].startswith("whsec_") and hook["events"] == ["job.done"]
        listed = await (await client.get(base, headers=pat)).json()
        assert [h["id"] for h in listed["webhooks"]] == [hook["id"]]
        assert "secret" not in json.dumps(listed) and hook["secret"] not in json.dumps(listed)
        # a member or viewer of A may not; a stranger to A does not even see it
        for who, status in ((tokens.alice, 403), (tokens.vera, 403), (tokens.bob, 404)):
            assert (await client.post(base, json=public, headers=bearer(who))).status == status
            assert (await client.get(base, headers=bearer(who))).status == status
            gone = await client.delete(f"{base}/{hook['id']}", headers=bearer(who))
            assert gone.status == status
        # a farm admin may
        assert (await client.get(base, headers=bearer(tokens.admin))).status == 200
        # the farm's own network is out of reach without the operator's setting
        inward = await client.post(base, json={"url": "http://127.0.0.1:6379/"}, headers=pat)
        assert inward.status == 400 and "FARM_WEBHOOK_ALLOW_PRIVATE" in await inward.text()
        odd = await client.post(base, json={**public, "events": ["job.exploded"]}, headers=pat)
        assert odd.status == 400 and "job.exploded" in await odd.text()
        assert (await client.post(base, json=public, headers=pat)).status == 201
        full = await client.post(base, json=public, headers=pat)
        assert full.status == 409 and "FARM_WEBHOOK_MAX_PER_PROJECT" in await full.text()
        deliveries = await client.get(f"{base}/{hook['id']}/deliveries", headers=pat)
        assert deliveries.status == 200 and (await deliveries.json())["deliveries"] == []
        assert (await client.delete(f"{base}/{hook['id']}", headers=pat)).status == 204
        assert (await client.delete(f"{base}/{hook['id']}", headers=pat)).status == 404
        assert (await client.get(f"{base}/{hook['id']}/deliveries", headers=pat)).status == 404
    async with api(web_settings.with_(webhook_allow_private=1)) as client:
        inward = await client.post(base, json={"url": "http://127.0.0.1:9/"}, headers=pat)
        assert inward.status == 201


# --- the dispatcher ------------------------------------------------------------------------------


@pytest.fixture
def store(redis_url: str) -> Iterator[jobstore.JobStore]:
    s = jobstore.JobStore(jobstore.connect(redis_url))
    yield s
    s.conn.close()


def add_hook(store: jobstore.JobStore, url: str, project: str = "A", **kw: Any) -> hooks.Hook:
    events = tuple(kw.get("events", hooks.EVENTS))
    return hooks.Hooks(store.conn).create(project, url, events, "pat", 10)


async def test_two_web_processes_send_each_event_once_and_none_without_a_hook(
    web_settings: Settings, store: jobstore.JobStore, tmp_path: Path
) -> None:
    settings = fast(web_settings)
    receiver = await Receiver().start()
    hook = add_hook(store, receiver.url)
    receiver.secret = hook.secret
    # a job of a project without hooks writes nothing to the outbox
    run_job(store, make_job(settings, "B", tmp_path / "b"))
    assert store.conn.xlen(keys.WEBHOOK_OUTBOX) == 0
    # an entry the dispatcher cannot read (no timestamp) is dropped, not retried forever
    store.conn.xadd(keys.WEBHOOK_OUTBOX, {"event": "job.done", "project": "A", "job_id": "x"})
    job_id = make_job(settings, "A", tmp_path / "a")
    run_job(store, job_id)
    # two dispatchers at once (two web replicas): one holds the lease and sends
    stop = asyncio.Event()
    conns = [jobstore.connect(settings.redis_url) for _ in range(2)]
    pair = [Dispatcher(settings, c, name=f"web-{i}") for i, c in enumerate(conns)]
    runs = [asyncio.create_task(d.run(stop)) for d in pair]
    try:
        await eventually(lambda: len(receiver.received) >= 4, 10, "four deliveries")
        await asyncio.sleep(0.5)  # room for a duplicate to arrive
        # in the order they happened: one request per hook at a time
        assert [r.event for r in receiver.received] == ALL
        assert all(r.signed for r in receiver.received)
        assert len({r.delivery for r in receiver.received}) == 4
        assert sum(d.leader for d in pair) == 1
        done = next(r.body for r in receiver.received if r.event == "job.done")
        assert done["job"]["id"] == job_id and done["job"]["state"] == "done"
        assert done["job"]["frames_done"] == 2 and done["project"] == "A"
        frames = [r.body["frame"] for r in receiver.received if r.event == "frame.done"]
        assert frames == [1, 2]
        listed = hooks.Hooks(store.conn).deliveries("A", hook.id)
        assert [(d["state"], d["attempts"]) for d in listed] == [("delivered", 1)] * 4
        assert store.conn.xlen(keys.WEBHOOK_OUTBOX) == 0  # acknowledged and dropped
    finally:
        stop.set()
        await asyncio.gather(*runs)
        for c in conns:
            c.close()
        await receiver.stop()


async def test_a_hook_made_on_a_web_whose_clock_runs_ahead_gets_the_next_jobs_events(
    web_settings: Settings,
    store: jobstore.JobStore,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A hook gets the events after its creation: both times on Redis's clock
    (farm.redisclock). Made on a web replica whose clock runs a minute ahead, it gets the job
    that runs right after; on that host's own clock the job's events were older than the hook
    and none was sent."""
    settings = fast(web_settings)
    receiver = await Receiver().start()
    ahead = off_by(60.0)
    ahead_conn = jobstore.connect(settings.redis_url)
    host_clock(ahead_conn, ahead)
    with process_clock(monkeypatch, ahead):  # the web replica that makes the hook
        hook = add_hook(jobstore.JobStore(ahead_conn), receiver.url)
    receiver.secret = hook.secret
    run_job(store, make_job(settings, "A", tmp_path / "a"))
    stop = asyncio.Event()
    conn = jobstore.connect(settings.redis_url)
    running = asyncio.create_task(Dispatcher(settings, conn).run(stop))
    try:
        await eventually(lambda: len(receiver.received) >= 4, 10, "four deliveries")
        assert [r.event for r in receiver.received] == ALL
    finally:
        stop.set()
        await running
        conn.close()
        ahead_conn.close()
        await receiver.stop()


async def test_a_dispatcher_that_dies_loses_nothing_and_resends_with_the_same_id(
    web_settings: Settings, store: jobstore.JobStore, tmp_path: Path
) -> None:
    settings = fast(web_settings)
    receiver = await Receiver().start()
    hook = add_hook(store, receiver.url, events=("job.submitted", "job.canceled"))
    receiver.secret = hook.secret
    job_id = make_job(settings, "A", tmp_path / "a")
    store.end_job(job_id, JobState.CANCELED, "canceled by request")
    first = Dispatcher(settings, store.conn, name="first")
    assert first.hold_lease()
    # it read the outbox and died before creating the deliveries: the entries stay pending
    first._ensure_group()
    read: list[Any] = store.conn.xreadgroup(GROUP, CONSUMER, {keys.WEBHOOK_OUTBOX: ">"}, count=10)  # type: ignore[assignment]
    assert len(read[0][1]) == 2
    # a second life creates them, sends one and dies before recording that it was answered
    assert first.intake() == 2
    (delivery,) = first.due(set())
    async with aiohttp.ClientSession() as http:
        hook_record = hooks.Hooks(store.conn).get("A", hook.id)
        assert (await first._post(http, hook_record, delivery))[0] == "delivered"
    first.release_lease()
    # the next dispatcher sends both: the first again, under the same delivery id
    stop = asyncio.Event()
    second = asyncio.create_task(Dispatcher(settings, store.conn, name="second").run(stop))
    try:
        await eventually(lambda: len(receiver.received) >= 3, 10, "three requests")
        await asyncio.sleep(0.3)
    finally:
        stop.set()
        await second
        await receiver.stop()
    ids = [r.delivery for r in receiver.received]
    assert ids[0] == ids[1] == delivery.id and len(ids) == 3
    assert receiver.accepted_events() == ["job.canceled", "job.submitted"]
    canceled = next(b for b in receiver.accepted.values() if b["event"] == "job.canceled")
    assert canceled["job"]["reason"] == "canceled by request"


async def test_a_receiver_that_fails_or_is_private_ends_failed_in_the_deliveries(
    web_settings: Settings, store: jobstore.JobStore, tmp_path: Path
) -> None:
    settings = fast(web_settings, webhook_max_attempts=3, webhook_backoff_s=0.05)
    receiver = await Receiver().start()
    receiver.failing = 1000
    listing = hooks.Hooks(store.conn)

    def attempts(outcome: str) -> float:
        value = metrics.REGISTRY.get_sample_value(
            "tessera_webhook_attempts_total", {"outcome": outcome}
        )
        return value or 0.0

    before = {o: attempts(o) for o in ("retry", "failed")}

    async def dispatch(settings: Settings, project: str, hook_id: str) -> dict[str, Any]:
        stop = asyncio.Event()
        run = asyncio.create_task(Dispatcher(settings, store.conn).run(stop))
        try:
            await eventually(
                lambda: [d["state"] for d in listing.deliveries(project, hook_id)] == ["failed"],
                10, f"the delivery of {hook_id} failing",
            )  # fmt: skip
        finally:
            stop.set()
            await run
        (failed,) = listing.deliveries(project, hook_id)
        return failed

    # made while private addresses were allowed, sent when they are not: `localhost` is
    # resolved at send time and refused, and nothing reaches the receiver through it
    private = add_hook(store, f"http://localhost:{receiver.port}/hook", project="B")
    make_job(settings, "B", tmp_path / "b")
    refused = await dispatch(settings.with_(webhook_allow_private=0), "B", private.id)
    assert refused["attempts"] == 1 and "refused" in refused["last_result"]
    assert "FARM_WEBHOOK_ALLOW_PRIVATE" in refused["last_result"]
    assert receiver.received == []
    # a receiver answering 500 gets FARM_WEBHOOK_MAX_ATTEMPTS tries, then the delivery fails
    broken = add_hook(store, receiver.url, project="A")
    receiver.secret = broken.secret
    make_job(settings, "A", tmp_path / "a")
    failed = await dispatch(settings, "A", broken.id)
    await receiver.stop()
    assert len(receiver.received) == 3
    assert failed["attempts"] == 3 and failed["last_result"] == "HTTP 500"
    assert failed["next_s"] is None and failed["ended_s"]
    # the operators' view: two tries to be retried, two deliveries given up (one refused)
    assert {o: attempts(o) - before[o] for o in before} == {"retry": 2, "failed": 2}


# --- a real render, through the web app ---------------------------------------------------------


@pytest.fixture
def worker(web_settings: Settings, tmp_path: Path) -> Iterator[WorkerProcess]:
    proc = WorkerProcess(web_settings.redis_url, tmp_path, name="webhooks")
    try:
        wait_for_worker(web_settings.redis_url)
        yield proc
    finally:
        proc.stop()


async def test_a_real_render_reaches_a_receiver_once_per_event_also_across_its_outage(
    web_settings: Settings, tokens: Tokens, worker: WorkerProcess, tmp_path: Path
) -> None:
    # retried for as long as the render takes (the defaults would give up after hours)
    settings = fast(web_settings, webhook_max_attempts=100_000)
    blend = make_scene(tmp_path / "shot.blend", width=32, height=20, samples=4, frame_end=2)
    steady, flaky = await Receiver().start(), await Receiver().start()
    await flaky.stop()  # down (its port refuses connections) until the job has ended
    base = "/api/projects/A/webhooks"
    admin = bearer(tokens.admin)
    async with api(settings) as client:
        for receiver in (steady, flaky):
            made = await client.post(base, json={"url": receiver.url}, headers=admin)
            assert made.status == 201, await made.text()
            receiver.secret = (await made.json())["secret"]
        hook_ids = [h["id"] for h in (await (await client.get(base, headers=admin)).json())
                    ["webhooks"]]  # fmt: skip
        store, job_id = await asyncio.to_thread(
            submit, settings, blend, tmp_path, project="A", frames="1-2", tiles="1x1"
        )
        store.conn.close()

        async def flaky_deliveries() -> list[dict[str, Any]]:
            url = f"{base}/{hook_ids[1]}/deliveries"
            return list((await (await client.get(url, headers=admin)).json())["deliveries"])

        tried: list[dict[str, Any]] = []

        async def each_tried_while_down() -> bool:
            tried[:] = await flaky_deliveries()
            return len(tried) == 4 and all(d["attempts"] >= 1 for d in tried)

        deadline = time.monotonic() + 90
        while not await each_tried_while_down():
            assert time.monotonic() < deadline, tried
            await asyncio.sleep(0.1)
        assert all(d["state"] == "pending" and "cannot connect" in d["last_result"] for d in tried)
        # the steady receiver has every event once, signed
        await eventually(lambda: len(steady.received) >= 4, 10, "the steady receiver's four")
        # back, but answering 500 twice more
        flaky.failing = 2
        await flaky.start()
        await eventually(lambda: len(flaky.accepted) >= 4, 30, "the flaky receiver's four")
        await asyncio.sleep(0.3)  # room for a duplicate to arrive
        done = await flaky_deliveries()
    await steady.stop()
    await flaky.stop()
    assert sorted(r.event for r in steady.received) == sorted(ALL)
    assert all(r.signed for r in steady.received + flaky.received)
    for receiver in (steady, flaky):
        assert receiver.accepted_events() == sorted(ALL)
    # each of flaky's deliveries was accepted once: 4 acceptances, 2 answered with 500
    assert len(flaky.received) == 6, [(r.delivery, r.event) for r in flaky.received]
    assert {r.delivery for r in flaky.received} == set(flaky.accepted)
    assert all(d["state"] == "delivered" and d["attempts"] >= 2 for d in done), done
    frame = next(b for b in steady.accepted.values() if b["event"] == "frame.done")
    assert frame["job"]["id"] == job_id and {f["name"] for f in frame["files"]} == {
        f"frame_{frame['frame']:04d}.exr"
    }
