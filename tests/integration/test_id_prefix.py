"""The run list's id-prefix search as a range of the primary key (migration 0013's query
shapes): exactly the ids whose text starts with the prefix, dashes where a uuid has them."""

from __future__ import annotations

import uuid

from sqlalchemy import text

from db.store import RunStore
from runtime.engine.bootstrap import Runtime
from tests.support import submit


def _with_id(runtime: Runtime, new_id: str) -> uuid.UUID:
    run, _ = submit(runtime.store)
    with runtime.engine.begin() as conn:  # test-only: the run's id rewritten
        conn.execute(text("DELETE FROM run_event WHERE run_id = :old"), {"old": run.id})
        conn.execute(
            text("UPDATE run SET id = :new WHERE id = :old"), {"new": new_id, "old": run.id}
        )
    return uuid.UUID(new_id)


def _found(store: RunStore, prefix: str) -> set[uuid.UUID]:
    return {r.id for r in store.list_runs(id_prefix=prefix, limit=100)}


def test_a_prefix_finds_exactly_the_ids_that_start_with_it(runtime: Runtime) -> None:
    a = _with_id(runtime, "9b7d41c0-0000-4000-8000-000000000001")
    b = _with_id(runtime, "9b7d41c0-ffff-4fff-bfff-ffffffffffff")
    c = _with_id(runtime, "9b7d41c1-0000-4000-8000-000000000000")
    d = _with_id(runtime, "9b7d41bf-ffff-4fff-bfff-ffffffffffff")
    store = runtime.store
    assert _found(store, "9b7d41c0") == {a, b}
    assert _found(store, "9b7d41c0-") == {a, b}
    assert _found(store, "9b7d41c0-f") == {b}
    assert _found(store, "9b7d41") == {a, b, c, d}
    assert _found(store, "9b7d41c") == {a, b, c}
    assert _found(store, str(a)) == {a}
    assert _found(store, "9b7d-") == set(), "a dash where no uuid has one matches nothing"
    assert _found(store, "9b7d41c0f") == set(), "nor a digit where the dash is"
    assert _found(store, "0") == set()
