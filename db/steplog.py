"""A process's copy of the step logs of the runs it handed on, so the next step of a run that
comes back to this process reads nothing.

Why it is exact: every change to a run's step rows is made either by the worker holding the
run (each write returns the row it wrote, and is applied here after its commit) or by a
transition that also gives the run a new dispatch token (an approval decision, an operator's
resolution, a resume, the reaper's re-dispatch). A copy is therefore used only for a claim
whose message carries the token this process itself handed on with the last step it wrote;
any other claim reads the log from the database. Bounded (least recently used first out).
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
    last_seq: int = 0
    ordered: bool = True
    """``rows`` (insertion order) are in seq order: a new row has a higher seq than all
    before it, a rewritten row keeps its place. Checked, not assumed."""


class StepLogCache:
    def __init__(self, capacity: int = 512) -> None:
        self.capacity = capacity
        self._logs: OrderedDict[uuid.UUID, _Log] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, run_id: uuid.UUID, token: uuid.UUID | None, epoch: int) -> list[Step] | None:
        """The log, when this process handed the run on with ``token``; it then follows the
        writes of the lease ``epoch``."""
        with self._lock:
            log = self._logs.get(run_id)
            if log is None or token is None or log.token != token:
                self.misses += 1
                return None
            self.hits += 1
            log.epoch, log.token = epoch, None
            self._logs.move_to_end(run_id)
            rows = list(log.rows.values())
            return rows if log.ordered else sorted(rows, key=lambda s: s.seq)

    def loaded(self, run_id: uuid.UUID, epoch: int, rows: list[Step]) -> None:
        """The log as read from the database under the lease ``epoch``."""
        if self.capacity <= 0:
            return
        with self._lock:
            log = _Log(epoch)
            self._add(log, rows)
            self._logs[run_id] = log
            self._logs.move_to_end(run_id)
            while len(self._logs) > self.capacity:
                self._logs.popitem(last=False)

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
