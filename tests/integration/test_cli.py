"""The ``dar`` CLI against a real API server (werkzeug on loopback, real PostgreSQL and
Redis): every call of the REST API, run ids by prefix, one-line errors, help with defaults."""

from __future__ import annotations

import argparse
import threading
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import text
from werkzeug.serving import make_server

from api import create_app
from cli.main import build_parser, main, version
from db.records import Dispatch, NewRun, RunStatus
from examples.order_refund import build as build_refund
from runtime.engine.bootstrap import Runtime
from tasks.celery_app import make_celery
from tests.support import drive_to_end


@pytest.fixture
def api(runtime: Runtime) -> Iterator[str]:
    runtime.tickets.seed()
    runtime.agents.register(build_refund(runtime.tickets))
    app = create_app(runtime=runtime, celery=make_celery(runtime.settings, register=False))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


def dar(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _submit(capsys: pytest.CaptureFixture[str], api: str, *extra: str) -> str:
    code, out, err = dar(capsys, "submit", "Which acme tickets are overdue?", "--api", api, *extra)
    assert code == 0, err
    return out.strip()


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"dar {version()}\n"
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert version() == pyproject["project"]["version"], "one place: pyproject.toml"
    changelog = (Path(__file__).parents[2] / "CHANGELOG.md").read_text()
    assert f"- {version()} " in changelog, "the changelog has an entry for it"


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield sub
                yield from _subparsers(sub)


def test_every_option_has_help_and_shows_its_default() -> None:
    for sub in _subparsers(build_parser()):
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, f"{sub.prog} {action.dest} has no help"
            if action.option_strings and action.default not in (None, False):
                assert f"(default: {action.default})" in text, f"{sub.prog} {action.dest}"


def test_run_ids_by_the_prefix_the_logs_print(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _submit(capsys, api)
    code, out, err = dar(capsys, "timeline", run_id[:8], "--api", api)
    assert (code, err) == (0, "")
    assert out.startswith("SEQ  KIND")
    code, out, _ = dar(capsys, "show", run_id[:8], "--api", api)
    assert code == 0
    assert f'"id": "{run_id}"' in out

    code, _, err = dar(capsys, "show", "ffffffff", "--api", api)
    assert (code, err) == (1, "dar: no run whose id starts with 'ffffffff'\n")
    code, _, err = dar(capsys, "show", "not-hex!", "--api", api)
    assert code == 1
    assert err == "dar: 'not-hex!' is not a run id or a prefix of one (hex characters)\n"


def test_an_ambiguous_prefix_cancels_nothing(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = [_submit(capsys, api) for _ in range(17)]  # 17 ids, 16 hex digits: two share one
    first = next(c for c in "0123456789abcdef" if sum(i.startswith(c) for i in ids) > 1)
    code, _, err = dar(capsys, "cancel", first, "--api", api)
    assert code == 1
    assert err.startswith(f"dar: run id prefix {first!r} is ambiguous (")
    assert err.endswith("); give more of it\n")
    assert all(runtime.store.get_run(uuid.UUID(i)).status is RunStatus.QUEUED for i in ids)


def test_cancel_resume_resolve_and_runs_by_status(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _submit(capsys, api)
    code, out, err = dar(capsys, "cancel", run_id[:8], "--api", api)
    assert (code, err) == (0, "")
    assert out == f"dar: run {run_id} CANCELLED: cancel requested\n"
    assert runtime.store.get_run(uuid.UUID(run_id)).status is RunStatus.CANCELLED

    code, out, _ = dar(capsys, "runs", "--status", "cancelled", "--api", api)
    assert code == 0
    assert run_id in out
    code, out, _ = dar(capsys, "runs", "--status", "succeeded", "--api", api)
    assert run_id not in out

    code, _, err = dar(capsys, "resume", run_id[:8], "--api", api)
    assert code == 1
    assert err.startswith("dar: 409 ")
    assert err.count("\n") == 1
    code, _, err = dar(capsys, "resolve", run_id[:8], "--action", "retry", "--api", api)
    assert code == 1
    assert err.startswith("dar: 409 ")


def test_approvals_approve_and_reject_with_comment_and_hash(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    approvals = []
    for order in (105, 106):
        code, out, err = dar(
            capsys, "submit", "--json", "--agent", "order-refund", "--api", api,
            f'{{"order_id": {order}, "amount": 9.5, "reason": "x"}}',
        )  # fmt: skip
        assert code == 0, err
        run = runtime.store.get_run(uuid.UUID(out.strip()))
        drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))
        (approval,) = runtime.store.list_approvals(run_id=run.id)
        approvals.append(approval)

    code, out, _ = dar(capsys, "approvals", "--api", api)
    assert code == 0
    assert all(str(a.id) in out for a in approvals)

    first, second = approvals
    code, _, err = dar(capsys, "approve", str(first.id)[:8], "--hash", "0" * 64, "--api", api)
    assert code == 1
    assert "payloadHash differs" in err
    code, out, err = dar(
        capsys, "approve", str(first.id)[:8], "--comment", "ok", "--hash", first.payload_hash,
        "--api", api,
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.startswith(f"dar: approval {first.id} APPROVED")
    code, out, err = dar(capsys, "reject", str(second.id), "--comment", "no", "--api", api)
    assert (code, err) == (0, "")
    assert f"dar: approval {second.id} REJECTED" in out
    decided = {a.id: a for a in runtime.store.list_approvals(status=None, role=None, limit=10)}
    assert decided[first.id].comment == "ok"
    assert decided[second.id].comment == "no"


def test_an_unreachable_api_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = dar(capsys, "runs", "--api", "http://127.0.0.1:9")
    assert code == 1
    assert err.startswith("dar: cannot reach the API at http://127.0.0.1:9: ")
    assert err.count("\n") == 1


def test_runs_waiting_shows_what_each_run_waits_for(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    waiting = _submit(capsys, api)
    other = _submit(capsys, api)
    with runtime.engine.begin() as conn:  # test-only SQL: parked on a rate-limit timer
        conn.execute(
            text(
                "UPDATE run SET run_at = now() + interval '30 seconds',"
                " wait_reason = 'rate limit: input tokens/min for claude-x' WHERE id = :id"
            ),
            {"id": uuid.UUID(waiting)},
        )
    code, out, _ = dar(capsys, "submit", "hi", "--key", "acme-co", "--priority", "4", "--api", api)
    assert code == 0
    keyed = out.strip()
    with runtime.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE run SET run_at = now() + interval '30 seconds',"
                " wait_reason = 'concurrency key acme-co: 2 of 2 in steps' WHERE id = :id"
            ),
            {"id": uuid.UUID(keyed)},
        )
    code, out, _ = dar(capsys, "runs", "--waiting", "--api", api)
    assert code == 0
    assert waiting in out
    assert "rate limit: input tokens/min for claude-x" in out
    assert other not in out
    line = next(ln for ln in out.splitlines() if keyed in ln)
    assert "acme-co" in line
    assert " 4 " in line
    assert "concurrency key acme-co: 2 of 2 in steps" in line


def test_dar_ps_names_the_run_each_worker_holds(api: str, runtime: Runtime) -> None:
    from cli.main import _runs_held
    from tests.support import submit

    run, dispatch = submit(runtime.store, agent="acme-tickets")
    submit(runtime.store, agent="acme-tickets")  # queued, held by no one
    assert runtime.store.claim(run.id, dispatch.token, "worker-B", 30.0) is not None
    assert _runs_held(api) == {"worker-B": [str(run.id)[:8]]}
    assert _runs_held("http://127.0.0.1:9") == {}, "no API: the column stays empty"


def test_schedules_add_list_and_delete(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = dar(
        capsys, "schedules", "add", "0 9 * * 1-5", "Which acme tickets are overdue?",
        "--timezone", "Europe/Paris", "--overlap", "queue", "--api", api,
    )  # fmt: skip
    assert code == 0, err
    schedule_id = out.strip()
    assert runtime.store.get_schedule(uuid.UUID(schedule_id)) is not None
    code, out, _ = dar(capsys, "schedules", "--api", api)
    assert code == 0
    assert schedule_id in out
    assert "Europe/Paris" in out
    assert "queue" in out
    code, _, err = dar(capsys, "schedules", "add", "every day", "hi", "--api", api)
    assert code == 1
    assert "cron" in err
    code, out, _ = dar(capsys, "schedules", "--api", api, "delete", schedule_id)
    assert code == 0
    assert runtime.store.get_schedule(uuid.UUID(schedule_id)) is None


def test_dar_send_posts_a_message_through_the_client(
    api: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run_id = _submit(capsys, api)
    code, out, err = dar(capsys, "send", run_id[:8], "Only the urgent ones.", "--api", api)
    assert (code, err) == (0, "")
    assert out.startswith("dar: message ")
    assert f"for run {run_id} (QUEUED): delivered at its next step boundary" in out
    code, out, err = dar(capsys, "send", "--policy", "interrupt", run_id[:8], "Stop.", "--api", api)
    assert (code, err) == (0, "")
    assert out.endswith("the model call in flight, if any, is interrupted and made again with it\n")


def test_dar_tree_prints_every_level_from_the_root(
    api: str, runtime: Runtime, capsys: pytest.CaptureFixture[str]
) -> None:
    def add(parent: uuid.UUID | None, agent: str) -> uuid.UUID:
        new = NewRun(agent, "x", "demo", 10, 1000, 60, parent_run_id=parent)
        return runtime.store.create_run(new)[0].id

    root = add(None, "boss")
    middle = add(root, "lead")
    leaf = add(middle, "worker")
    code, out, err = dar(capsys, "tree", str(leaf)[:8], "--api", api)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["RUN", "AGENT", "STATUS"]
    assert [line.split()[:2] for line in lines[1:]] == [
        [str(root)[:8], "boss"],
        [str(middle)[:8], "lead"],
        [str(leaf)[:8], "worker"],
    ]
    assert [len(line) - len(line.lstrip()) for line in lines[1:]] == [0, 2, 4], "by level"
    assert lines[3].endswith("<- this run")
