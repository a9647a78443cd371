"""Concurrency keys against real PostgreSQL and Redis: at most N runs of a key inside a step,
waiters woken in priority order when a slot frees, slots that never leak when their holder
dies, a busy key that cannot starve a quiet one (real worker threads), the API fields, and
model-limit waiters of different keys interleaved round-robin."""

from __future__ import annotations

import heapq
import itertools
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from flask.testing import FlaskClient
from prometheus_client import CollectorRegistry, generate_latest

import api
from db.records import Dispatch, NewFork, NewRun, Run, RunStatus, Usage
from runtime.admission.concurrency_keys import KeyGate, KeyWait, Slot, tenant_key
from runtime.admission.flow_control import FlowControl, ModelLimit, Refusal
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver, Outcome
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.observe.metrics import FleetCollector, Metrics
from runtime.testing.testkit import SimulatedCrash
from tasks.celery_app import make_celery
from tests.support import drive_to_end, redis_scope, register_agent

MODEL = "claude-sonnet-4-5"


@pytest.fixture
def prefix() -> str:
    return f"dar-test-keys:{uuid.uuid4().hex[:8]}"


@pytest.fixture
def rclient(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    with redis_scope(redis_url, f"{prefix}:*", "dar:keys:*") as client:
        yield client


def _gate(client: redis.Redis, prefix: str, limit: int, lease: float = 30) -> KeyGate:
    return KeyGate(
        client,
        default_limit=limit,
        overrides={"vip": 0, "solo": 1},
        lease_seconds=lease,
        fallback_seconds=30,
        prefix=prefix,
    )


def _take(gate: KeyGate, key: str, run: uuid.UUID, *, priority: int = 0, at: float = 0) -> Any:
    return gate.acquire(key, run, 1, priority=priority, submitted_at=at or time.time())


# -- the gate ----------------------------------------------------------------------------------


def test_a_full_key_refuses_with_a_reason_and_a_freed_slot_wakes_the_first_waiter(
    rclient: redis.Redis, prefix: str
) -> None:
    gate = _gate(rclient, prefix, 2)
    r1, r2, r3, r4 = (uuid.uuid4() for _ in range(4))
    s1 = _take(gate, "acme", r1, at=1)
    s2 = _take(gate, "acme", r2, at=2)
    assert isinstance(s1, Slot)
    assert isinstance(s2, Slot)
    wait = _take(gate, "acme", r3, at=3)
    assert isinstance(wait, KeyWait)
    assert wait.reason == "concurrency key acme: 2 of 2 in steps"
    assert isinstance(_take(gate, "acme", r4, at=4), KeyWait)
    assert gate.in_steps("acme") == 2
    # another key, an override without limit and an override of 1 are not affected
    assert isinstance(_take(gate, "other", uuid.uuid4()), Slot)
    assert _take(gate, "vip", uuid.uuid4()) is None
    assert gate.limit("solo") == 1
    # a slot freed wakes the oldest waiter; a newcomer cannot take its place meanwhile
    assert gate.release(s1, continuing=False) == r3
    assert isinstance(_take(gate, "acme", uuid.uuid4(), at=5), KeyWait)
    assert isinstance(_take(gate, "acme", r3, at=3), Slot)
    # the next release wakes the next waiter, not the one already woken
    assert gate.release(s2, continuing=False) == r4


def test_a_holder_continuing_ahead_of_every_waiter_wakes_nobody(
    rclient: redis.Redis, prefix: str
) -> None:
    gate = _gate(rclient, prefix, 1)
    old, young = uuid.uuid4(), uuid.uuid4()
    slot = _take(gate, "acme", old, at=1)
    assert isinstance(slot, Slot)
    assert isinstance(_take(gate, "acme", young, at=2), KeyWait)
    # the old run's next step follows at once and it is ahead: waking `young` would only
    # find the slot taken again
    assert gate.release(slot, continuing=True) is None
    again = gate.acquire("acme", old, 2, priority=0, submitted_at=1)
    assert isinstance(again, Slot)
    # its last step: the waiter is woken
    assert gate.release(again, continuing=False) == young


def test_a_holder_continuing_keeps_its_place_and_a_newcomer_cannot_overtake(
    rclient: redis.Redis, prefix: str
) -> None:
    """Issue 23 defect 7: between a holder's steps its slot is free for a moment; a newcomer
    arriving then must not take it ahead of the holder and of the older waiters."""
    gate = _gate(rclient, prefix, 1)
    old, waiter, newcomer = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    slot = _take(gate, "acme", old, at=1)
    assert isinstance(slot, Slot)
    assert isinstance(_take(gate, "acme", waiter, at=2), KeyWait)
    assert gate.release(slot, continuing=True) is None
    assert isinstance(_take(gate, "acme", newcomer, at=3), KeyWait), "the newcomer overtook"
    again = gate.acquire("acme", old, 2, priority=0, submitted_at=1)
    assert isinstance(again, Slot)
    assert gate.release(again, continuing=False) == waiter


def test_a_lapsed_slot_taken_by_another_is_not_renewed_back(
    rclient: redis.Redis, prefix: str
) -> None:
    """A heartbeat late past its lease renews only slots still held: the one that lapsed and
    went to another run is not added back (the key would hold two runs over its limit 1)."""
    gate = _gate(rclient, prefix, 1, lease=0.5)
    assert isinstance(_take(gate, "acme", uuid.uuid4()), Slot)
    time.sleep(0.7)
    other = _gate(rclient, prefix, 1)
    assert isinstance(_take(other, "acme", uuid.uuid4()), Slot)
    gate.renew()  # the late heartbeat of the first holder
    assert gate.in_steps("acme") == 1


def test_priority_orders_the_waiters_of_a_key(rclient: redis.Redis, prefix: str) -> None:
    gate = _gate(rclient, prefix, 1)
    holder, low, high = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    slot = _take(gate, "acme", holder, at=1)
    assert isinstance(slot, Slot)
    assert isinstance(_take(gate, "acme", low, at=2), KeyWait)
    assert isinstance(_take(gate, "acme", high, priority=5, at=3), KeyWait)
    assert gate.release(slot, continuing=False) == high


def test_a_worker_killed_holding_a_slot_leaks_nothing(
    rclient: redis.Redis, prefix: str, redis_url: str
) -> None:
    """A real process takes a slot and is SIGKILLed in its step: the slot lapses with the
    lease it is bounded by, and the key admits again."""
    script = f"""
import os, signal, time, uuid, redis
from runtime.admission.concurrency_keys import KeyGate, Slot
gate = KeyGate(redis.Redis.from_url({redis_url!r}), default_limit=1, overrides={{}},
    lease_seconds=1.5, prefix={prefix!r})
got = gate.acquire("acme", uuid.uuid4(), 1, priority=0, submitted_at=time.time())
assert isinstance(got, Slot), got
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], check=False, timeout=30)
    assert proc.returncode == -signal.SIGKILL
    gate = _gate(rclient, prefix, 1)
    assert gate.in_steps("acme") == 1
    assert isinstance(_take(gate, "acme", uuid.uuid4()), KeyWait)
    time.sleep(1.6)
    assert gate.in_steps("acme") == 0
    assert isinstance(_take(gate, "acme", uuid.uuid4()), Slot)


def test_the_heartbeat_keeps_a_long_steps_slot(rclient: redis.Redis, prefix: str) -> None:
    gate = _gate(rclient, prefix, 1, lease=1.0)
    slot = _take(gate, "acme", uuid.uuid4())
    assert isinstance(slot, Slot)
    for _ in range(4):  # two leases long, renewed as the heartbeat would
        time.sleep(0.5)
        gate.renew()
    assert gate.in_steps("acme") == 1
    time.sleep(1.1)  # not renewed any more: lapsed
    assert gate.in_steps("acme") == 0


def test_losing_redis_fails_open() -> None:
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    metrics = Metrics(CollectorRegistry())
    gate = KeyGate(dead, default_limit=1, overrides={}, lease_seconds=5, metrics=metrics)
    assert _take(gate, "acme", uuid.uuid4()) is None
    assert metrics.flow_fail_open.labels("key")._value.get() == 1


# -- through the engine ------------------------------------------------------------------------


class SlowModel:
    """Answers every request after ``delay`` seconds; counts the calls in flight per key (the
    key is the first word of the run's input) and raises ``SimulatedCrash`` for input
    ``crash``."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.in_flight: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.calls = 0
        self.crash_entered = threading.Event()
        self.crash_go = threading.Event()
        self.hold_entered = threading.Event()
        self.hold_go = threading.Event()

    def send(self, request: LlmRequest) -> LlmResponse:
        first = request.messages[0]["content"]
        text = first if isinstance(first, str) else first[0]["text"]
        key = text.split()[0]
        if key == "crash":
            self.crash_entered.set()
            self.crash_go.wait(10)
            raise SimulatedCrash("the worker died in the model call")
        if key == "hold":  # a step that lasts until the test lets it go
            self.hold_entered.set()
            self.hold_go.wait(30)
        with self.lock:
            self.calls += 1
            self.in_flight[key] += 1
            self.most[key] = max(self.most[key], self.in_flight[key])
        try:
            time.sleep(self.delay)
        finally:
            with self.lock:
                self.in_flight[key] -= 1
        content = [{"type": "text", "text": "done"}]
        return LlmResponse(content, "end_turn", Usage(10, 5), MODEL)


def _keyed(rt: Runtime, text: str, key: str | None, *, priority: int = 0) -> tuple[Run, Dispatch]:
    run, _ = rt.store.create_run(
        NewRun(
            agent="test-agent",
            input=text,
            model=MODEL,
            max_steps=10,
            token_budget=10_000,
            timeout_seconds=600,
            concurrency_key=key,
            priority=priority,
        )
    )
    return run, Dispatch(run.id, run.dispatch_token)


@pytest.fixture
def keyed(settings: Settings, rclient: redis.Redis) -> Iterator[Runtime]:
    s = replace(settings, key_concurrency=2, key_recheck_seconds=30)
    rt = Runtime.build(s, llm=SlowModel(0.02), pool_size=8)
    register_agent(rt.agents)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def one_slot(settings: Settings, rclient: redis.Redis) -> Iterator[Runtime]:
    """A runtime whose keys have one slot each, a waiter's fallback timer 300 s away (a wake
    that came early is the only way it goes sooner), and a model that answers at once."""
    s = replace(settings, key_concurrency=1, key_recheck_seconds=300)
    rt = Runtime.build(s, llm=SlowModel(0.0), pool_size=4)
    register_agent(rt.agents)
    try:
        yield rt
    finally:
        rt.close()


class Fleet:
    """Worker threads taking messages from one FIFO queue, as Celery workers take them from
    the broker: a countdown message waits in a timer heap, and a reaper thread re-sends the
    runs the database says are due (lost wakes, lapsed leases, timers)."""

    def __init__(self, driver: Driver, threads: int) -> None:
        self.driver = driver
        self.inbox: queue.Queue[Dispatch | None] = queue.Queue()
        self.timers: list[tuple[float, int, Dispatch]] = []
        self.lock = threading.Lock()
        self.seq = itertools.count()
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._work, daemon=True) for _ in range(threads)]
        self.threads.append(threading.Thread(target=self._clock, daemon=True))

    def send(self, d: Dispatch) -> None:
        if d.delay_seconds:
            with self.lock:
                heapq.heappush(self.timers, (time.monotonic() + d.delay_seconds, next(self.seq), d))
        else:
            self.inbox.put(d)

    def _work(self) -> None:
        while (d := self.inbox.get()) is not None:
            try:
                result = self.driver.drive(d.run_id, d.token)
            except SimulatedCrash:
                continue  # the process "died": nothing sent, the reaper finds the run
            except BaseException as e:  # pragma: no cover - reported by the test
                self.errors.append(e)
                continue
            for nxt in (result.dispatch, *result.wakes):
                if nxt is not None:
                    self.send(nxt)

    def _clock(self) -> None:
        store = self.driver.store
        last_sweep = 0.0
        while not self.stop.wait(0.02):
            now = time.monotonic()
            with self.lock:
                while self.timers and self.timers[0][0] <= now:
                    self.inbox.put(heapq.heappop(self.timers)[2])
            if now - last_sweep >= 0.5:
                last_sweep = now
                for d in store.redispatch_due(redispatch_after=30):
                    self.inbox.put(d)

    def __enter__(self) -> Fleet:
        self.driver.heartbeat.start()  # renews leases and key slots, as in a worker
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for _ in self.threads:
            self.inbox.put(None)
        for t in self.threads:
            t.join(timeout=10)
        self.driver.heartbeat.stop()


