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


def test_catching_up_keeps_the_rows_it_holds_and_checks_the_count() -> None:
    log = Log()
    for i in range(4):
        log.tool(f"toolu_{i}", "t", status=StepStatus.DONE)
    a, b, c, d = log.steps
    cache = StepLogCache()
    cache.loaded(RUN, 3, [a, b], status_changes=1)
    assert cache.since(RUN, 2) is None, "the run's status changed since: read it whole"
    assert cache.since(RUN, None) is None
    assert cache.since(RUN, 1) == 3
    same_b = dataclasses.replace(b)
    assert same_b == b
    assert same_b is not b
    got = cache.caught_up(RUN, 3, 5, [same_b, c], total=3)
    assert got == [a, b, c]
    assert got is not None
    assert got[1] is b, "an unchanged row keeps the object the replay cache folded"
    assert cache.since(RUN, 1) == 5, "the copy now follows epoch 5"
    assert cache.caught_up(RUN, 5, 6, [d], total=5) is None, "a row it cannot account for"
    assert cache.since(RUN, 1) is None, "and the copy is dropped"
    assert cache.caught_up_wrong == 1
