"""Database errors are translated once, at the store: with the database away every store call
raises ``DatabaseUnavailable`` (the driver's error as its cause, neither the statement nor its
parameters in the message), which is all the engine catches; any other error comes out as it
was, so bad data or a bug is never retried as if the database had blinked."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy.exc import DBAPIError, OperationalError

from db.engine import make_engine
from db.errors import DatabaseUnavailable, RunNotFound, ValueRefused
from db.store import RunStore
from runtime.engine.bootstrap import Runtime


def test_a_store_whose_database_is_away_raises_database_unavailable() -> None:
    engine = make_engine("postgresql://postgres@127.0.0.1:1/nothing_listens", pool_size=1)
    store = RunStore(engine)
    run_id = uuid.uuid4()
    try:
        with pytest.raises(DatabaseUnavailable) as caught:
            store.get_run(run_id)
        with pytest.raises(DatabaseUnavailable):
            store.redispatch_due(redispatch_after=1.0)
    finally:
        engine.dispose()
    assert isinstance(caught.value.__cause__, OperationalError)
    assert "the database is not answering" in str(caught.value)
    assert "SELECT" not in str(caught.value), "the statement stays out of the message"
    assert str(run_id) not in str(caught.value), "and so do its parameters"


def test_other_errors_come_out_as_they_were(runtime: Runtime) -> None:
    with pytest.raises(RunNotFound):
        runtime.store.get_run(uuid.uuid4())
    with pytest.raises(ValueRefused) as caught:  # the store translates a refused value
        runtime.store.get_run("not a uuid")  # type: ignore[arg-type]
    assert isinstance(caught.value.__cause__, DBAPIError), "the driver's error as its cause"
    assert "not a uuid" in str(caught.value)
    assert runtime.store.count_runs_by_status() is not None, "the store still answers"