def _finished(rt: Runtime, runs: list[Run]) -> dict[uuid.UUID, datetime]:
    done: dict[uuid.UUID, datetime] = {}
    for r in runs:
        got = rt.store.get_run(r.id)
        if got.finished_at is not None:
            assert got.status is RunStatus.SUCCEEDED, (got.status, got.error)
            done[r.id] = got.finished_at
    return done


@pytest.mark.slow  # hundreds of runs: `pytest --all`
def test_a_busy_key_cannot_starve_a_quiet_one(keyed: Runtime) -> None:
    """Key A queues 200 runs before key B's 5, on four worker threads taking messages in
    order: with two slots per key, B's runs all finish while most of A's still wait."""
    model = keyed.llm
    assert isinstance(model, SlowModel)
    driver = keyed.driver()
    a = [_keyed(keyed, f"A {i}", "A") for i in range(200)]
    b = [_keyed(keyed, f"B {i}", "B") for i in range(5)]
    with Fleet(driver, threads=4) as fleet:
        for _, d in [*a, *b]:
            fleet.send(d)
        deadline = time.monotonic() + 120
        seen_reason = None
        while time.monotonic() < deadline:
            done_b = _finished(keyed, [r for r, _ in b])
            if seen_reason is None:
                waiting = [keyed.store.get_run(r.id) for r, _ in a[-3:]]
                seen_reason = next((w.wait_reason for w in waiting if w.wait_reason), None)
            if len(done_b) == len(b):
                break
            time.sleep(0.05)
        done_a_when_b_done = _finished(keyed, [r for r, _ in a])
        while time.monotonic() < deadline:
            done_a = _finished(keyed, [r for r, _ in a])
            if len(done_a) == len(a):
                break
            time.sleep(0.2)
    assert not fleet.errors, fleet.errors
    assert len(done_b) == len(b), "B's runs did not finish"
    assert len(done_a) == len(a), f"A's backlog did not drain: {len(done_a)} of {len(a)}"
    assert max(done_b.values()) < max(done_a.values())
    # B finished while A's backlog was still mostly waiting
    assert len(done_a_when_b_done) < 100, len(done_a_when_b_done)
    assert seen_reason is not None
    assert seen_reason.startswith("concurrency key A: "), seen_reason
    print(f"\nA finished when B was: {len(done_a_when_b_done)}; reason seen: {seen_reason}")
    # the cap held fleet-wide, and every run called the model exactly once
    assert model.most["A"] <= 2
    assert model.most["B"] <= 2
    assert model.calls == 205
    # waiting for a slot is not a claim without progress (no run failed for it)
    assert all(keyed.store.get_run(r.id).status is RunStatus.SUCCEEDED for r, _ in a)


