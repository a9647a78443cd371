"""The durable function of the chaos campaign (``DAR_AGENT_MODULES=tests.chaos.durable_agents``).

``chaos-durable`` does, with ``{"tag": "d003"}`` as input::

    reserve   steps.run, idempotent, compensated by release (idempotent)   effect 'reserve'
    prepare   steps.run, idempotent, nesting:
      note      steps.run, idempotent, compensated by unnote (idempotent)  effect 'note'
      advise    steps.llm, two model calls (child steps advise:0/llm:n)
      stamp     steps.run, NOT idempotent                                   effect 'stamp'
    charge    steps.run, NOT idempotent, compensated by refund (NOT idempotent) effect 'charge'
    ship      steps.approval('chaos_approver').run(...), NOT idempotent    effect 'ship'

Every effect is one row of ``chaos_effect`` (the harness creates it: NO unique constraint, so a
second execution leaves a second row for the checker to see), keyed by the step's key
(``steps.key``; ``compensate:<key>`` for a compensation). An idempotent body dedupes on that
key, as downstream systems do with an idempotency key. A body that is not idempotent dedupes
nothing across executions: if the engine ever ran it twice, two rows would say so. (Within one
execution it retries its own insert through a database outage, recognising its own row by a
per-execution id, so a PostgreSQL restart is not mistaken for a user failure.)

A rejection makes ``ship`` raise ``ApprovalRejected``: the run compensates charge, note and
reserve, each once, and ends FAILED.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

from sqlalchemy import Engine, text
from sqlalchemy.exc import DBAPIError

from db.engine import make_engine
from runtime import AgentRegistry
from runtime.durable import Model, Steps, current_steps, durable_agent, idempotent

AGENT = "chaos-durable"
ROLE = "chaos_approver"
APPROVAL_STEP = "ship"
EFFECTS = {"reserve": True, "note": True, "stamp": False, "charge": False, "ship": False}
"""The steps whose body writes one effect row, and whether each is declared idempotent."""
COMPENSATIONS = {
    "reserve": ("release", True),
    "note": ("unnote", True),
    "charge": ("refund", False),
}
"""Compensated step -> the effect kind its compensation writes, and whether it is idempotent."""

EFFECT_DDL = """
CREATE TABLE IF NOT EXISTS chaos_effect (
    id serial PRIMARY KEY,
    run_id uuid NOT NULL,
    key text NOT NULL,
    kind text NOT NULL,
    execution uuid NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

_engine: Engine | None = None


def _db() -> Engine:
    global _engine
    if _engine is None:
        url = os.environ["DATABASE_URL"]
        _engine = make_engine(url, pool_size=2, application_name="chaos-effects")
    return _engine


def write_effect(run_id: str, key: str, kind: str, *, dedupe_by_key: bool) -> int:
    """One ``chaos_effect`` row for this execution (for every execution with this key when
    ``dedupe_by_key``); retried through a database outage."""
    execution = str(uuid.uuid4())
    params = {"run": run_id, "key": key, "kind": kind, "execution": execution}
    mine = "run_id = :run AND key = :key" if dedupe_by_key else "execution = :execution"
    deadline = time.monotonic() + 60
    while True:
        try:
            with _db().begin() as conn:
                if dedupe_by_key:
                    conn.execute(
                        text("SELECT pg_advisory_xact_lock(hashtextextended(:lock, 0))"),
                        {"lock": f"{run_id}/{key}"},
                    )
                found = conn.execute(
                    text(f"SELECT id FROM chaos_effect WHERE {mine} ORDER BY id LIMIT 1"), params
                ).scalar()
                if found is not None:
                    return int(found)
                return int(
                    conn.execute(
                        text(
                            "INSERT INTO chaos_effect (run_id, key, kind, execution) "
                            "VALUES (:run, :key, :kind, :execution) RETURNING id"
                        ),
                        params,
                    ).scalar_one()
                )
        except DBAPIError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def _here() -> tuple[str, str]:
    steps = current_steps()
    key = steps.key if steps is not None else None
    if steps is None or key is None:
        raise RuntimeError("called outside a step")
    # the checker reads effects by step key: the idempotency key is <run id>/<step key>
    return str(steps.run_id), key.removeprefix(f"{steps.run_id}/")


def _effect(kind: str, *, idempotent_body: bool) -> dict[str, Any]:
    run_id, key = _here()
    row = write_effect(run_id, key, kind, dedupe_by_key=idempotent_body)
    return {"run": run_id, "key": key, "effect": row}


# -- the compensations (module-level: found again from the step rows in any process) --------


@idempotent
def release(done: dict[str, Any]) -> None:
    write_effect(done["run"], "compensate:" + done["key"], "release", dedupe_by_key=True)


@idempotent
def unnote(done: dict[str, Any]) -> None:
    write_effect(done["run"], "compensate:" + done["key"], "unnote", dedupe_by_key=True)


def refund(done: dict[str, Any]) -> None:
    write_effect(done["run"], "compensate:" + done["key"], "refund", dedupe_by_key=False)


# -- the steps -------------------------------------------------------------------------------


def prompt(tag: str, n: int) -> str:
    """What ``advise`` asks the model (the fake answers prompts with "durable step")."""
    return f"[chaos {tag}] durable step advise, question {n}"


def _prepare(tag: str) -> list[str]:
    steps = current_steps()
    assert steps is not None
    steps.run(
        "note",
        lambda: _effect("note", idempotent_body=True),
        type=dict[str, Any],
        idempotent=True,
        compensate=unnote,
    )

    def advise(model: Model) -> list[str]:
        return [model.complete(prompt(tag, 1)), model.complete(prompt(tag, 2))]

    advice = steps.llm("advise", advise, type=list[str])
    steps.run("stamp", lambda: _effect("stamp", idempotent_body=False), type=dict[str, Any])
    return advice


@durable_agent(AGENT, approval_roles=[ROLE])
def chaos_flow(inp: dict[str, Any], steps: Steps) -> dict[str, Any]:
    tag = str(inp["tag"])
    any_dict = dict[str, Any]
    held = steps.run(
        "reserve",
        lambda: _effect("reserve", idempotent_body=True),
        type=any_dict,
        idempotent=True,
        compensate=release,
    )
    advice = steps.run("prepare", _prepare, tag, type=list[str], idempotent=True)
    steps.run(
        "charge",
        lambda: _effect("charge", idempotent_body=False),
        type=any_dict,
        compensate=refund,
    )
    shipped = steps.approval(ROLE, 900).run(
        "ship", lambda _held: _effect("ship", idempotent_body=False), held, type=any_dict
    )
    return {"tag": tag, "advice": advice, "shipped": shipped["effect"]}


def register(registry: AgentRegistry) -> None:
    registry.register(chaos_flow)
