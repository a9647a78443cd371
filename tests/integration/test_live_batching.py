"""The live stream's deltas go to Redis in batches, not one round trip per delta (issue 36:
an ``XADD`` round trip per server-sent event was 40% of a streaming worker's CPU, and
redis-py's encoding of every ``XADD`` half of what remained), and nothing is lost or
reordered on the way: a subscriber reads every delta, in order, one entry each, with the
fields it had before.

Structural, not timed: the deltas of a window are counted in round trips, and each delta is
encoded once, when it is queued, as the bytes redis-py would have sent."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import pytest

from runtime.observe.live_channel import (
    TTL_SECONDS,
    LiveChannel,
    RedisLiveCall,
    _Watched,
    attempts_key,
    stream_key,
    xadd_head,
)

DELTAS = 500
WINDOW = 0.5
"""Long enough that a loop queueing ``DELTAS`` deltas ends inside it on a loaded machine."""


@pytest.fixture
def channel(redis_url: str) -> Iterator[LiveChannel]:
    ch = LiveChannel(redis_url, flush_window_seconds=WINDOW)
    yield ch
    ch.close()


def _cleanup(ch: LiveChannel, *runs: uuid.UUID) -> None:
    for run_id in runs:
        ch.redis.delete(stream_key(run_id), attempts_key(run_id))


def test_the_deltas_of_a_window_go_in_one_round_trip_and_all_arrive_in_order(
    channel: LiveChannel,
) -> None:
    run_id = uuid.uuid4()
    call = RedisLiveCall(channel, run_id, "model:1", lambda: 7, _Watched())
    try:
        attempt = call.begin_attempt()
        assert attempt == 1
        before = channel.round_trips
        texts = [f"delta {i} é€ \r\n$*{i}" for i in range(DELTAS)]  # protocol bytes in text
        for text in texts:
            call.delta(attempt, text)
        pause = threading.Event()
        for _ in range(100):  # the sender sends the window's entries on its own
            if not channel._outbox:
                break
            pause.wait(0.1)
        assert not channel._outbox, "the sender sent the window's deltas by itself"
        entries = channel.entries(run_id)  # after the sender's round trip (one at a time)
        assert channel.round_trips - before <= 2, channel.round_trips - before
        assert [e.text for e in entries] == texts
        assert {(e.type, e.key, e.attempt, e.base) for e in entries} == {
            ("text.delta", "model:1", 1, 7)
        }
        assert [e.order for e in entries] == sorted(e.order for e in entries)
        ttl = channel.redis.ttl(stream_key(run_id))
        assert 0 < int(ttl) <= TTL_SECONDS  # type: ignore[arg-type]  # kept a day, not forever
    finally:
        _cleanup(channel, run_id)


def test_a_retry_is_retracted_before_its_deltas_in_one_round_trip_each(
    channel: LiveChannel,
) -> None:
    """A new attempt costs one round trip (its number); the retraction of the one before
    goes with the deltas, ahead of them."""
    run_id = uuid.uuid4()
    call = RedisLiveCall(channel, run_id, "model:1", lambda: 3, _Watched())
    try:
        first = call.begin_attempt()
        call.delta(first, "lost")
        second = call.begin_attempt()
        call.delta(second, "kept")
        seen = [(e.type, e.attempt, e.text) for e in channel.entries(run_id)]
        assert seen == [
            ("text.delta", 1, "lost"),
            ("text.retract", 1, ""),
            ("text.delta", 2, "kept"),
        ]
    finally:
        _cleanup(channel, run_id)


def test_an_entry_is_the_bytes_redis_py_would_send(redis_url: str) -> None:
    """The hand-made ``XADD`` is the command redis-py's encoder makes of the same call."""
    from redis.connection import Encoder, PythonRespSerializer

    fields: dict[str, str | int] = {
        "type": "text.delta",
        "key": "model:1",
        "attempt": 2,
        "base": 41,
        "text": "héllo\r\n",
    }
    enc = Encoder("utf-8", "strict", decode_responses=False)
    ours = xadd_head("dar:live:x", fields, 10_000)
    theirs = b"".join(
        PythonRespSerializer(6000, enc.encode).pack(
            "XADD",
            "dar:live:x",
            "MAXLEN",
            "~",
            10_000,
            "*",
            *[x for kv in fields.items() for x in kv],
        )
    )
    assert ours == theirs


def test_entries_from_many_threads_all_arrive_each_run_in_order(channel: LiveChannel) -> None:
    """Deltas queued from many threads at once (a worker's steps) lose nothing: each run's
    arrive in the order its thread queued them."""
    runs = [uuid.uuid4() for _ in range(8)]
    per_run = 200

    def stream(run_id: uuid.UUID) -> None:
        call = RedisLiveCall(channel, run_id, "model:1", lambda: 0, _Watched())
        attempt = call.begin_attempt()
        for i in range(per_run):
            call.delta(attempt, str(i))

    threads = [threading.Thread(target=stream, args=(r,)) for r in runs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for run_id in runs:
            assert [e.text for e in channel.entries(run_id)] == [str(i) for i in range(per_run)]
    finally:
        _cleanup(channel, *runs)
