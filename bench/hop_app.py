"""Worker module of the bare-hop baseline: ``celery -A bench.hop_app worker --pool threads``.

Configured by environment: ``DATABASE_URL``, ``REDIS_URL``, ``BENCH_HOP_QUEUE``,
``BENCH_HOP_EVENTS`` (1: send task events like the runtime's workers do).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import redis
from sqlalchemy import Engine

from bench.hop import HOP_TASK, HOP_TIMES, checkpoint, make_hop_app
from db.engine import make_engine

app = make_hop_app(
    os.environ["REDIS_URL"],
    os.environ.get("BENCH_HOP_QUEUE", "dar-bench-hop"),
    events=os.environ.get("BENCH_HOP_EVENTS", "0") == "1",
)
_engine: tuple[int, Engine] | None = None
_lock = threading.Lock()
WORKER = f"hop:{socket.gethostname()}:{os.getpid()}"


def engine() -> Engine:
    global _engine
    if _engine is None or _engine[0] != os.getpid():
        with _lock:
            if _engine is None or _engine[0] != os.getpid():
                # The runtime's pool: 10 + 10 overflow per process.
                _engine = (os.getpid(), make_engine(os.environ["DATABASE_URL"], pool_size=10))
    return _engine[1]


_redis: tuple[int, redis.Redis] | None = None


def times() -> redis.Redis:
    global _redis
    if _redis is None or _redis[0] != os.getpid():
        _redis = (os.getpid(), redis.Redis.from_url(os.environ["REDIS_URL"]))
    return _redis[1]


@app.task(name=HOP_TASK, ignore_result=True, shared=False)
def hop(run_id: str, token: str, seq: int, total: int, database: bool = True) -> None:
    """One hop. ``database=False`` is the broker's own floor: no PostgreSQL at all, the hop's
    time goes to a Redis list (one round trip) so its rate is counted like the others'."""
    next_token = str(uuid.uuid4())
    if database:
        with engine().begin() as conn:
            if not checkpoint(conn, run_id, token, next_token, seq, WORKER):
                return
    else:
        times().rpush(HOP_TIMES, time.time())
    if seq < total:
        hop.apply_async((run_id, next_token, seq + 1, total, database))
