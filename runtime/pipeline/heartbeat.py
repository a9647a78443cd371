"""The heartbeat: renews the leases a worker process holds while their steps run.

One background thread per process renews every held lease with one statement. A lease that
could not be renewed (another worker took the run over) is marked lost; the step then stops
without writing. Its writes would be refused by the fence anyway; the flag only saves work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from db.records import Claim
from db.store import RunStore

log = logging.getLogger(__name__)


@dataclass
class HeldLease:
    claim: Claim
    lost: threading.Event = field(default_factory=threading.Event)


class Heartbeat:
    def __init__(
        self, store: RunStore, worker: str, *, lease_seconds: float, interval_seconds: float
    ) -> None:
        self._store = store
        self._worker = worker
        self._lease_seconds = lease_seconds
        self._interval = interval_seconds
        self._held: dict[tuple[uuid.UUID, int], HeldLease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._also: list[Callable[[], None]] = []

    def also_renew(self, renew: Callable[[], None]) -> None:
        """Call ``renew`` at every beat too (slots bounded by the lease, e.g. concurrency
        keys), so they live exactly as long as the leases of the steps holding them."""
        if renew not in self._also:
            self._also.append(renew)

    @contextlib.contextmanager
    def hold(self, claim: Claim) -> Iterator[HeldLease]:
        held = HeldLease(claim)
        key = (claim.run_id, claim.epoch)
        with self._lock:
            self._held[key] = held
        try:
            yield held
        finally:
            with self._lock:
                self._held.pop(key, None)

    def beat(self) -> None:
        """Renew every held lease once."""
        with self._lock:
            held = list(self._held.values())
        by_worker: dict[str, list[HeldLease]] = {}
        for h in held:
            by_worker.setdefault(h.claim.worker, []).append(h)
        for worker, leases in by_worker.items():
            taken = self._store.renew_leases(
                worker, [(h.claim.run_id, h.claim.epoch) for h in leases], self._lease_seconds
            )
            for h in leases:
                if h.claim.run_id in taken and not h.lost.is_set():
                    log.warning("run=%s lease lost: another worker took it over", h.claim.run_id)
                    h.lost.set()
        for renew in self._also:
            try:
                renew()
            except Exception:
                log.exception("renewing slots with the leases failed; will retry")

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.beat()
            except Exception:  # the database may be briefly away; the lease has slack
                log.exception("heartbeat failed; will retry")

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="dar-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self._interval + 1)
            self._thread = None