def test_a_step_dying_with_a_base_exception_gives_its_slot_to_the_next_run(
    one_slot: Runtime,
) -> None:
    """A BaseException (the engine catches none) unwinds a step holding the key's only slot
    while another run waits for it: the slot is given back and the waiter made due for the
    reaper (the dying worker sends nothing)."""
    rt = one_slot
    model = rt.llm
    assert isinstance(model, SlowModel)
    driver = rt.driver()
    _, d1 = _keyed(rt, "crash now", "acme")
    waiter, d2 = _keyed(rt, "acme later", "acme")
    died: list[BaseException] = []

    def doomed() -> None:
        try:
            driver.drive(d1.run_id, d1.token)
        except BaseException as e:
            died.append(e)

    holder = threading.Thread(target=doomed)
    holder.start()
    assert model.crash_entered.wait(10)
    assert driver.keys is not None
    assert driver.keys.in_steps("acme") == 1
    result = driver.drive(d2.run_id, d2.token)
    assert result.outcome is Outcome.WAITING
    assert rt.store.get_run(waiter.id).wait_reason == "concurrency key acme: 1 of 1 in steps"
    assert rt.store.redispatch_due(redispatch_after=3600) == []
    model.crash_go.set()
    holder.join(10)
    assert len(died) == 1
    assert isinstance(died[0], SimulatedCrash)
    assert driver.keys.in_steps("acme") == 0
    due = rt.store.redispatch_due(redispatch_after=3600)
    assert [d.run_id for d in due] == [waiter.id]
    assert drive_to_end(driver, due[0])[-1] is Outcome.FINISHED
    assert rt.store.get_run(waiter.id).status is RunStatus.SUCCEEDED


