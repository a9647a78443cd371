"""DESIGN rule 9, made mechanical: every record of a run's steps or state made by the code
that drives runs goes through the pipeline (``runtime/pipeline``: the checkpoint ``Task``,
the effect executor, the model-call sequence). A module anywhere else that calls a store
method writing a run's steps or state under a lease (or waking, billing or holding budget
for a run) goes around the one checkpoint, its retries across a database blip, its
recognition of an earlier commit and its fence: this test names it (issue 35, item 2)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from db.store import RunStore

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("runtime", "tasks", "api", "cli")

ALSO_WRITES = frozenset(
    {
        "wake",  # makes a parked run due
        "record_unrecorded_usage",  # bills a run
        "hold_tree_budget",
        "release_tree_budget",
        "cancel_children",
    }
)
"""Store methods that write a run's state without a claim of their own."""


def run_writes() -> frozenset[str]:
    """Every store method that writes a run's steps or state: those fenced by a claim (their
    first parameter), and :data:`ALSO_WRITES`."""
    fenced = set()
    for name, member in vars(RunStore).items():
        if name.startswith("_") or not inspect.isfunction(member):
            continue
        params = list(inspect.signature(member).parameters)
        if len(params) > 1 and params[1] == "claim":
            fenced.add(name)
    return frozenset(fenced | ALSO_WRITES)


def calls_around_the_pipeline(writes: frozenset[str], root: Path = ROOT) -> list[str]:
    """Each call of a ``writes`` method on a store outside ``root/runtime/pipeline``."""
    pipeline = root / "runtime" / "pipeline"
    found = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            if pipeline in path.parents:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in writes
                    and "store" in ast.unparse(node.func.value).lower()
                ):
                    where = path.relative_to(root)
                    found.append(f"{where}:{node.lineno} {ast.unparse(node.func)}(...)")
    return found


def test_the_fenced_writes_are_found() -> None:
    """The rule sees what it guards: the checkpoint's own writes are among them."""
    writes = run_writes()
    assert {"record_steps", "checkpoint_model", "finish", "schedule", "send_signal"} <= writes
    assert {"deliver_message", "consume_signal", "start_children", "park_for_child"} <= writes


def test_only_the_pipeline_writes_a_runs_steps_or_state() -> None:
    assert calls_around_the_pipeline(run_writes()) == []


def test_the_rule_fails_on_a_call_around_the_pipeline(tmp_path: Path) -> None:
    """A mutant: a program recording its own step (as the new kinds' records did before this
    rule) is named; the same call inside the pipeline is not."""
    bypass = "def step(task, row):\n    return task.store.record_steps(task.claim, [row])\n"
    (tmp_path / "runtime" / "agentloop").mkdir(parents=True)
    (tmp_path / "runtime" / "pipeline").mkdir(parents=True)
    (tmp_path / "runtime" / "agentloop" / "loop.py").write_text(bypass)
    (tmp_path / "runtime" / "pipeline" / "checkpoint.py").write_text(bypass)
    found = calls_around_the_pipeline(run_writes(), root=tmp_path)
    assert found == ["runtime/agentloop/loop.py:2 task.store.record_steps(...)"]
