"""Shared fixtures: real PostgreSQL and Redis, an emptied database per test.

PostgreSQL: ``TEST_DATABASE_URL`` or ``DATABASE_URL`` when set, otherwise an embedded server
(pgserver) started for the session. Redis: ``TEST_REDIS_URL`` or ``REDIS_URL``, otherwise an
embedded redis-server. One database is migrated once per session (and per xdist process);
every test starts with its rows deleted and its sequences restarted, so tests are isolated
and fast.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from cli.embedded import EmbeddedPostgres, EmbeddedRedis
from db.demo import TicketStore, demo_metadata
from db.engine import make_engine, normalize_url
from db.migrate import upgrade
from db.schema import metadata
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tests.pgbouncer import PgBouncer
from tests.support import drive_queues

TEST_DB = f"dar_test_{os.getpid()}"
_STARTED = pytest.StashKey[float]()
_TOOK = pytest.StashKey[float]()

# The tiers a plain `pytest` leaves out (each a marker; `pytest --all` runs them too, and CI
# does): real processes, the fault campaign, the schema fuzzer, the browser, and the slow
# integration tests. A test joins a tier by its folder (tests/e2e, tests/chaos) or by a marker
# in its module.
FULL_ONLY_TIERS = ("e2e", "chaos", "fuzz", "browser", "slow")
TIER_OF_FOLDER = {"e2e": "e2e", "chaos": "chaos"}
TESTS_ROOT = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="run every tier (e2e, chaos, fuzz, browser, slow) as CI does; "
        "plain `pytest` runs unit and integration only",
    )


# `pytest --all` spreads the test files over this many processes (pytest-xdist, `--dist
# loadfile`: a file's tests share one process, so a module's stack starts once). The slow
# tiers mostly wait (leases, kills, timers), so 4 processes on two cores take the full suite
# from ~20 minutes to ~8. A bare `pytest` (the fast tier) does the same: its tests mostly wait
# on PostgreSQL and Redis too. `-n 0` (or `-p no:xdist`) runs in one process, `-n N` in N; a
# path named on the command line runs in one process unless `-n` says otherwise.
ALL_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    bare = config.args_source == pytest.Config.ArgsSource.TESTPATHS
    if (
        (config.getoption("--all") or bare)
        and getattr(config.option, "numprocesses", "absent") is None  # xdist, no -n given
        and not hasattr(config, "workerinput")  # not inside an xdist worker
        and not config.getoption("collectonly")
    ):
        config.option.numprocesses = ALL_WORKERS
        config.option.dist = "loadfile"
    if config.getoption("--all") and config.getoption("durations") is None:
        # CI's log then says where its minutes went (its limit is 15), run after run.
        config.option.durations = 25


# CI's whole run must end within 15 minutes (900 s) and aims at 8: the install, lint, docs
# build and bytecode take ~50-80 s before the suite on its two cores (mypy and the
# oldest-framework run go beside it), so the suite's share is this many seconds of `pytest
# --all`. The aim is 6 minutes (360 s), not reached on CI yet: clean clones took 405-490 s for
# 1,666 tests (2026-12-07), 357 s on the idle machine, both cores ~85% busy
# (docs/contributing/tests.md). 660 s leaves a third for a CI host that is not idle and keeps
# the whole run under 15 minutes. A CI run (CI=true) whose suite takes longer fails here,
# naming its slowest files, so growth is seen while a landing still fits, not when one times
# out.
SUITE_BUDGET_SECONDS = float(os.environ.get("DAR_SUITE_BUDGET_SECONDS", "660"))


def _budgeted(config: pytest.Config) -> bool:
    """A CI run of ``pytest --all`` (its controller, not an xdist process)."""
    return bool(
        os.environ.get("CI") and config.getoption("--all") and not hasattr(config, "workerinput")
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_STARTED] = time.monotonic()


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _budgeted(config) or _STARTED not in config.stash:
        return
    took = time.monotonic() - config.stash[_STARTED]
    config.stash[_TOOK] = took
    if took > SUITE_BUDGET_SECONDS and exitstatus == 0:
        session.exitstatus = 1  # over its share: the run fails, its summary says why


_CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    """CPU this process and the children it has waited for used: a test's stacks, `dar`
    commands and servers are counted once the test has stopped them."""
    own, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_CPU_AT_START] = _cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """The teardown's report carries the CPU seconds of the test (its processes' too): on two
    cores the suite is bound by CPU, not by waiting, so CI's log names what costs it."""
    outcome: Any = yield
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        used = _cpu_seconds() - item.stash[_CPU_AT_START]
        outcome.get_result().user_properties.append(("cpu_seconds", round(used, 2)))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Under CI, ``pytest --all`` over its budget share fails the run, saying where the time
    went (each file's seconds, summed over its tests' phases)."""
    if _TOOK not in config.stash:
        return
    took = config.stash[_TOOK]
    terminalreporter.write_line(
        f"suite budget: pytest --all took {took:.0f}s of its {SUITE_BUDGET_SECONDS:.0f}s share "
        "of CI's 15 minutes (DAR_SUITE_BUDGET_SECONDS)"
    )
    by_file: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            where = getattr(report, "nodeid", "").split("::")[0]
            if where:
                by_file[where] = by_file.get(where, 0.0) + getattr(report, "duration", 0.0)
    slowest = ", ".join(
        f"{name} {secs:.0f}s" for name, secs in sorted(by_file.items(), key=lambda kv: -kv[1])[:15]
    )
    cpu: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            for key, value in getattr(report, "user_properties", ()):
                if key == "cpu_seconds":
                    where = report.nodeid.split("::")[0]
                    cpu[where] = cpu.get(where, 0.0) + float(value)
    terminalreporter.write_line(
        f"suite budget: CPU seconds of the suite's tests and their processes, "
        f"{sum(cpu.values()):.0f} in all; the most: "
        + ", ".join(f"{n} {c:.0f}" for n, c in sorted(cpu.items(), key=lambda kv: -kv[1])[:15])
    )
    if took <= SUITE_BUDGET_SECONDS:
        # (what LONGEST_FILES should follow: the longest files are handed out first)
        terminalreporter.write_line(f"suite budget: the slowest files: {slowest}")
        return
    terminalreporter.write_line(
        "suite budget EXCEEDED (the run fails): make these faster or share their stacks: "
        + slowest,
        red=True,
    )


def _fast_tier(config: pytest.Config) -> bool:
    """A bare `pytest` (the testpaths, no --all): the fast tier."""
    return (
        not config.getoption("--all") and config.args_source == pytest.Config.ArgsSource.TESTPATHS
    )


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier does not even import the tiers it leaves out by folder (the browser
    driver, the chaos harness): each process of it collects in seconds less."""
    if collection_path.parent == TESTS_ROOT and collection_path.name in TIER_OF_FOLDER:
        return True if _fast_tier(config) else None
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS_ROOT).parts[0]
        except ValueError:
            continue
        if folder in TIER_OF_FOLDER:
            item.add_marker(TIER_OF_FOLDER[folder])
    # Only a bare `pytest` (the testpaths) is the fast tier: a path named on the command
    # line runs what it names.
    if not _fast_tier(config):
        _slow_files_first(items)
        return
    keep, drop = [], []
    for item in items:
        slow = any(item.get_closest_marker(tier) for tier in FULL_ONLY_TIERS)
        (drop if slow else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# The longest files of `pytest --all`, longest first (seconds of one process, summed over
# the file's tests; CI's log names the slowest 15 after its suite budget line). The order of
# an idle run of `pytest --all`, 2026-12-07, after each framework kill file imported only its
# own framework; the 300-calls test stays early (it once took 103 s instead of 17 when the
# machine was busiest). Handed out first and in this order, the longest are never the last
# thing a process starts. A stale entry costs minutes of CI, never a result: keep it roughly
# in step when a file grows past a minute.
LONGEST_FILES = (
    "tests/e2e/test_readme_commands.py",
    "tests/chaos/test_partition.py",
    "tests/e2e/test_model_calls_in_flight.py",
    "tests/e2e/test_rate_limits.py",
    "tests/e2e/test_kill_worker_frameworks.py",
    "tests/e2e/test_console.py",
    "tests/e2e/test_starved_heartbeat.py",
    "tests/e2e/test_kill_worker_frameworks_sdk.py",
    "tests/e2e/test_serving.py",
    "tests/e2e/test_kill_worker.py",
    "tests/e2e/test_versions.py",
    "tests/e2e/test_kill_message_delivery.py",
    "tests/chaos/test_chaos.py",
    "tests/chaos/test_pg_restart.py",
    "tests/e2e/test_schedule_beats.py",
    "tests/e2e/test_kill_worker_mcp.py",
    "tests/integration/test_api_fuzz.py",
    "tests/e2e/test_startup.py",
    "tests/frameworks/test_openai_agents.py",
)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """The longest files first (:data:`LONGEST_FILES`, in its order), then the other files
    holding slow-tier tests (stacks, kills, the fuzzer), then the rest: xdist's loadfile
    hands files out in collection order, and a long file handed out late kept one process
    busy for minutes after the others ran dry. Deterministic, so every xdist process
    collects the same order; a file's tests keep their own order."""
    slow_files = {
        item.path for item in items if any(item.get_closest_marker(t) for t in FULL_ONLY_TIERS)
    }
    rank = {TESTS_ROOT.parent / name: i for i, name in enumerate(LONGEST_FILES)}

    def order(item: pytest.Item) -> tuple[int, bool]:
        return rank.get(item.path, len(rank)), item.path not in slow_files

    items.sort(key=order)


@pytest.fixture(scope="session")
def pg_admin_url() -> Iterator[str]:
    url = os.environ.get("TEST_DATABASE_URL") or os.environ.get("DATABASE_URL")
    if url:
        yield normalize_url(url)
        return
    data_dir = Path(tempfile.mkdtemp(prefix="dar-test-pg-"))
    server = EmbeddedPostgres(data_dir)
    try:
        yield normalize_url(server.start())
    finally:
        server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)  # ~50 MB per session otherwise


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    url = os.environ.get("TEST_REDIS_URL") or os.environ.get("REDIS_URL")
    if url:
        yield _own_redis_db(url)
        return
    server = EmbeddedRedis()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def _flow_state(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(autouse=True)
def _no_learned_flow_limits(request: pytest.FixtureRequest) -> None:
    """Flow control learns each model's limits into Redis (``dar:flow:*``) and keeps them, so
    the limits one test's fake API answered with paced the next test's model calls on the same
    Redis database, in this suite or the next run of it (seen: the 300-calls test paced at 2
    calls a second, 90 s instead of 5, by limits another run's rate-limit test had taught on
    that database). Every test that uses Redis starts with none learned."""
    if "redis_url" not in request.fixturenames:
        return
    client = request.getfixturevalue("_flow_state")
    stale = list(client.scan_iter(match="dar:flow:*", count=1000))
    if stale:
        client.delete(*stale)


def _own_redis_db(url: str) -> str:
    """Under pytest-xdist (``-n``), each worker process takes its own Redis database, as it
    takes its own PostgreSQL one: flow control's learned limits and the concurrency keys live
    in Redis, and one test's rate-limited fake must not throttle another's runs."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return url
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(base + 1 + int(worker[2:])) % 16}"))


def _admin_engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(url, isolation_level="AUTOCOMMIT", poolclass=None)


@pytest.fixture(scope="session")
def test_db(pg_admin_url: str) -> Iterator[str]:
    """One migrated database for the session (per process)."""
    admin = _admin_engine(pg_admin_url)
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)'))
        conn.execute(text(f'CREATE DATABASE "{TEST_DB}"'))
    url = make_url(pg_admin_url).set(database=TEST_DB).render_as_string(hide_password=False)
    engine = make_engine(url, pool_size=1)
    upgrade(engine)
    TicketStore(engine).setup()  # the demo's own tables, apart from the migrations
    engine.dispose()
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{TEST_DB}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def _truncator(test_db: str) -> Iterator[Engine]:
    engine = create_engine(test_db, pool_size=1)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def database_url(test_db: str, _truncator: Engine) -> str:
    """The session's migrated database, emptied for this test: every row deleted and every
    sequence restarted (far faster than a database per test, and just as isolated for tests
    that run one at a time). DELETE, not TRUNCATE: a TRUNCATE of the ten tables makes new
    files for each table and index and took 0.1-0.5 s per test (most of the fast tier's
    time); deleting the few rows a test leaves takes a few milliseconds. The session's role
    sets ``session_replication_role = replica`` for it (a superuser: the test servers are
    ours), which holds back the audit log's append-only trigger and the foreign keys; any
    other role gets the TRUNCATE."""
    with _truncator.begin() as conn:
        conn.execute(text("SET LOCAL lock_timeout = '10s'"))
        if _EMPTYING.superuser is None:
            _EMPTYING.superuser = bool(
                conn.execute(
                    text("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
                ).scalar()
            )
            _EMPTYING.sequences = list(
                conn.execute(
                    text(
                        "SELECT c.oid::regclass::text FROM pg_class c "
                        "JOIN pg_namespace n ON n.oid = c.relnamespace "
                        "WHERE c.relkind = 'S' AND n.nspname = current_schema()"
                    )
                ).scalars()
            )
        if _EMPTYING.superuser:
            conn.execute(text("SET LOCAL session_replication_role = replica"))
            conn.execute(text("; ".join(f"DELETE FROM {t}" for t in _EMPTYING.tables)))
            for seq in _EMPTYING.sequences:
                conn.execute(text("SELECT setval(CAST(:s AS regclass), 1, false)"), {"s": seq})
        else:
            conn.execute(text(f"TRUNCATE {', '.join(_EMPTYING.tables)} RESTART IDENTITY CASCADE"))
    return test_db


class _Emptying:
    """What emptying the test database needs, learned once per session."""

    def __init__(self) -> None:
        every = [*demo_metadata.sorted_tables, *metadata.sorted_tables]
        self.tables = [f'"{t.name}"' for t in reversed(every)]
        self.superuser: bool | None = None
        self.sequences: list[str] = []


_EMPTYING = _Emptying()


@pytest.fixture(scope="session")
def pgbouncer(pg_admin_url: str) -> Iterator[PgBouncer]:
    """A real PgBouncer in transaction mode in front of the test PostgreSQL (one per
    session and process)."""
    with PgBouncer(pg_admin_url) as bouncer:
        yield bouncer


@pytest.fixture
def pooled_database_url(database_url: str, pgbouncer: PgBouncer) -> str:
    """This test's database through PgBouncer in transaction mode (migrated directly)."""
    return pgbouncer.url_for(database_url)


@pytest.fixture
def settings(database_url: str, redis_url: str) -> Settings:
    """Settings for one test: its own database, its own queue, short leases."""
    return replace(
        Settings(),
        database_url=database_url,
        redis_url=redis_url,
        queue=f"dar-test-{uuid.uuid4().hex[:10]}",
        flow_prefix=f"dar-test-flow:{uuid.uuid4().hex[:10]}",
        lease_seconds=5.0,
        heartbeat_seconds=1.0,
        demo_latency_ms=0,
        worker_name="worker-A",
        default_model="claude-sonnet-4-5",  # a priced model (without a key: `demo`, $0)
    )


@pytest.fixture
def llm() -> ScriptedLlm:
    return ScriptedLlm()


@pytest.fixture
def runtime(settings: Settings, llm: ScriptedLlm) -> Iterator[Runtime]:
    rt = Runtime.build(settings, llm=llm, pool_size=5)
    try:
        yield rt
    finally:
        rt.close()


@pytest.fixture
def redis_client(redis_url: str, settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    try:
        yield client
    finally:
        for queue in drive_queues(client, settings.queue):  # DAR_QUEUE and its versions'
            client.delete(queue)
        client.close()
