"""``/api/runs/{id}/fork`` and ``/api/runs/{a}/diff/{b}``: rerun a run from any step with
edits, and compare two runs step by step."""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Response, jsonify, request, url_for

from api.auth import current_principal, requires
from api.errors import ApiError
from api.runs import (
    audit,
    check_run_limits,
    key_reused,
    load_run,
    parse_run_id,
    rate_limited,
    submit_quota,
)
from api.schemas import fork_schema, validate
from api.serialize import forked_from_json
from api.state import state
from api.validation import idempotency_key, json_body, request_hash, whole
from db.errors import IdempotencyConflict, InvalidTransition, QuotaExceeded, RunNotFound
from db.records import ApprovalStatus, Dispatch, Run, Step, StepKind, StepStatus
from runtime.agents import Agent
from runtime.engine.fork import ForkRefused, ForkRequest, fork_run
from tasks.dispatch import send_drive

bp = Blueprint("forks", __name__)


@bp.post("/runs/<run_id>/fork")
@requires("submit")
def fork(run_id: str) -> tuple[Response, int, dict[str, str]]:
    """A new run whose history is the run's steps before ``fromSeq`` (copied, with the
    edits), continuing from ``fromSeq``. In the run's tenant; needs ``submit``. With an
    ``Idempotency-Key`` a retry gets the same fork (``200``), as a submit does."""
    s = state()
    settings = s.runtime.settings
    agents = s.runtime.agents
    rid = parse_run_id(run_id)
    body = json_body(request, limit_input=settings.max_input_chars)
    durable = any(not isinstance(agents.get(n), Agent) for n in agents.names())
    validate(body, fork_schema(settings, any_json_input=durable))
    source = load_run(rid)  # another tenant's run is no run
    reuse = bool(body.get("reuseApprovals", False))
    if reuse:
        _may_reuse_approval(source, int(body["fromSeq"]))
    # A fork is a resume from an earlier step: the same limits (a larger budget needs admin).
    check_run_limits(
        source, whole(body.get("tokenBudget")), whole(body.get("timeoutSeconds")), "forking"
    )
    key = idempotency_key(request)
    edit = body.get("toolResult")
    principal = current_principal()
    edits = [k for k in ("input", "model", "toolResult") if body.get(k) is not None]
    fork_request = ForkRequest(
        from_seq=int(body["fromSeq"]),
        model=body.get("model") or None,
        tool_result=(int(edit["seq"]), edit["output"]) if edit else None,
        token_budget=whole(body.get("tokenBudget")),
        timeout_seconds=whole(body.get("timeoutSeconds")),
        replay_model=bool(body.get("replayModel", False)),
        submitted_by=principal.name if principal else None,
        audit=audit(
            "fork",
            {
                "fromSeq": int(body["fromSeq"]),
                "edits": edits,
                "replayModel": bool(body.get("replayModel", False)),
                **({"reuseApprovals": True} if reuse else {}),
            },
        ),
        quota=submit_quota(settings) if principal is not None else None,
        idempotency_key=key,
        # The run forked is part of the request: the same body for another run is another.
        request_hash=request_hash({"fork": str(rid), "body": body}) if key else None,
        reuse_approval=reuse,
        **({"input": body["input"]} if "input" in body else {}),
    )
    try:
        run, created = fork_run(s.runtime.store, agents, settings, rid, fork_request)
    except ForkRefused as e:
        raise ApiError(
            409 if e.conflict else 400,
            str(e),
            code="fork_refused" if e.conflict else "invalid_field",
            field=e.field,
        ) from None
    except QuotaExceeded as e:
        raise rate_limited(e) from None
    except IdempotencyConflict as e:
        raise key_reused(e) from None
    except RunNotFound as e:
        raise ApiError(404, str(e), code="not_found") from None
    except InvalidTransition as e:
        raise ApiError(409, str(e), code="fork_refused", field="reuseApprovals") from None
    if created:
        dispatch = Dispatch(run.id, run.dispatch_token)
        send_drive(s.celery, s.runtime.store, dispatch, deployment=run.deployment)
    return (
        jsonify(
            {"id": str(run.id), "status": str(run.status), "forkedFrom": forked_from_json(run)}
        ),
        201 if created else 200,
        {"Location": url_for("runs.get_run", run_id=str(run.id))},
    )


