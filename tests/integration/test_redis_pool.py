"""A worker's Redis clients serve more callers at once than redis-py's default pool of 100
connections would (issue 36): the 101st caller waits for a connection, it is not refused
with "Too many connections" (which dropped 5 s of live deltas, or left a step's next message
to the reaper, whenever 2,000 steps in flight touched Redis together)."""

from __future__ import annotations

import threading
import uuid

import redis

from runtime.redisconn import REDIS_CONNECTIONS, redis_client

CALLERS = REDIS_CONNECTIONS + 50


def test_more_callers_at_once_than_connections_all_get_an_answer(redis_url: str) -> None:
    client = redis_client(redis_url, socket_timeout=5.0, wait_seconds=10.0)
    key = f"test-empty-{uuid.uuid4()}"
    start = threading.Barrier(CALLERS)
    errors: list[BaseException] = []

    def call() -> None:
        start.wait()
        try:
            client.blpop([key], timeout=0.5)  # holds its connection for half a second
        except redis.RedisError as e:
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(CALLERS)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        client.close()
    assert errors == []