def test_a_waiter_cancelled_while_parked_does_not_swallow_the_wake(
    one_slot: Runtime, rclient: redis.Redis
) -> None:
    """Issue 23 defect 7: the key's only slot is held; two runs park for it and the first is
    cancelled. The freed slot wakes the live waiter at once (not at its fallback timer), and
    the cancelled one is gone from the key's queue."""
    rt = one_slot
    model = rt.llm
    assert isinstance(model, SlowModel)
    driver = rt.driver()
    _, held = _keyed(rt, "hold on", "acme")
    cancelled, d1 = _keyed(rt, "acme 1", "acme")
    live, d2 = _keyed(rt, "acme 2", "acme")
    results: list[Any] = []
    holder = threading.Thread(target=lambda: results.append(driver.drive(held.run_id, held.token)))
    holder.start()
    assert model.hold_entered.wait(30)
    assert driver.drive(d1.run_id, d1.token).outcome is Outcome.WAITING
    assert driver.drive(d2.run_id, d2.token).outcome is Outcome.WAITING
    assert rt.store.cancel(cancelled.id) is RunStatus.CANCELLED
    model.hold_go.set()
    holder.join(30)
    (result,) = results
    while result.outcome is Outcome.CONTINUE:  # the holder's steps, to its end
        assert result.dispatch is not None
        assert not result.wakes
        result = driver.drive(result.dispatch.run_id, result.dispatch.token)
    assert result.outcome is Outcome.FINISHED
    assert [w.run_id for w in result.wakes] == [live.id], "the live waiter was not woken"
    assert drive_to_end(driver, result.wakes[0])[-1] is Outcome.FINISHED
    assert rt.store.get_run(live.id).status is RunStatus.SUCCEEDED
    assert driver.keys is not None
    queued = rclient.zrange(driver.keys._keys("acme")[1], 0, -1)
    assert str(cancelled.id).encode() not in queued


