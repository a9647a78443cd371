"""The hot statements of a step, run on the pooled psycopg connection without SQLAlchemy's
statement layer.

A step is two or three single statements (claim, ``STARTED``, checkpoint). Through
SQLAlchemy each costs ~0.3 ms of CPU beyond psycopg's own work: compiling the bind names,
building the result's metadata from 35 column descriptions, an event dispatch per hook, the
row proxy. On a 2-core host that was a third of a step's worker CPU (``bench/inproc.py``).
Here the statement text is converted once to psycopg's ``%(name)s`` placeholders, psycopg
prepares it server-side after a few uses, and a row comes back as a plain ``dict`` keyed
by the result's field names.

What SQLAlchemy did for these statements and must still happen:

- the pool: a connection is checked out and returned as for any other statement (the
  pool's checkout events, the idle ping included, run as usual) and set to autocommit for
  the statement only;
- a broken connection is invalidated so the pool never hands it out again, and psycopg's
  exceptions surface as SQLAlchemy's (``OperationalError`` with ``connection_invalidated``
  and friends) so callers that classify database errors see the same types;
- parameters never appear in an exception's text (the engine's ``hide_parameters``);
- ``before_cursor_execute`` listeners (the benchmarks count round trips with them) are told.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import psycopg
from sqlalchemy import Engine, TextClause
from sqlalchemy import exc as sa_exc

_BIND = re.compile(r"(?<![:\w]):([A-Za-z_]\w*)")


def to_psycopg(clause: TextClause) -> str:
    """``:name`` binds become ``%(name)s``; a literal ``%`` is doubled; ``::casts`` stay."""
    return _BIND.sub(r"%(\1)s", clause.text.replace("%", "%%"))


def _dict_rows(cursor: psycopg.Cursor[Any]) -> Any:
    result = cursor.pgresult
    if result is None or not result.nfields:
        return lambda values: {}
    names = [result.fname(i).decode() for i in range(result.nfields)]  # type: ignore[union-attr]
    return lambda values: dict(zip(names, values, strict=True))


class FastStatements:
    """Executes converted statements on ``engine``'s pool. Thread- and greenlet-safe: a
    connection is checked out per call."""

    def __init__(self, engine: Engine, statements: Mapping[str, TextClause]) -> None:
        self._engine = engine
        self._sql = {name: to_psycopg(clause) for name, clause in statements.items()}

    def one(self, name: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        """The first row of ``name`` (a dict), or ``None``; one round trip, autocommit."""
        return self._run(name, params, psycopg.Cursor.fetchone)  # type: ignore[no-any-return]

    def all(self, name: str, params: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every row of ``name`` (dicts); one round trip, autocommit."""
        return self._run(name, params, psycopg.Cursor.fetchall)  # type: ignore[no-any-return]

    def rowcount(self, name: str, params: Mapping[str, Any]) -> int:
        """The rows ``name`` touched; one round trip, autocommit."""
        return self._run(name, params, _rowcount)  # type: ignore[no-any-return]

    def _run(
        self, name: str, params: Mapping[str, Any], result: Callable[[psycopg.Cursor[Any]], Any]
    ) -> Any:
        sql = self._sql[name]
        engine = self._engine
        try:
            raw = engine.raw_connection()
        except psycopg.Error as e:  # the server is down or refuses: as SQLAlchemy raises it
            raise _wrapped(engine, sql, params, e, invalidated=True) from e
        conn: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
        try:
            conn.autocommit = True
            if engine.dispatch.before_cursor_execute:
                engine.dispatch.before_cursor_execute(None, None, sql, params, None, False)
            with conn.cursor(row_factory=_dict_rows) as cur:
                cur.execute(sql, params)
                out = result(cur)
            conn.autocommit = False
        except psycopg.Error as e:
            invalidated = engine.dialect.is_disconnect(e, raw, None)  # type: ignore[arg-type]
            if not invalidated:
                try:
                    conn.autocommit = False
                except psycopg.Error:  # in no state to go back to the pool
                    invalidated = True
            if invalidated:
                raw.invalidate(e)
            raise _wrapped(engine, sql, params, e, invalidated=invalidated) from e
        except BaseException as e:
            # Interrupted mid-statement (a gevent timeout, a signal, a crash test's
            # BaseException): the connection's state is unknown, so it is never reused.
            raw.invalidate(e)
            raise
        finally:
            raw.close()  # back to the pool, or discarded when invalidated
        return out


def _rowcount(cursor: psycopg.Cursor[Any]) -> int:
    return cursor.rowcount


def _wrapped(
    engine: Engine, sql: str, params: Mapping[str, Any], e: psycopg.Error, *, invalidated: bool
) -> Exception:
    """psycopg's exception as SQLAlchemy's (``OperationalError``, ``IntegrityError``...),
    parameters hidden."""
    return sa_exc.DBAPIError.instance(
        sql,
        dict(params),
        e,
        psycopg.Error,
        hide_parameters=True,
        dialect=engine.dialect,
        connection_invalidated=invalidated,
    )
