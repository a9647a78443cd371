"""End to end, real processes: two Celery beats run one schedule that ticks every second.
Each tick starts exactly one run (the unique tick row in PostgreSQL decides), none is missed,
and a beat killed with SIGKILL and started again starts no tick twice."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from db.engine import make_engine
from db.records import NewSchedule
from db.store import RunStore
from runtime.config import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SECONDS = float(os.environ.get("DAR_TEST_SCHEDULE_SECONDS", "30"))


class Beats:
    def __init__(self, env: dict[str, str], tmp: Path) -> None:
        self.env = env
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        with (self.tmp / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "celery", "--quiet", "-A", "tasks.app", "beat",
                 "--schedule", str(self.tmp / f"{name}-schedule"), "--loglevel", "INFO"],
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")


@pytest.fixture
def beats(database_url: str, redis_url: str, settings: Settings, tmp_path: Path) -> Iterator[Beats]:
    env = {
        **os.environ,
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "DAR_QUEUE": settings.queue,  # no worker: the runs stay QUEUED, counted as they are
        "DAR_SCHEDULE_POLL_SECONDS": "0.3",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    b = Beats(env, tmp_path)
    try:
        yield b
    finally:
        b.stop()
        for name in b.procs:
            print(f"--- {name}\n{b.log(name)[-4000:]}")


def test_two_beats_start_exactly_one_run_per_tick(database_url: str, beats: Beats) -> None:
    engine = make_engine(database_url, pool_size=2)
    store = RunStore(engine)
    try:
        schedule = store.create_schedule(
            NewSchedule(
                agent="acme-tickets",
                input="Which acme tickets are overdue?",
                model="claude-sonnet-4-5",
                max_steps=10,
                token_budget=10_000,
                timeout_seconds=600,
                cron="* * * * * *",
                timezone="UTC",
                overlap="allow",
                catch_up="none",
                first_tick_at=datetime.now(UTC),
            )
        )
        beats.start("beat-1")
        beats.start("beat-2")
        began = time.monotonic()
        killed = False
        while time.monotonic() - began < SECONDS:
            time.sleep(0.5)
            for name, proc in beats.procs.items():
                assert proc.poll() is None, f"{name} exited:\n{beats.log(name)[-3000:]}"
            if not killed and time.monotonic() - began > SECONDS / 2:
                beats.kill("beat-1")  # SIGKILL mid-life, then back: nothing twice
                beats.start("beat-1")
                killed = True
        beats.stop()

        with engine.connect() as conn:
            ticks = conn.execute(
                text(
                    "SELECT tick_at, status, run_id FROM schedule_tick "
                    "WHERE schedule_id = :id ORDER BY tick_at"
                ),
                {"id": schedule.id},
            ).all()
            runs = conn.execute(
                text("SELECT id, created_at FROM run WHERE schedule_id = :id"),
                {"id": schedule.id},
            ).all()
        run_ids = {r.id for r in runs}
        assert len(ticks) >= SECONDS * 0.6, f"only {len(ticks)} ticks in {SECONDS:.0f}s"
        assert all(t.status == "STARTED" for t in ticks)
        assert len(runs) == len(ticks), "exactly one run per tick"
        assert {t.run_id for t in ticks} == run_ids
        seconds = [t.tick_at for t in ticks]
        gaps = [b - a for a, b in itertools.pairwise(seconds)]
        assert all(g.total_seconds() == 1 for g in gaps), (
            "no tick missed between the first and last"
        )
        lag = sorted(
            (r.created_at - t.tick_at).total_seconds()
            for r, t in zip(sorted(runs, key=lambda r: r.created_at), ticks, strict=True)
        )
        print(
            f"{len(ticks)} ticks, {len(runs)} runs; tick-to-run lag median "
            f"{lag[len(lag) // 2]:.2f}s, max {lag[-1]:.2f}s"
        )
        started = [n for n in ("beat-1", "beat-2") if "started by its schedule" in beats.log(n)]
        print(f"beats that started runs: {started}")
    finally:
        engine.dispose()
