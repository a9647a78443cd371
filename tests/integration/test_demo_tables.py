"""The acme demo's tables are the demo's own: no migration creates them, migration 0021 drops
the ones earlier releases created where the demo left nothing in them, and the demo sets
them up where it runs (issue 29.7)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine, text

from db.demo import DEMO_TABLES, SEED_TICKETS, TicketStore, demo_metadata
from db.engine import make_engine
from db.migrate import current_revision, head_revision, upgrade
from tests.support import scratch_database

EXISTS = text("SELECT to_regclass(:t) IS NOT NULL")


@pytest.fixture
def fresh(pg_admin_url: str) -> Iterator[Engine]:
    """An empty database of this test's own (the session's one holds the demo's tables)."""
    with scratch_database(pg_admin_url, f"dar_demo_tables_{os.getpid()}") as url:
        engine = make_engine(url, pool_size=4)
        try:
            yield engine
        finally:
            engine.dispose()


def tables_present(engine: Engine) -> dict[str, bool]:
    with engine.connect() as conn:
        return {t: bool(conn.execute(EXISTS, {"t": t}).scalar()) for t in DEMO_TABLES}


def as_an_earlier_release_left_it(engine: Engine) -> None:
    """Migrated to 0020 with the demo's tables as 0001 and 0003 used to create them."""
    upgrade(engine, "0020")
    with engine.begin() as conn:
        demo_metadata.create_all(conn)


def test_the_migrations_create_no_demo_table(fresh: Engine) -> None:
    upgrade(fresh)
    assert current_revision(fresh) == head_revision()
    assert tables_present(fresh) == {"acme_ticket": False, "acme_comment": False}


def test_an_unused_demo_table_is_dropped_by_the_migration(fresh: Engine) -> None:
    as_an_earlier_release_left_it(fresh)
    TicketStore(fresh).seed()  # `dar dev` seeded it; nobody commented
    assert tables_present(fresh) == {"acme_ticket": True, "acme_comment": True}
    upgrade(fresh)
    assert tables_present(fresh) == {"acme_ticket": False, "acme_comment": False}


def test_empty_demo_tables_of_a_production_database_are_dropped(fresh: Engine) -> None:
    as_an_earlier_release_left_it(fresh)  # `dar migrate` only: the tables, empty
    upgrade(fresh)
    assert tables_present(fresh) == {"acme_ticket": False, "acme_comment": False}


@pytest.mark.parametrize("use", ["a comment", "a ticket of its own"])
def test_demo_tables_the_demo_used_are_kept_and_still_serve_it(fresh: Engine, use: str) -> None:
    as_an_earlier_release_left_it(fresh)
    store = TicketStore(fresh)
    store.seed()
    if use == "a comment":
        store.add_comment(101, "looked at it", idempotency_key="toolu_1")
    else:
        with fresh.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO acme_ticket (id, title, status, priority, customer, due_at) "
                    "VALUES (900, 'mine', 'open', 'low', 'me', now())"
                )
            )
    upgrade(fresh)
    assert tables_present(fresh) == {"acme_ticket": True, "acme_comment": True}
    again = TicketStore(fresh)
    assert again.setup() is False, "nothing to create"
    assert again.count_comments() == (1 if use == "a comment" else 0)
    comment_id, created = again.add_comment(102, "and this", idempotency_key="toolu_2")
    assert created
    assert again.add_comment(102, "and this", idempotency_key="toolu_2") == (comment_id, False)


def test_the_demo_agents_tools_set_their_tables_up_on_first_use(fresh: Engine) -> None:
    upgrade(fresh)  # a production database: no demo table
    store = TicketStore(fresh)
    overdue = store.list(overdue=True)  # what the demo agent's list_tickets runs
    seeded = {t[0] for t in SEED_TICKETS if t[2] != "closed" and t[6] < 0}
    assert {t["id"] for t in overdue} == seeded
    comment_id, created = store.add_comment(103, "on it", idempotency_key="toolu_x")
    assert created
    assert store.add_comment(103, "on it", idempotency_key="toolu_x") == (comment_id, False)
    assert tables_present(fresh) == {"acme_ticket": True, "acme_comment": True}


def test_processes_setting_the_demo_up_at_once_do_not_collide(fresh: Engine) -> None:
    upgrade(fresh)
    stores = [TicketStore(fresh) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    created: list[bool] = []
    errors: list[BaseException] = []

    def set_up(store: TicketStore) -> None:
        barrier.wait()
        try:
            created.append(store.setup())
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=set_up, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert sorted(created) == [False, False, False, True], "one creates, the others find it"
    assert len(stores[0].list()) == len(SEED_TICKETS)


def test_a_comment_survives_its_connection_dropping_under_it(
    fresh: Engine, pg_admin_url: str
) -> None:
    """A failover drops every open connection (the partition chaos test's `failover` mode
    caught the demo tool failing on one): the comment is added on a new connection, once."""
    tickets = TicketStore(fresh)
    tickets.setup()
    with fresh.connect() as conn:  # the pool's one idle connection, then dropped under it
        pid = conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
    admin = create_engine(pg_admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            assert conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()
    finally:
        admin.dispose()
    ticket = SEED_TICKETS[0][0]
    first = tickets.add_comment(ticket, "reminder", idempotency_key="k-drop")
    again = tickets.add_comment(ticket, "reminder", idempotency_key="k-drop")
    assert first[1] is True
    assert again == (first[0], False)
    assert tickets.count_comments(ticket) == 1