def test_a_slot_freed_while_the_refused_run_parks_still_wakes_it(one_slot: Runtime) -> None:
    """The holder's last step releases the key's only slot between a waiter's refusal and
    its park: the release cannot wake it (it still holds its lease), so the waiter wakes
    itself once parked instead of sitting out its fallback timer (300 s here)."""
    rt = one_slot
    model = rt.llm
    assert isinstance(model, SlowModel)
    driver = rt.driver()
    keys = driver.keys
    assert keys is not None
    _, held = _keyed(rt, "hold on", "acme")
    waiter, d = _keyed(rt, "acme later", "acme")
    holder_results: list[Any] = []

    def holder() -> None:
        result = driver.drive(held.run_id, held.token)
        while result.outcome is Outcome.CONTINUE:
            assert result.dispatch is not None
            result = driver.drive(result.dispatch.run_id, result.dispatch.token)
        holder_results.append(result)

    thread = threading.Thread(target=holder)
    thread.start()
    assert model.hold_entered.wait(30)
    real_acquire = keys.acquire

    def refused_then_released(key: str, run_id: uuid.UUID, *args: Any, **kwargs: Any) -> Any:
        got = real_acquire(key, run_id, *args, **kwargs)
        if run_id != waiter.id:  # the holder's own next steps
            return got
        assert isinstance(got, KeyWait)
        model.hold_go.set()  # the holder ends and frees the slot before this run parks
        thread.join(30)
        return got

    keys.acquire = refused_then_released  # type: ignore[method-assign]
    try:
        result = driver.drive(d.run_id, d.token)
    finally:
        keys.acquire = real_acquire  # type: ignore[method-assign]
    (ended,) = holder_results
    assert ended.outcome is Outcome.FINISHED
    assert not ended.wakes, "the waiter still held its lease: the release could not wake it"
    assert result.outcome is Outcome.WAITING
    assert [w.run_id for w in result.wakes] == [waiter.id], "the missed wake was not made up"
    assert rt.store.get_run(waiter.id).run_at <= datetime.now(UTC)
    assert drive_to_end(driver, result.wakes[0])[-1] is Outcome.FINISHED
    assert rt.store.get_run(waiter.id).status is RunStatus.SUCCEEDED


