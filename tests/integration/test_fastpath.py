"""The step's statements outside SQLAlchemy's statement layer (db.fastpath), against real
PostgreSQL: what SQLAlchemy did for them must still hold — broken connections leave the
pool, errors keep SQLAlchemy's types with parameters hidden, an interrupted statement never
hands a half-used connection to the next caller, and a pooled connection goes back to
transactional mode."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.exc import DataError, OperationalError

from db.engine import make_engine
from db.fastpath import FastStatements, to_psycopg
from db.queries import QUERIES


class Interrupted(BaseException):
    """Stands for a gevent timeout or a signal arriving mid-statement."""


@pytest.fixture
def engine(database_url: str) -> Iterator[Engine]:
    engine = make_engine(database_url, pool_size=1, max_overflow=0)
    yield engine
    engine.dispose()


def _backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT pg_backend_pid()")).scalar_one())


def test_binds_become_psycopg_placeholders_and_casts_and_percent_survive() -> None:
    clause = text(
        "SELECT :a::int, '-infinity'::timestamptz, x LIKE :p || '%' FROM t WHERE id = :id"
    )
    assert to_psycopg(clause) == (
        "SELECT %(a)s::int, '-infinity'::timestamptz, x LIKE %(p)s || '%%' FROM t WHERE id = %(id)s"
    )


def test_every_hot_statement_converts_to_the_same_binds(engine: Engine) -> None:
    fast = FastStatements(engine, {"get_run": QUERIES["get_run"]})
    assert fast.one("get_run", {"id": uuid.uuid4()}) is None  # executes: binds line up


def test_a_killed_backend_is_invalidated_and_the_next_statement_gets_a_new_connection(
    engine: Engine, database_url: str
) -> None:
    fast = FastStatements(engine, {"pid": text("SELECT pg_backend_pid() AS pid")})
    first = fast.one("pid", {})
    assert first is not None
    with make_engine(database_url, pool_size=1).connect() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:p)"), {"p": first["pid"]})
        admin.commit()
    with pytest.raises(OperationalError) as caught:
        fast.one("pid", {})
    assert caught.value.connection_invalidated
    again = fast.one("pid", {})
    assert again is not None
    assert again["pid"] != first["pid"]


def test_errors_keep_sqlalchemys_types_and_hide_parameters(engine: Engine) -> None:
    fast = FastStatements(
        engine, {"div": text("SELECT 1 / CAST(:d AS int) AS v WHERE CAST(:prompt AS text) <> ''")}
    )
    with pytest.raises(DataError) as caught:  # division by zero
        fast.one("div", {"d": "0", "prompt": "secret-prompt-text"})
    assert "secret-prompt-text" not in str(caught.value)
    assert "parameters hidden" in str(caught.value)
    assert not caught.value.connection_invalidated
    assert fast.one("div", {"d": "1", "prompt": "x"}) == {"v": 1}  # same connection, still good


def test_an_interrupted_statement_never_returns_its_connection_to_the_pool(
    engine: Engine,
) -> None:
    fast = FastStatements(engine, {"one": text("SELECT 1 AS one")})
    before = _backend_pid(engine)

    def interrupt(*args: object) -> None:
        raise Interrupted

    event.listen(engine, "before_cursor_execute", interrupt)
    try:
        with pytest.raises(Interrupted):
            fast.one("one", {})
    finally:
        event.remove(engine, "before_cursor_execute", interrupt)
    assert _backend_pid(engine) != before
    assert fast.one("one", {}) == {"one": 1}


def test_a_pooled_connection_goes_back_transactional(engine: Engine) -> None:
    """The fast path runs in autocommit; the next user of the same connection must get a
    real transaction that a rollback undoes."""
    fast = FastStatements(engine, {"one": text("SELECT 1 AS one")})
    assert fast.one("one", {}) == {"one": 1}
    with engine.connect() as conn:
        conn.execute(text("CREATE TEMP TABLE fast_probe (x int)"))
        conn.execute(text("INSERT INTO fast_probe VALUES (1)"))
        conn.rollback()
        gone = conn.execute(text("SELECT to_regclass('pg_temp.fast_probe')")).scalar_one()
    assert gone is None


def test_rowcount_counts_the_rows_touched(engine: Engine) -> None:
    fast = FastStatements(
        engine, {"n": text("UPDATE run SET wait_reason = wait_reason WHERE id = :id")}
    )
    assert fast.rowcount("n", {"id": uuid.uuid4()}) == 0


def test_all_returns_every_row_in_order(engine: Engine) -> None:
    fast = FastStatements(engine, {"series": text("SELECT g AS n FROM generate_series(1, :k) g")})
    assert fast.all("series", {"k": 3}) == [{"n": 1}, {"n": 2}, {"n": 3}]
    assert fast.all("series", {"k": 0}) == []
