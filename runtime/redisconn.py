"""Redis clients for code that runs in every step of a worker: sized for thousands of steps
in flight, not for redis-py's default.

redis-py (8.x) gives each client a pool of 100 connections and raises "Too many connections"
to the 101st caller at once. A gevent worker runs 2,000 steps: with a model call's text
deltas going to the live stream, admission before each call and the next message after each
checkpoint, a hundred Redis calls at one moment is ordinary, and each refusal cost something
real (5 s of live deltas dropped, a message left to the reaper). So these clients share a
:class:`redis.BlockingConnectionPool`: a caller past ``max_connections`` waits for a free
connection (cooperatively under gevent; each call holds one for well under a millisecond)
and gets an error only after ``wait_seconds``, as from a Redis that does not answer.
"""

from __future__ import annotations

from typing import Any

import redis

REDIS_CONNECTIONS = 128
"""Connections one client may open (per process; opened as needed)."""


def redis_client(
    url: str,
    *,
    max_connections: int = REDIS_CONNECTIONS,
    wait_seconds: float = 2.0,
    **options: Any,
) -> redis.Redis:
    """``redis.Redis.from_url(url, **options)``, on a blocking pool of ``max_connections``."""
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=wait_seconds, **options
    )
    return redis.Redis.from_pool(pool)