def test_the_gauge_counts_waiting_runs_by_tenant_with_bounded_labels_and_no_key_names(
    keyed: Runtime,
) -> None:
    driver = keyed.driver()
    for tenant, key, n in (("red", "A", 4), ("blue", "B", 3)):
        for i in range(n):
            run, _ = keyed.store.create_run(
                NewRun(
                    agent="test-agent",
                    input=f"{key} {i}",
                    model=MODEL,
                    max_steps=10,
                    token_budget=10_000,
                    timeout_seconds=600,
                    concurrency_key=key,
                    tenant=tenant,
                )
            )
            # nothing finishes: the first two claim a slot each and are abandoned mid-step
            claim = keyed.store.claim(run.id, run.dispatch_token, "w", 30)
            assert claim is not None
            assert driver.keys is not None
            got = driver.keys.acquire(
                tenant_key(tenant, key), run.id, claim.epoch, priority=0, submitted_at=i, label=key
            )
            if isinstance(got, KeyWait):
                keyed.store.schedule(claim, 30, reason=got.reason, admission=True)
    top, total = keyed.store.count_key_waiters_by_tenant(1)
    assert top == [("red", 2)]
    assert total == 3
    registry = CollectorRegistry()
    registry.register(FleetCollector(keyed.store))
    assert registry.get_sample_value("dar_runs_waiting_for_key", {"tenant": "red"}) == 2
    assert registry.get_sample_value("dar_runs_waiting_for_key", {"tenant": "blue"}) == 1
    exposed = generate_latest(registry).decode()
    assert 'key="A"' not in exposed
    assert 'key="B"' not in exposed


def test_tenants_sharing_a_key_name_share_no_slot_and_see_nothing_of_each_other(
    one_slot: Runtime,
) -> None:
    rt = one_slot
    model = rt.llm
    assert isinstance(model, SlowModel)
    driver = rt.driver()

    def keyed_run(text: str, tenant: str) -> Run:
        run, _ = rt.store.create_run(
            NewRun(
                agent="test-agent",
                input=text,
                model=MODEL,
                max_steps=10,
                token_budget=10_000,
                timeout_seconds=600,
                concurrency_key="shared",
                tenant=tenant,
            )
        )
        return run

    blue = keyed_run("hold blue's step", "blue")
    holder = threading.Thread(target=driver.drive, args=(blue.id, blue.dispatch_token))
    holder.start()
    try:
        assert model.hold_entered.wait(10)
        assert driver.keys is not None
        assert driver.keys.in_steps(tenant_key("blue", "shared")) == 1
        red = keyed_run("red runs", "red")
        result = driver.drive(red.id, red.dispatch_token)
        assert result.outcome is not Outcome.WAITING, rt.store.get_run(red.id).wait_reason
        assert rt.store.get_run(red.id).wait_reason is None
        # blue's second run waits for blue's slot, and its reason names only blue's key
        second = keyed_run("blue again", "blue")
        assert driver.drive(second.id, second.dispatch_token).outcome is Outcome.WAITING
        reason = rt.store.get_run(second.id).wait_reason
        assert reason == "concurrency key shared: 1 of 1 in steps"
    finally:
        model.hold_go.set()
        holder.join(10)


