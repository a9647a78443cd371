"""The step log cache hands a run's rows back in seq order without sorting them each time."""

from __future__ import annotations

import dataclasses
import uuid

from db.records import StepStatus
from db.steplog import StepLogCache
from tests.unit.test_replay import Log

RUN = uuid.UUID(int=7)
TOKEN = uuid.UUID(int=8)


def _cycle(cache: StepLogCache, rows: list) -> list:  # type: ignore[type-arg]
    cache.wrote(RUN, 1, rows, TOKEN)
    got = cache.get(RUN, TOKEN, 1)
    assert got is not None
    return got


def test_rows_come_back_in_seq_order_whatever_order_they_were_written_in() -> None:
    log = Log()
    for i in range(6):
        log.tool(f"toolu_{i}", "t", status=StepStatus.STARTED)
    a, b, c, d, e, f = log.steps
    cache = StepLogCache()
    cache.loaded(RUN, 1, [a, b])
    assert _cycle(cache, [c]) == [a, b, c]
    done = dataclasses.replace(b, status=StepStatus.DONE)
    assert _cycle(cache, [done]) == [a, done, c], "a rewritten row keeps its place"
    assert _cycle(cache, [e, d]) == [a, done, c, d, e], "written out of order: sorted"
    moved = dataclasses.replace(a, seq=99)
    assert [s.seq for s in _cycle(cache, [f, moved])] == [2, 3, 4, 5, 6, 99]
