"""One per web process: the watcher behind every open event stream.

A stream does not poll PostgreSQL or block on Redis itself (a thousand streams would be a
thousand queries a second and a thousand Redis connections). It registers with the hub and
sleeps; the hub asks PostgreSQL once per ``DAR_EVENTS_POLL_SECONDS`` for the last event number
of every run followed (one statement), reads every followed run's Redis stream with one
blocking ``XREAD``, and wakes only the streams whose run has something new.

Its two loops are threads: greenlets under gunicorn's gevent worker, which patches
``threading``, so an idle stream costs a greenlet and a few objects.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from db.store import RunStore
from runtime.observe.live_channel import LiveChannel, stream_key

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Waiter:
    run_id: uuid.UUID
    durable: int
    """The last durable event the stream has read."""
    live_after: str = "0-0"
    """The last Redis stream id the stream has read."""
    wake: threading.Event = field(default_factory=threading.Event)
    durable_changed: bool = True
    live_changed: bool = True


def _rid(rid: str) -> tuple[int, int]:
    ms, _, n = rid.partition("-")
    return int(ms), int(n or 0)


class EventHub:
    def __init__(self, store: RunStore, live: LiveChannel | None, poll_seconds: float) -> None:
        self.store = store
        self.live = live
        self.poll_seconds = poll_seconds
        self._lock = threading.Lock()
        self._waiters: dict[uuid.UUID, set[Waiter]] = {}
        # Each loop runs while some stream is open, and ends (clearing its flag under the
        # lock) when none is: an idle web process has no hub threads.
        self._pg_running = False
        self._redis_running = False
        self.draining = False
        """The process is stopping: every stream ends (:meth:`drain`)."""

    def subscribe(self, waiter: Waiter) -> None:
        with self._lock:
            self._waiters.setdefault(waiter.run_id, set()).add(waiter)
            if not self._pg_running:
                self._pg_running = True
                threading.Thread(
                    target=self._poll_durable, name="dar-events-pg", daemon=True
                ).start()
            if self.live is not None and not self._redis_running:
                self._redis_running = True
                threading.Thread(
                    target=self._poll_live, name="dar-events-redis", daemon=True
                ).start()

    def unsubscribe(self, waiter: Waiter) -> None:
        with self._lock:
            waiters = self._waiters.get(waiter.run_id)
            if waiters is not None:
                waiters.discard(waiter)
                if not waiters:
                    del self._waiters[waiter.run_id]

    def drain(self) -> None:
        """The process is stopping: every open stream ends now, and one opened from now on
        ends after its first batch. Its client reconnects (``Last-Event-ID``) to a process
        that is not stopping; a stream never ends by itself, so gunicorn, which lets the
        requests in flight finish, would otherwise wait its whole graceful timeout."""
        self.draining = True
        with self._lock:
            waiters = [w for ws in self._waiters.values() for w in ws]
        for w in waiters:
            w.wake.set()

    @property
    def streams(self) -> int:
        with self._lock:
            return sum(len(w) for w in self._waiters.values())

    def _snapshot(self, loop: str) -> dict[uuid.UUID, list[Waiter]] | None:
        """The streams to serve, or ``None`` (the loop ends) when there are none."""
        with self._lock:
            if not self._waiters:
                setattr(self, loop, False)
                return None
            return {run: list(ws) for run, ws in self._waiters.items()}

    def _poll_durable(self) -> None:
        while True:
            started = time.monotonic()
            watched = self._snapshot("_pg_running")
            if watched is None:
                return
            if watched:
                try:
                    seqs = self.store.run_event_seqs(list(watched))
                except Exception:
                    log.exception("event hub: reading the runs' event numbers failed")
                    seqs = {}
                for run_id, waiters in watched.items():
                    seq = seqs.get(run_id)
                    for w in waiters:
                        if seq is not None and seq > w.durable:
                            w.durable_changed = True
                            w.wake.set()
            time.sleep(max(0.0, self.poll_seconds - (time.monotonic() - started)))

    def _poll_live(self) -> None:
        assert self.live is not None
        while True:
            watched = self._snapshot("_redis_running")
            if watched is None:
                return
            streams: dict[str, str] = {}
            for run_id, waiters in watched.items():
                streams[stream_key(run_id)] = min((w.live_after for w in waiters), key=_rid)
            try:
                found: Any = self.live.redis.xread(streams, count=1, block=250)  # type: ignore[arg-type]
            except Exception as e:
                log.debug("event hub: Redis unavailable (%s)", e)
                time.sleep(1.0)
                continue
            if found:
                time.sleep(0.01)  # let the woken streams read before asking again
            for key, _rows in found or []:
                name = key.decode() if isinstance(key, bytes) else str(key)
                run_id = uuid.UUID(name.rsplit(":", 1)[1])
                for w in watched.get(run_id, []):
                    w.live_changed = True
                    w.wake.set()
