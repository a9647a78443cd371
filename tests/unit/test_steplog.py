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
    """Rows written by the lease that handed the run on; the next claim (epoch + 1)."""
    epoch = cache._logs[RUN].epoch
    cache.wrote(RUN, epoch, rows, TOKEN)
    got = cache.get(RUN, TOKEN, epoch + 1)
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


def test_a_hand_over_serves_the_claim_right_after_it_once() -> None:
    """Issue 23 defect 1: the token alone does not make the copy exact. A duplicated message
    carries the same token; another process claiming with it bumps the epoch (and may write
    rows): a claim whose epoch is not the hand-over's + 1 reads the database. And one
    hand-over serves one claim: the hit consumes it."""
    log = Log()
    log.tool("toolu_0", "t", status=StepStatus.DONE)
    (a,) = log.steps
    cache = StepLogCache()
    cache.loaded(RUN, 1, [])
    cache.wrote(RUN, 1, [a], TOKEN)
    assert cache.get(RUN, TOKEN, 3) is None, "another claim came between (epoch 2)"
    assert cache.since(RUN, None) is None
    cache.loaded(RUN, 4, [])
    cache.wrote(RUN, 4, [a], TOKEN)
    assert cache.get(RUN, TOKEN, 5) == [a]
    assert cache.get(RUN, TOKEN, 5) is None, "the hit consumed the hand-over"


def test_a_write_of_another_lease_drops_the_copy_and_takes_no_token() -> None:
    """A copy following epoch 1 cannot take a hand-over written by epoch 4 (the rows of
    epochs 2-3, written elsewhere, are not in it): the copy is dropped."""
    log = Log()
    log.tool("toolu_0", "t", status=StepStatus.DONE)
    cache = StepLogCache()
    cache.loaded(RUN, 1, log.steps)
    cache.wrote(RUN, 4, [], TOKEN)
    assert cache.get(RUN, TOKEN, 5) is None
    assert RUN not in cache._logs
