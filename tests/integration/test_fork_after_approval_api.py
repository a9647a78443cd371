"""The review's reproduction through the API: ``examples/ticket_triage.py``'s approval covers
``propose`` and ``apply`` comments on the ticket after it. A submit-only token's fork from
``apply`` used to comment again on the original's decision (3 forks, 3 comments); it asks the
support lead again, and only a token holding ``approve`` and ``support_lead`` may keep the
decision with ``reuseApprovals``."""

from __future__ import annotations

import uuid
from dataclasses import replace

from flask.testing import FlaskClient

from api import create_app
from api.auth import hash_token
from db.records import Dispatch, RunStatus
from examples.ticket_triage import build as build_triage
from runtime.config import Settings
from runtime.engine.bootstrap import Runtime
from runtime.llm.scripted import ScriptedLlm
from tasks.celery_app import make_celery
from tests.support import drive_to_end

TOKENS = {
    "ci": ("read+submit", "tok-ci"),
    "lead": ("read+submit+approve+support_lead", "tok-lead"),
}
TICKET = {"id": 101, "subject": "Invoice wrong", "body": "VAT is 19%, should be 7%"}


def _h(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name][1]}"}


def _drive(runtime: Runtime, run_id: str) -> None:
    run = runtime.store.get_run(uuid.UUID(run_id))
    drive_to_end(runtime.driver(), Dispatch(run.id, run.dispatch_token))


def test_forks_after_the_triage_approval_comment_only_when_a_lead_decides(
    runtime: Runtime, settings: Settings, llm: ScriptedLlm
) -> None:
    llm.then_text("not JSON: the example classifies by keywords")
    runtime.tickets.seed()
    runtime.agents.register(build_triage(runtime.tickets))
    env = ",".join(f"{n}:{r}:{hash_token(t)}:acme" for n, (r, t) in TOKENS.items())
    runtime.settings = replace(settings, api_tokens=env)
    client: FlaskClient = create_app(
        runtime=runtime, celery=make_celery(runtime.settings, register=False)
    ).test_client()
    made = client.post(
        "/api/runs", json={"agent": "ticket-triage", "input": TICKET}, headers=_h("ci")
    )
    run_id = made.get_json()["id"]
    _drive(runtime, run_id)
    (approval,) = client.get(f"/api/approvals?runId={run_id}", headers=_h("lead")).get_json()[
        "items"
    ]
    assert (
        client.post(f"/api/approvals/{approval['id']}/approve", headers=_h("lead")).status_code
        == 200
    )
    _drive(runtime, run_id)
    assert runtime.store.get_run(uuid.UUID(run_id)).status is RunStatus.SUCCEEDED
    comments = runtime.tickets.count_comments(101)
    steps = client.get(f"/api/runs/{run_id}/timeline", headers=_h("ci")).get_json()
    apply_seq = next(s["seq"] for s in steps if (s["stepKey"] or "").startswith("apply"))

    for _ in range(3):
        fork = client.post(
            f"/api/runs/{run_id}/fork", json={"fromSeq": apply_seq}, headers=_h("ci")
        )
        assert fork.status_code == 201, fork.get_json()
        _drive(runtime, fork.get_json()["id"])
        assert runtime.store.get_run(uuid.UUID(fork.get_json()["id"])).status is RunStatus.WAITING
    assert runtime.tickets.count_comments(101) == comments, "no fork commented on the decision"

    refused = client.post(
        f"/api/runs/{run_id}/fork",
        json={"fromSeq": apply_seq, "reuseApprovals": True},
        headers=_h("ci"),
    )
    assert refused.status_code == 403, refused.get_json()
    kept = client.post(
        f"/api/runs/{run_id}/fork",
        json={"fromSeq": apply_seq, "reuseApprovals": True},
        headers=_h("lead"),
    )
    assert kept.status_code == 201, kept.get_json()
    _drive(runtime, kept.get_json()["id"])
    assert runtime.store.get_run(uuid.UUID(kept.get_json()["id"])).status is RunStatus.SUCCEEDED
    assert runtime.tickets.count_comments(101) == comments + 1, "the lead's explicit reuse"
