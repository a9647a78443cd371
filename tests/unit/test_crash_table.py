"""The docs' "What runs again after a crash" table (docs/durable/after-a-crash.md) and the
engine's step kinds (``runtime.pipeline.kinds.KINDS``) say the same thing, both ways: every kind
has its row with the same rule, and every row names a kind. The table is there once: no other
page of the docs (nor the README) carries a copy that could drift."""

from __future__ import annotations

import pytest

from runtime.pipeline.kinds import HEADER, KINDS, AfterCrash, Before, StepKind
from tests.docs_pages import DOCS, pages

CRASH_PAGE = DOCS / "durable" / "after-a-crash.md"


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split(" | ")]


def crash_table_rows() -> dict[str, list[str]]:
    """The table's rows by their first cell (the step kind's name)."""
    lines = CRASH_PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("**What runs again after"))
    head = next(i for i in range(start, len(lines)) if lines[i].startswith("| step kind"))
    assert lines[head] == HEADER, "the crash table's columns changed: see runtime/pipeline/kinds.py"
    rows: dict[str, list[str]] = {}
    for line in lines[head + 2 :]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        assert cells[0] not in rows, f"two rows for {cells[0]!r}"
        rows[cells[0]] = cells
    return rows


def test_every_row_of_the_crash_table_names_a_step_kind() -> None:
    names = {policy.name for policy in KINDS.values()}
    unknown = set(crash_table_rows()) - names
    assert not unknown, (
        f"crash table rows naming no kind of runtime.pipeline.kinds.KINDS: {unknown}"
    )


@pytest.mark.parametrize("kind", list(StepKind))
def test_every_step_kind_has_its_row_with_the_same_rule(kind: StepKind) -> None:
    policy = KINDS[kind]
    row = crash_table_rows().get(policy.name)
    assert row is not None, f"the docs' crash table has no row {policy.name!r} for {kind}"
    _, key, before, after, compensable, bills, _notes = row
    assert key == policy.key
    assert Before(before) is policy.before
    assert AfterCrash(after) is policy.after_crash
    assert compensable == ("yes" if policy.compensable else "no")
    assert bills == ("yes" if policy.bills else "no")
    assert row == _cells(policy.readme_row()), "print the table: python -m runtime.pipeline"


def test_the_crash_table_is_printed_once_in_the_docs() -> None:
    holders = [p.name for p in pages() if HEADER in p.read_text()]
    assert holders == [CRASH_PAGE.name], holders


def test_every_kind_has_a_policy_and_one_name() -> None:
    assert set(KINDS) == set(StepKind)
    assert len({p.name for p in KINDS.values()}) == len(KINDS)


def test_only_steps_written_started_first_run_through_the_effect_executor() -> None:
    for policy in KINDS.values():
        assert policy.has_effect == (policy.before is Before.STARTED)
        if policy.after_crash is AfterCrash.CALLED_AGAIN:
            assert policy.bills
            assert policy.before is Before.NOTHING


def test_the_stores_compensable_rows_are_the_tables() -> None:
    """A run ended from outside (a cancel, an operator's fail) is handed to a worker to undo
    when it has a completed step of a compensable kind: the store's list (in its SQL) must
    be the table's, or a new compensable kind's steps are never undone (issue 35, U4)."""
    from db.store import COMPENSABLE_KINDS
    from runtime.pipeline.kinds import KINDS

    assert set(COMPENSABLE_KINDS) == {p.row for p in KINDS.values() if p.compensable}
