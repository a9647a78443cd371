"""A process's copy of the step logs of the runs it worked on, so the next step of a run that
comes back to this process reads nothing, or only what other workers wrote meanwhile.

Why a copy that this process handed on is exact: every change to a run's step rows is made
either by the worker holding the run (each write returns the row it wrote, and is applied
here after its commit) or by a transition that also gives the run a new dispatch token (an
approval decision, an operator's resolution, a resume, the reaper's re-dispatch). So the
claim right after this process handed the run on (its message carries that token, its lease
epoch is the hand-over's + 1: no other claim came between, not even one of a duplicated
message with the same token) reads nothing.

Why catching up an older copy is exact. Any other claim finds a copy (if any) that follows
the writes of lease epoch ``e``: it holds every row as of the end of every earlier epoch,
and the rows of ``e`` itself as far as this process applied them. Since then:

- every worker write sets the row's ``lease_epoch`` to the writer's epoch (the fence makes
  it the run's current one), and epochs grow with each claim: the rows written by workers
  since are exactly those with ``lease_epoch >= e`` (``e`` included, for a write of this
  process whose commit it did not see);
- every other writer of step rows changes the run's status in the same transaction (an
  approval is decided on a ``WAITING`` run, a resolution on a ``NEEDS_ATTENTION`` one, a
  resume on a ``FAILED`` one): such a copy is caught up only while ``run.status_changes``
  (kept by the status trigger, migration 0012) is what it was when the copy last followed
  the run;
- rows are deleted only by a fork's worker dropping copied rows (with the run suspended,
  so a status change too), and the catch-up compares the run's row count all the same.

Anything else reads the whole log. A caught-up row equal to the one held keeps the object
held, so the replay cache (identity-checked) continues from it. Bounded (least recently
used first out).
"""

from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from db.records import Step


@dataclass
class _Log:
    epoch: int
    """The lease epoch whose writes this copy follows."""
    rows: dict[str, Step] = field(default_factory=dict)
    token: uuid.UUID | None = None
    """The dispatch token this process handed the run on with, once it has."""
    handed_epoch: int | None = None
    """The lease epoch that handed the run on with ``token``: only the claim right after it
    (epoch + 1) may be served this copy."""
    last_seq: int = 0
    ordered: bool = True
    """``rows`` (insertion order) are in seq order: a new row has a higher seq than all
    before it, a rewritten row keeps its place. Checked, not assumed."""
    status_changes: int | None = None
    """The run's ``status_changes`` when this copy last followed it (``None``: unknown)."""


class StepLogCache:
    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._logs: OrderedDict[uuid.UUID, _Log] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.catch_ups = 0
        self.caught_up_rows = 0
        self.caught_up_wrong = 0

    def get(
        self,
        run_id: uuid.UUID,
        token: uuid.UUID | None,
        epoch: int,
        status_changes: int | None = None,
    ) -> list[Step] | None:
        """The log, when this process handed the run on with ``token`` and this is the claim
        right after that hand-over; it then follows the writes of the lease ``epoch``.

        The token alone does not say so: a message can be delivered twice (the publisher
        retries a push once on a timeout), and another process may have claimed the run with
        the same token meanwhile and written rows (a ``STARTED`` one, then died). Each claim
        bumps the epoch, so ``epoch`` is the hand-over's + 1 only when no other claim came
        between; a hit consumes the hand-over (one hand-over, one hit)."""
        with self._lock:
            log = self._logs.get(run_id)
            if (
                log is None
                or token is None
                or log.token != token
                or log.handed_epoch is None
                or epoch != log.handed_epoch + 1
            ):
                self.misses += 1
                return None
            self.hits += 1
            log.epoch, log.token, log.status_changes = epoch, None, status_changes
            self._logs.move_to_end(run_id)
            return self._rows(log)

    def since(self, run_id: uuid.UUID, status_changes: int | None) -> int | None:
        """The lease epoch from which this process's copy can catch up (see the module's
        docstring), or ``None`` when it cannot."""
        with self._lock:
            log = self._logs.get(run_id)
            if log is None or status_changes is None or log.status_changes != status_changes:
                return None
            return log.epoch

    def caught_up(
        self, run_id: uuid.UUID, since: int, epoch: int, changed: list[Step], total: int
    ) -> list[Step] | None:
        """Apply the rows written under lease epochs ``since`` and later (``total``: the
        run's number of rows); the copy then follows the writes of ``epoch``. ``None`` (and
        the copy dropped) when it does not add up: read the whole log."""
        with self._lock:
            log = self._logs.get(run_id)
            if log is None or log.epoch != since:
                return None
            kept = [held if (held := log.rows.get(row.step_key)) == row else row for row in changed]
            self._add(log, kept)
            if len(log.rows) != total:
                self._logs.pop(run_id, None)
                self.caught_up_wrong += 1
                return None
            self.caught_up_rows += len(changed)
            self.catch_ups += 1
            log.epoch, log.token = epoch, None
            self._logs.move_to_end(run_id)
            return self._rows(log)

    def loaded(
        self, run_id: uuid.UUID, epoch: int, rows: list[Step], status_changes: int | None = None
    ) -> None:
        """The log as read from the database under the lease ``epoch``."""
        if self.capacity <= 0:
            return
        with self._lock:
            log = _Log(epoch, status_changes=status_changes)
            self._add(log, rows)
            self._logs[run_id] = log
            self._logs.move_to_end(run_id)
            while len(self._logs) > self.capacity:
                self._logs.popitem(last=False)

    @staticmethod
    def _rows(log: _Log) -> list[Step]:
        rows = list(log.rows.values())
        return rows if log.ordered else sorted(rows, key=lambda s: s.seq)

    def wrote(
        self,
        run_id: uuid.UUID,
        epoch: int,
        rows: list[Step],
        handed_on_with: uuid.UUID | None = None,
    ) -> None:
        """Committed writes of the lease ``epoch`` (and the token the run was handed on
        with, if it was)."""
        with self._lock:
            log = self._logs.get(run_id)
            if log is None or log.epoch != epoch:
                self._logs.pop(run_id, None)
                return
            self._add(log, rows)
            log.token = handed_on_with
            log.handed_epoch = epoch if handed_on_with is not None else None

    @staticmethod
    def _add(log: _Log, rows: list[Step]) -> None:
        for row in rows:
            before = log.rows.get(row.step_key)
            if before is None:
                log.ordered = log.ordered and row.seq > log.last_seq
                log.last_seq = max(log.last_seq, row.seq)
            elif before.seq != row.seq:
                log.ordered = False
            log.rows[row.step_key] = row

    def forget(self, run_id: uuid.UUID) -> None:
        with self._lock:
            self._logs.pop(run_id, None)
