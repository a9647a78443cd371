"""The heartbeat: renews the leases a worker process holds while their steps run.

One background thread per process renews every held lease with one statement. A lease that
could not be renewed (another worker took the run over) is marked lost; the step then stops
without writing. Its writes would be refused by the fence anyway; the flag only saves work.

Under gevent (the shipped worker) the renewal runs on a native OS thread of its own, not a
greenlet. A greenlet runs only when the hub gets round to it, after every other greenlet
ready before it has run to its next yield: with thousands of model calls parsing their
streams on a busy host, one turn of the hub took longer than the lease had left, the lease
lapsed while its holder was alive and its call still open, and the run was taken over and
its call paid twice (issue 36: 58 of 10,000 runs). A native thread is scheduled by the OS
and, for the GIL, within the interpreter's switch interval (5 ms), whatever the hub is
doing. It has its own database connection (the lease store's pool of one) and touches
nothing the greenlets share but the table of held leases, under a lock held for a dict copy.
What else renews with the leases (:meth:`Heartbeat.also_renew`: concurrency-key slots in
Redis, the version a worker serves) uses clients shared with the greenlets, so it stays on
a greenlet of the hub.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from db.records import Claim
from db.store import RunStore
from runtime.native import gevent_patched

log = logging.getLogger(__name__)


def _native(name: str) -> Any:
    """``_thread.<name>`` as the interpreter made it (a real OS thread or lock), also when
    gevent has patched the module."""
    if gevent_patched():
        from gevent import monkey

        return monkey.get_original("_thread", name)
    return getattr(_thread, name)


@dataclass
class HeldLease:
    claim: Claim
    lost: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class Claiming:
    """A claim sent and not answered yet (:meth:`Heartbeat.claiming`)."""

    run_id: uuid.UUID
    token: uuid.UUID
    worker: str


class Heartbeat:
    def __init__(
        self, store: RunStore, worker: str, *, lease_seconds: float, interval_seconds: float
    ) -> None:
        self._store = store
        self._worker = worker
        self._lease_seconds = lease_seconds
        self._interval = interval_seconds
        self._held: dict[tuple[uuid.UUID, int], HeldLease] = {}
        self._claiming: list[Claiming] = []
        # A real lock (never gevent's): taken by greenlets and by the native thread, each
        # time only for a dict operation, never across a yield.
        self._lock = _native("allocate_lock")()
        self._stop = threading.Event()
        self._halt = _native("allocate_lock")()  # held while running; released by stop()
        self._thread: threading.Thread | None = None
        self._native_done: Any = None  # a real lock the native thread holds while it runs
        self._also: list[Callable[[], None]] = []

    @property
    def native(self) -> bool:
        """Whether the leases are renewed on a native OS thread (under gevent)."""
        return self._native_done is not None

    def also_renew(self, renew: Callable[[], None]) -> None:
        """Call ``renew`` at every beat too (slots bounded by the lease, e.g. concurrency
        keys), so they live exactly as long as the leases of the steps holding them."""
        if renew not in self._also:
            self._also.append(renew)

    @contextlib.contextmanager
    def claiming(self, run_id: uuid.UUID, token: uuid.UUID, worker: str) -> Iterator[None]:
        """Around a claim of ``run_id`` for the message carrying ``token``, and what follows
        until the lease is held (:meth:`hold`): the claim may commit, and its lease start,
        long before its greenlet gets the answer on a busy hub. Meanwhile the lease claimed
        for ``worker`` with ``token`` is renewed as any held one (one statement a beat for
        all of them), so it does not lapse in that window while the worker is alive."""
        pending = Claiming(run_id, token, worker)
        with self._lock:
            self._claiming.append(pending)
        try:
            yield
        finally:
            with self._lock, contextlib.suppress(ValueError):
                self._claiming.remove(pending)

    @contextlib.contextmanager
    def hold(self, claim: Claim) -> Iterator[HeldLease]:
        held = HeldLease(claim)
        key = (claim.run_id, claim.epoch)
        with self._lock:
            self._held[key] = held
            # The claim's answer is read: its lease is renewed by its epoch from now on.
            token = claim.run.dispatch_token
            for pending in self._claiming:
                if (pending.run_id, pending.token) == (claim.run_id, token):
                    self._claiming.remove(pending)
                    break
        try:
            yield held
        finally:
            with self._lock:
                self._held.pop(key, None)

    def beat(self) -> None:
        """Renew every held lease once, then what renews with them."""
        self.renew_leases()
        self.renew_also()

    def renew_leases(self) -> None:
        """Renew every held lease once (one statement per worker name)."""
        with self._lock:
            held = list(self._held.values())
            claiming = list(self._claiming)
        if claiming:
            pending: dict[str, set[tuple[uuid.UUID, uuid.UUID]]] = {}
            for c in claiming:
                pending.setdefault(c.worker, set()).add((c.run_id, c.token))
            for worker, pairs in pending.items():
                self._store.renew_claims(worker, pairs, self._lease_seconds)
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

    def renew_also(self) -> None:
        for renew in self._also:
            try:
                renew()
            except Exception:
                log.exception("renewing slots with the leases failed; will retry")

    def _loop(self) -> None:
        """Leases and the rest, on one thread (no gevent: threads are native anyway); under
        gevent, the rest only, on a greenlet (:meth:`_native_loop` renews the leases)."""
        while not self._stop.wait(self._interval):
            try:
                self.renew_also() if self.native else self.beat()
            except Exception:  # the database may be briefly away; the lease has slack
                log.exception("heartbeat failed; will retry")

    def _native_loop(self, done: Any) -> None:
        try:
            while not self._halt.acquire(True, self._interval):
                try:
                    self.renew_leases()
                except Exception:  # the database may be briefly away; the lease has slack
                    log.exception("heartbeat failed; will retry")
            self._halt.release()
        finally:
            done.release()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._halt.acquire()
        if gevent_patched():
            done = _native("allocate_lock")()
            done.acquire()
            self._native_done = done
            _native("start_new_thread")(self._native_loop, (done,))
        self._thread = threading.Thread(target=self._loop, name="dar-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is None:
            return
        if self._halt.locked():
            self._halt.release()
        self._thread.join(timeout=self._interval + 1)
        self._thread = None
        if self._native_done is not None:
            if self._native_done.acquire(True, self._interval + 1):
                self._native_done.release()
            self._native_done = None