# -- the API -----------------------------------------------------------------------------------


@pytest.fixture
def client(runtime: Runtime) -> FlaskClient:
    app = api.create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    return app.test_client()


def test_submit_takes_a_key_and_a_priority_and_get_shows_them(client: FlaskClient) -> None:
    r = client.post("/api/runs", json={"input": "hi", "concurrencyKey": "acme", "priority": 7})
    assert r.status_code == 201, r.get_data(as_text=True)
    run = client.get(f"/api/runs/{r.get_json()['id']}").get_json()
    assert run["concurrencyKey"] == "acme"
    assert run["priority"] == 7
    plain = client.post("/api/runs", json={"input": "hi"}).get_json()
    run = client.get(f"/api/runs/{plain['id']}").get_json()
    assert run["concurrencyKey"] is None
    assert run["priority"] == 0


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"concurrencyKey": "k" * 201}, "concurrencyKey", "201 characters; the limit is 200"),
        ({"concurrencyKey": "  "}, "concurrencyKey", "non-blank string"),
        ({"concurrencyKey": 5}, "concurrencyKey", "non-blank string"),
        ({"priority": "high"}, "priority", "whole number from -1000 to 1000"),
        ({"priority": 1.5}, "priority", "whole number from -1000 to 1000"),
        ({"priority": 1001}, "priority", "whole number from -1000 to 1000"),
        ({"priority": True}, "priority", "whole number from -1000 to 1000"),
    ],
)
def test_bad_keys_and_priorities_are_named(
    client: FlaskClient, body: dict[str, Any], field: str, words: str
) -> None:
    r = client.post("/api/runs", json={"input": "hi", **body})
    assert r.status_code == 400
    error = r.get_json()["error"]
    assert error["field"] == field
    assert words in error["message"]


def test_a_fork_keeps_the_key_and_the_priority(runtime: Runtime) -> None:
    run, _ = _keyed(runtime, "acme 1", "acme", priority=3)
    fork, _ = runtime.store.fork_run(
        NewFork(run.id, 1, run.input, run.model, token_budget=1000, timeout_seconds=60),
        lambda _run, _steps: [],
    )
    assert (fork.concurrency_key, fork.priority) == ("acme", 3)


# -- model-limit waiters across keys -----------------------------------------------------------


def test_model_limit_waiters_of_different_keys_are_interleaved(
    rclient: redis.Redis, prefix: str
) -> None:
    metrics = Metrics(CollectorRegistry())
    flow = FlowControl(
        rclient,
        (ModelLimit("claude-*", max_concurrent=1),),
        lease_seconds=60,
        metrics=metrics,
        prefix=prefix,
    )
    held = flow.admit(MODEL, 10, 10, waiter="holder")
    assert held is not None
    assert not isinstance(held, Refusal)
    for i in range(5):
        assert isinstance(flow.admit(MODEL, 10, 10, waiter=f"A{i}", key="A"), Refusal)
    assert isinstance(flow.admit(MODEL, 10, 10, waiter="B0", key="B"), Refusal)
    assert isinstance(flow.admit(MODEL, 10, 10, waiter="B1", key="B"), Refusal)
    order = [w.decode() for w in rclient.zrange(flow._keys(held.limit)[2], 0, -1)]
    assert order[:4] == ["A0", "B0", "A1", "B1"], order
    # priority still comes first
    assert isinstance(flow.admit(MODEL, 10, 10, waiter="urgent", priority=1, key="A"), Refusal)
    assert rclient.zrange(flow._keys(held.limit)[2], 0, 0) == [b"urgent"]
