"""Billed tokens the database could not take when they were billed, kept in this process
until it can.

A model call answered while PostgreSQL is unreachable (a partition, a failover, a restart
longer than the lease) must still be counted against its run: the money was spent. Its
checkpoint is retried while the lease lasts (``runtime.pipeline.modelcall.record_billed``); when the
lease is gone and the database still does not answer, the usage is owed here, and a daemon
thread writes it as the run's unrecorded tokens as soon as the database answers again
(every second at first, then every 5 s). A write conditioned on the step row (``unless`` a
row of that key and lease epoch exists: the checkpoint may have committed before its
connection dropped) is never counted twice. A write's ``then`` runs once it is written (the
engine erases the call's lost-call record then, and takes back an estimate counted
meanwhile: the exact count replaces the estimate, never both).

What is owed lives in memory: a process killed while it owes loses it (logged when owed,
and counted in ``pending``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from db.errors import database_unavailable

log = logging.getLogger(__name__)

Write = Callable[[Mapping[str, Any]], None]
Then = Callable[[], None]


class OwedUsage:
    def __init__(self, write: Write, *, first_retry: float = 1.0, max_retry: float = 5.0) -> None:
        self._write = write
        self._first = first_retry
        self._max = max_retry
        self._lock = threading.Lock()
        self._owed: list[tuple[Mapping[str, Any], Then | None]] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._owed)

    def write_or_owe(self, params: Mapping[str, Any], then: Then | None = None) -> bool:
        """Write now; with the database away keep it and return ``False``. ``then`` runs
        once the write is done (now, or when the database answers)."""
        try:
            self._write(params)
        except Exception as e:
            if not database_unavailable(e):
                raise
        else:
            _after(params, then)
            return True
        with self._lock:
            self._owed.append((params, then))
            n = len(self._owed)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._settle, name="dar-owed", daemon=True)
                self._thread.start()
        log.warning(
            "run=%s the database is away: %d billed tokens kept in this process, to be counted "
            "when it answers (%d owed)",
            str(params["id"])[:8],
            params["total_tokens"],
            n,
            extra={"run_id": str(params["id"]), "event": "usage.owed"},
        )
        return False

    def settle_now(self) -> None:
        """Try the owed writes at once (tests, shutdown)."""
        self._wake.set()

    def _settle(self) -> None:
        delay = self._first
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            with self._lock:
                batch = list(self._owed)
            done = 0
            for entry in batch:
                params, then = entry
                try:
                    self._write(params)
                except Exception as e:
                    if database_unavailable(e):
                        break
                    log.error(
                        "run=%s owed usage dropped: %s",
                        str(params["id"])[:8],
                        type(e).__name__,
                        extra={"run_id": str(params["id"]), "event": "usage.owed_dropped"},
                    )
                else:
                    _after(params, then)
                with self._lock:
                    self._owed.remove(entry)
                done += 1
            if done:
                log.info(
                    "the database answers again: %d owed usage record(s) written",
                    done,
                    extra={"event": "usage.settled"},
                )
            with self._lock:
                if not self._owed:
                    self._thread = None
                    return
            delay = min(delay * 2, self._max)


def _after(params: Mapping[str, Any], then: Then | None) -> None:
    """Run a written record's ``then``; what it raises is logged, not raised: the record
    itself is written."""
    if then is None:
        return
    try:
        then()
    except Exception as e:
        log.error(
            "run=%s after the usage record: %s",
            str(params["id"])[:8],
            type(e).__name__,
            exc_info=True,
            extra={"run_id": str(params["id"]), "event": "usage.then_failed"},
        )
