"""The retention sweep deletes old finished runs in batches and never touches live ones."""

from __future__ import annotations

from dataclasses import replace

from sqlalchemy import text

from db.errors import RunNotFound
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import RETENTION, make_celery
from tasks.drive import stop_worker_state
from tests.support import drive_to_end, register_agent, submit


def test_old_finished_runs_go_and_live_ones_stay(settings: Settings, llm: ScriptedLlm) -> None:
    local = replace(settings, retention_days=7, retention_batch=2)
    rt = Runtime.build(local, llm=llm)
    app = make_celery(local)
    app.dar_runtime = rt
    try:
        register_agent(rt.agents)
        old = []
        for _ in range(5):
            llm.then_text("done")
            run, dispatch = submit(rt.store)
            drive_to_end(rt.driver(), dispatch)
            old.append(run.id)
        llm.then_text("done")
        recent, dispatch = submit(rt.store)
        drive_to_end(rt.driver(), dispatch)
        queued, _ = submit(rt.store)
        running, d = submit(rt.store)
        assert rt.store.claim(running.id, d.token, "w", 60) is not None
        with rt.engine.begin() as conn:
            conn.execute(
                text("UPDATE run SET finished_at = now() - interval '8 days' WHERE id = ANY(:ids)"),
                {"ids": old},
            )
            # A live run that is old must stay, whatever its age.
            conn.execute(
                text("UPDATE run SET created_at = now() - interval '30 days' WHERE id = :id"),
                {"id": queued.id},
            )

        assert app.tasks[RETENTION].run() == 5, "all five, in batches of two"
        for run_id in old:
            try:
                rt.store.get_run(run_id)
            except RunNotFound:
                continue
            raise AssertionError(f"{run_id} should be gone")
        for run_id in (recent.id, queued.id, running.id):
            rt.store.get_run(run_id)
        with rt.engine.connect() as conn:
            orphans = conn.execute(
                text("SELECT count(*) FROM run_step WHERE run_id = ANY(:ids)"), {"ids": old}
            ).scalar_one()
        assert orphans == 0, "their steps went with them"
        assert app.tasks[RETENTION].run() == 0
    finally:
        stop_worker_state(app)
        rt.close()


def test_retention_zero_keeps_everything(settings: Settings, llm: ScriptedLlm) -> None:
    local = replace(settings, retention_days=0)
    rt = Runtime.build(local, llm=llm)
    app = make_celery(local)
    app.dar_runtime = rt
    try:
        register_agent(rt.agents)
        llm.then_text("done")
        run, dispatch = submit(rt.store)
        drive_to_end(rt.driver(), dispatch)
        with rt.engine.begin() as conn:
            conn.execute(text("UPDATE run SET finished_at = now() - interval '999 days'"))
        assert app.tasks[RETENTION].run() == 0
        rt.store.get_run(run.id)
    finally:
        stop_worker_state(app)
        rt.close()