def _may_reuse_approval(run: Run, from_seq: int) -> None:
    """``reuseApprovals``: keep the run's decisions for the fork. A decision authorises its
    effects once, so without it a fork asks again for every approval it copies or starts at;
    with it, the approvals the source approved at ``fromSeq`` and before (whose decided steps
    the fork copies) stand. Reusing a decision is deciding: the forker needs ``approve`` and
    each such approval's role (``admin`` implies ``approve``, never an approval role). 409
    when there is no approved approval to reuse, 403 for a missing role."""
    store = state().runtime.store
    seqs = {st.step_key: st for st in store.steps(run.id) if st.kind is StepKind.APPROVAL}
    reusable = [
        a
        for a in store.list_approvals(status=None, run_id=run.id)
        if a.status is ApprovalStatus.APPROVED
        and (step := seqs.get(a.step_key)) is not None
        and (step.seq == from_seq or (step.seq < from_seq and step.status is StepStatus.DONE))
    ]
    if not reusable:
        raise ApiError(
            409,
            f"reuseApprovals: run {run.id} has no approved approval at step {from_seq} or "
            "before it (whose action completed): there is no decision to reuse",
            code="fork_refused",
            field="reuseApprovals",
        )
    principal = current_principal()
    if principal is None:
        return
    for approval in reusable:
        if not principal.holds(approval.role):
            raise ApiError(
                403,
                f"reuseApprovals: token {principal.name!r} lacks the role {approval.role!r} "
                f"of the approval {approval.step_key} it would reuse (admin does not imply "
                "it); fork without it and the fork asks again",
                code="forbidden",
                field="reuseApprovals",
            )
    if not principal.has("approve"):
        raise ApiError(
            403,
            f"reuseApprovals: token {principal.name!r} lacks the role 'approve': reusing a "
            "decision is deciding; fork without it and the fork asks again",
            code="forbidden",
            field="reuseApprovals",
        )


@bp.get("/runs/<run_id>/diff/<other_id>")
@requires("read")
def diff(run_id: str, other_id: str) -> Response:
    """Where two runs (a fork and its original, typically) differ, step by step."""
    a = load_run(parse_run_id(run_id))
    b = load_run(parse_run_id(other_id))
    store = state().runtime.store
    return jsonify(diff_json(a, store.steps(a.id), b, store.steps(b.id)))


# -- the diff ---------------------------------------------------------------------------------

COMPARED = (
    "kind",
    "stepKey",
    "status",
    "toolName",
    "input",
    "output",
    "error",
    "tokens",
    "costUsd",
)
"""The fields of a step that make two runs differ there. Tokens and cost are what the step's
model call used, by whichever run executed it: a copied or replayed step equals its original;
what each run was billed is shown apart (``billedTokens``, ``billedCostUsd``)."""


def _tool_inputs(steps: list[Step]) -> dict[str, Any]:
    """The arguments the model gave each tool call, by tool_use id."""
    out: dict[str, Any] = {}
    for s in steps:
        if s.kind is StepKind.MODEL and isinstance(s.response, list):
            for block in s.response:
                if isinstance(block, dict) and block.get("type") == "tool_use":
                    out[str(block.get("id"))] = block.get("input")
    return out


def _side(step: Step, tool_inputs: dict[str, Any]) -> dict[str, Any]:
    if step.kind in (StepKind.MODEL, StepKind.LLM):
        step_input: Any = {"promptHash": step.prompt_hash} if step.prompt_hash else None
    elif step.kind is StepKind.TOOL:
        step_input = tool_inputs.get(step.tool_use_id or "")
    else:
        step_input = {"inputHash": step.input_hash} if step.input_hash else None
    billed = step.usage.total
    tokens = billed + (step.original_tokens or 0)
    cost = step.cost_usd + (step.original_cost_usd or 0)
    return {
        "seq": step.seq,
        "kind": str(step.kind),
        "stepKey": step.step_key,
        "status": str(step.status),
        "toolName": step.tool_name,
        "input": step_input,
        "output": step.response,
        "error": step.error,
        "tokens": tokens,
        "costUsd": float(cost),
        "billedTokens": billed,
        "billedCostUsd": float(step.cost_usd),
        "origin": str(step.origin) if step.origin else None,
    }


def _summary(run: Run) -> dict[str, Any]:
    return {
        "id": str(run.id),
        "agent": run.agent,
        "status": str(run.status),
        "input": run.input,
        "model": run.model,
        "result": run.result,
        "error": run.error,
        "tokensUsed": run.tokens_used,
        "costUsd": float(run.cost_usd),
        "forkedFrom": forked_from_json(run),
    }


def diff_json(a: Run, steps_a: list[Step], b: Run, steps_b: list[Step]) -> dict[str, Any]:
    """Both runs, the run-level fields that differ, the first seq where their steps differ
    (``None``: the same steps), and every seq side by side."""
    inputs_a, inputs_b = _tool_inputs(steps_a), _tool_inputs(steps_b)
    by_seq_a = {s.seq: _side(s, inputs_a) for s in steps_a}
    by_seq_b = {s.seq: _side(s, inputs_b) for s in steps_b}
    rows: list[dict[str, Any]] = []
    first: int | None = None
    for seq in sorted(by_seq_a.keys() | by_seq_b.keys()):
        left, right = by_seq_a.get(seq), by_seq_b.get(seq)
        if left is None or right is None:
            differences = ["missing in a" if left is None else "missing in b"]
        else:
            differences = [f for f in COMPARED if left[f] != right[f]]
        if differences and first is None:
            first = seq
        rows.append(
            {"seq": seq, "same": not differences, "differences": differences, "a": left, "b": right}
        )
    summary_a, summary_b = _summary(a), _summary(b)
    return {
        "a": summary_a,
        "b": summary_b,
        "runDifferences": [
            f
            for f in ("agent", "input", "model", "status", "result")
            if summary_a[f] != summary_b[f]
        ],
        "firstDifferentSeq": first,
        "steps": rows,
    }
