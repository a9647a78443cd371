"""The lines `dar demo` prints per timeline entry: never a ``None``."""

from __future__ import annotations

from typing import Any

from cli.main import _step_line

STEP: dict[str, Any] = {
    "seq": 1,
    "stepKey": "model:1",
    "kind": "MODEL",
    "status": "DONE",
    "toolName": None,
    "stopReason": "tool_use",
    "inputTokens": 230,
    "outputTokens": 43,
    "latencyMs": 3000,
    "worker": "worker-A",
}


def test_a_step_line_names_seq_kind_tokens_latency_and_worker() -> None:
    assert _step_line(STEP) == "seq=1 MODEL tool_use DONE in=230 out=43 3000ms (worker-A)"


def test_a_step_recorded_by_no_worker_has_no_empty_parentheses() -> None:
    step = {**STEP, "kind": "APPROVAL", "stopReason": None, "stepKey": "approve:1",
            "latencyMs": None, "worker": None}  # fmt: skip
    assert _step_line(step) == "seq=1 APPROVAL approve:1 DONE"


def test_an_audit_entry_has_no_seq_and_says_who_did_what() -> None:
    audit = {**STEP, "seq": None, "kind": "AUDIT", "stepKey": "audit:approve", "worker": None,
             "action": "approve", "actor": "dar demo", "detail": {"comment": "ok"}}  # fmt: skip
    line = _step_line(audit)
    assert line == 'AUDIT approve by dar demo: {"comment":"ok"}'
    assert "None" not in line


def test_the_timeline_table_shows_an_audit_entry_as_what_and_by_whom() -> None:
    from cli.main import _timeline_table

    audit = {**STEP, "seq": None, "kind": "AUDIT", "stepKey": "audit:recovery.resumed",
             "action": "recovery.resumed", "actor": "worker-B", "worker": None}  # fmt: skip
    rows = _timeline_table([STEP, audit]).splitlines()
    assert rows[2].split() == ["AUDIT", "DONE", "recovery.resumed", "worker-B"]
    assert "None" not in rows[2]
