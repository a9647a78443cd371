"""Redis that moves (issue 27.4), against real redis-servers started here:

- on a Redis Cluster node, every concurrency-key and flow-control script runs: the keys of
  one call share one hash slot (a cluster refuses a script whose keys do not: CROSSSLOT);
- Redis dies and comes back on a NEW address (a proxy re-pointed, as DNS or a virtual IP
  would move): admission fails open within the client's timeouts, never waits forever, and
  recovers on the same client objects, without a restart;
- a partition (nothing answers, nothing is refused) also fails open within the timeouts.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry

from cli.embedded import EmbeddedRedis, free_port, redis_server_binary
from runtime.admission.concurrency_keys import KeyGate, Slot
from runtime.admission.flow_control import FlowControl, Grant, ModelLimit
from runtime.observe.metrics import Metrics
from tests.netproxy import TcpProxy

MODEL = "claude-moving"
TIMEOUT = 2.0
"""The client timeouts the runtime uses for these scripts (runtime/engine/bootstrap.py)."""


def _fail_opens(metrics: Metrics, action: str) -> float:
    return float(metrics.flow_fail_open.labels(action)._value.get())


def _client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=TIMEOUT, socket_connect_timeout=TIMEOUT)


def _gates(client: redis.Redis, metrics: Metrics) -> tuple[KeyGate, FlowControl]:
    prefix = f"dar-test-{uuid.uuid4().hex[:8]}"
    keys = KeyGate(
        client,
        default_limit=2,
        overrides={},
        lease_seconds=30,
        metrics=metrics,
        prefix=f"{prefix}:keys",
    )
    flow = FlowControl(
        client,
        (ModelLimit(MODEL, requests_per_minute=1000),),
        lease_seconds=30,
        metrics=metrics,
        prefix=f"{prefix}:flow",
    )
    return keys, flow


@pytest.fixture
def cluster_node() -> Iterator[str]:
    """A one-node Redis Cluster owning every slot: it enforces CROSSSLOT like a real one."""
    work = tempfile.mkdtemp(prefix="dar-redis-cluster-")

    def start() -> tuple[int, subprocess.Popen[bytes]]:
        port = free_port()
        return port, subprocess.Popen(
            [
                redis_server_binary(),
                "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", f"{work}/nodes.conf",
                "--dir", work,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    port, proc = start()
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.execute_command("CLUSTER", "ADDSLOTS", *range(16384))
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the cluster node did not start"
                if proc.poll() is not None:  # its port taken meanwhile (tests in parallel)
                    port, proc = start()
                    client.close()
                    client = redis.Redis(host="127.0.0.1", port=port)
                time.sleep(0.05)
        while client.execute_command("CLUSTER", "INFO").decode().find("cluster_state:ok") < 0:
            assert time.monotonic() < deadline, "the cluster did not come up"
            time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def test_every_script_runs_on_a_redis_cluster(cluster_node: str) -> None:
    metrics = Metrics(CollectorRegistry())
    client = _client(cluster_node)
    keys, flow = _gates(client, metrics)
    run_a, run_b = uuid.uuid4(), uuid.uuid4()
    a = keys.acquire("tenant/a", run_a, 1, priority=0, submitted_at=time.time())
    b = keys.acquire("tenant/b", run_b, 1, priority=0, submitted_at=time.time())
    assert isinstance(a, Slot)
    assert isinstance(b, Slot)
    keys.renew()  # two keys held: two hash slots, one call each
    assert keys.release(a, continuing=False) is None
    assert keys.release(b, continuing=True) is None
    grant = flow.admit(MODEL, 100, 10, waiter="w1")
    assert isinstance(grant, Grant)
    flow.settle(grant, 90, 5)
    assert _fail_opens(metrics, "key") == 0
    assert _fail_opens(metrics, "admit") == 0
    client.close()


def _timed(fn: object) -> tuple[object, float]:
    t0 = time.monotonic()
    out = fn()  # type: ignore[operator]
    return out, time.monotonic() - t0


def test_redis_restarted_on_a_new_address_fails_open_then_recovers() -> None:
    first = EmbeddedRedis()
    first.start()
    second: EmbeddedRedis | None = None
    proxy = TcpProxy("127.0.0.1", first.port)
    metrics = Metrics(CollectorRegistry())
    client = _client(f"redis://127.0.0.1:{proxy.port}/0")
    try:
        keys, flow = _gates(client, metrics)
        run = uuid.uuid4()

        def acquire() -> object:
            return keys.acquire("tenant/k", run, 1, priority=0, submitted_at=time.time())

        def admit() -> object:
            return flow.admit(MODEL, 100, 10, waiter="w")

        slot = acquire()
        assert isinstance(slot, Slot)
        assert keys.release(slot, continuing=False) is None

        first.stop()  # Redis dies: admission goes ahead unchecked, quickly
        for call in (acquire, admit):
            out, took = _timed(call)
            assert out is None, "fail open"
            assert took < 3 * TIMEOUT, f"waited {took:.1f}s"
        assert _fail_opens(metrics, "key") >= 1
        assert _fail_opens(metrics, "admit") >= 1

        second = EmbeddedRedis()  # back, on another port: the address moved
        second.start()
        proxy.repoint("127.0.0.1", second.port)
        deadline = time.monotonic() + 10
        while not isinstance(slot := acquire(), Slot):  # the same client objects recover
            assert time.monotonic() < deadline, "the key gate did not recover"
            time.sleep(0.2)
        keys.release(slot, continuing=False)
        assert isinstance(admit(), Grant)

        with proxy.partitioned():  # nothing answers: still no wait beyond the timeouts
            for call in (acquire, admit):
                out, took = _timed(call)
                assert out is None
                assert took < 3 * TIMEOUT, f"waited {took:.1f}s"
        deadline = time.monotonic() + 10
        while not isinstance(slot := acquire(), Slot):
            assert time.monotonic() < deadline, "the key gate did not recover after the heal"
            time.sleep(0.2)
    finally:
        client.close()
        proxy.close()
        with contextlib.suppress(Exception):
            first.stop()
        if second is not None:
            second.stop()
