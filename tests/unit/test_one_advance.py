"""Issue 35, item 1, made mechanical: no ``if kind == ...`` outside the kinds, and the agent
loop runs its steps only in its kinds, through the one advance. What differs per kind of step
is said by the kinds table (``runtime/pipeline/kinds.py``) and the kind objects
(``runtime/durable/simple.py``, ``container.py``, ``approval.py``, ``billed.py``,
``child.py``; the agent loop's ``ModelTurn``, ``ToolCall``, ``Message``, ``StartSubagents``,
``CollectSubagent`` and ``ListToolset`` in ``runtime/agentloop/loop.py``) that the one advance
(``runtime.pipeline.checkpoint.Program.advance``) drives; code anywhere else in the programs,
the engine, the pipeline and the test kit that compares a step's kind to a member
(``StepKind.X``, ``kinds.StepKind.X``, a row kind) or to a kind's name (``"TOOL"``), or
matches on one, decides per kind on its own: this test names it.
A use that must stay is allow-listed below with its reason."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

from db.records import StepKind as RowKind
from runtime.pipeline.kinds import StepKind

ROOT = Path(__file__).resolve().parents[2]
SCANNED = (
    "runtime/durable",
    "runtime/agentloop",
    "runtime/frameworks",
    "runtime/engine",
    "runtime/pipeline",
    "runtime/testing",
)
KINDS_THEMSELVES = frozenset(
    {
        "runtime/pipeline/kinds.py",
        "runtime/durable/simple.py",
        "runtime/durable/container.py",
        "runtime/durable/approval.py",
        "runtime/durable/billed.py",
        "runtime/durable/child.py",
    }
)
ALLOWED: dict[str, str] = {
    "runtime/engine/fork.py:s.kind is StepKind.CHILD": "the refusal of an edit names the "
    "child run a recorded step waits for: operator tooling reading a row, not a step's run",
    "runtime/engine/fork.py:target.kind is StepKind.TOOL": "an edited tool output is capped "
    "as the tool's own output was when the row was written (its row format)",
    "runtime/engine/replaycheck.py:s.kind is RowKind.TOOL": "the free replay check compares "
    "the tools a recorded agent-loop history used with those offered now, from row formats",
    "runtime/engine/replaycheck.py:s.kind is RowKind.MODEL": "as above: the tools a recorded "
    "model answer asked for",
    "runtime/pipeline/modelcall.py:kind is kinds.StepKind.MODEL": "a log line's format: the "
    "agent loop's model step keeps the one the docs show (`seq=… MODEL stop=…`), other "
    "model calls add their key",
    "runtime/testing/testkit.py:self.s.kind is not StepKind.APPROVAL": "the test kit's "
    "`was_approved` asserts what a named step's row is: a test reading a row, not a step's run",
}
"""``path:comparison`` -> why it stays."""

ENUMS = frozenset({"StepKind", "RowKind"})
NAMES = frozenset({k.value for k in StepKind} | {k.value for k in RowKind})


def _names_a_kind(node: ast.expr) -> bool:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id in ENUMS
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
        return node.value.attr in ENUMS  # through its module: ``kinds.StepKind.MODEL``
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_kind(e) for e in node.elts)
    return False


def _a_kinds_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_a_kinds_name(e) for e in node.elts)
    return False


def dispatches(source: str) -> list[tuple[int, str]]:
    """Each comparison of a step kind (or ``match`` case) in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            parts = [node.left, *node.comparators]
            text = ast.unparse(node)
            by_name = any(_a_kinds_name(p) for p in parts) and "kind" in text.lower()
            if by_name or any(_names_a_kind(p) for p in parts):
                found.append((node.lineno, text))
        elif isinstance(node, ast.match_case):
            for sub in ast.walk(node.pattern):
                if isinstance(sub, ast.MatchValue) and (
                    _names_a_kind(sub.value) or _a_kinds_name(sub.value)
                ):
                    found.append((node.pattern.lineno, f"case {ast.unparse(node.pattern)}"))
    return sorted(found)


def dispatch_outside_the_kinds(root: Path = ROOT) -> list[str]:
    out = []
    for folder in SCANNED:
        for path in sorted((root / folder).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            if where in KINDS_THEMSELVES:
                continue
            for line, text in dispatches(path.read_text(encoding="utf-8")):
                if f"{where}:{text}" not in ALLOWED:
                    out.append(f"{where}:{line} {text}")
    return out


def test_no_dispatch_on_a_step_kind_outside_the_kinds() -> None:
    assert dispatch_outside_the_kinds() == []


def test_every_allowed_use_is_still_there() -> None:
    """An allow-list entry whose code went is dropped, not kept as a licence."""
    present = set()
    for key in ALLOWED:
        path, text = key.split(":", 1)
        if any(t == text for _, t in dispatches((ROOT / path).read_text(encoding="utf-8"))):
            present.add(key)
    assert present == set(ALLOWED)


def test_the_rule_names_each_form_of_dispatch(tmp_path: Path) -> None:
    """Mutants: a program deciding per kind by member, by name, or by ``match`` is named;
    the same code inside a kind object is not."""
    program = (
        "def f(step, kind):\n"
        "    if step.kind is StepKind.TOOL:\n"
        "        return 1\n"
        "    if kind == 'SLEEP':\n"
        "        return 2\n"
        "    if step.kind in (RowKind.MODEL, RowKind.LLM):\n"
        "        return 3\n"
        "    match step.kind:\n"
        "        case StepKind.CHILD:\n"
        "            return 4\n"
        "    if kind is kinds.StepKind.MODEL:\n"
        "        return 5\n"
        "    return step.name == 'TOOL'\n"  # not a kind: a plain name
    )
    for folder in ("runtime/agentloop", "runtime/durable", "runtime/pipeline", "runtime/testing"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "runtime/agentloop/bypass.py").write_text(program)
    (tmp_path / "runtime/durable/container.py").write_text(program)
    (tmp_path / "runtime/pipeline/kinds.py").write_text(program)
    (tmp_path / "runtime/pipeline/checkpoint.py").write_text(program)
    (tmp_path / "runtime/testing/testkit.py").write_text(program)
    found = dispatch_outside_the_kinds(tmp_path)
    lines = ["2", "4", "6", "9", "11"]
    assert [f.split(" ", 1)[0] for f in found] == [
        *(f"runtime/agentloop/bypass.py:{n}" for n in lines),
        *(f"runtime/pipeline/checkpoint.py:{n}" for n in lines),
        *(f"runtime/testing/testkit.py:{n}" for n in lines),
    ]


# -- the agent loop runs a step only in a kind, through the advance ---------------------------

LOOP = "runtime/agentloop"
RUNS_A_STEP = frozenset(
    {
        ("effects", "run_effect"),
        ("modelcall", "call"),
        ("mcpcall", "list_toolset"),
        ("task", "checkpoint"),
        ("task", "deliver_message"),
        ("task", "start_children"),
        ("task", "park_for_child"),
    }
)
"""``effects.run_effect`` (a step with an effect), ``modelcall.call`` (a model call), the
MCP tool set's listing, a step's record (the advance records what a kind gives it), a
message's delivery (a step recorded as the message is consumed), sub-agents started or
waited for."""


def steps_run_outside_a_kind(root: Path = ROOT) -> list[str]:
    """Each call in the agent loop that runs a step (the step executor, the model call)
    anywhere but in a kind object's ``run``: a step the advance does not drive (no look-up,
    no record through it)."""
    out = []
    for path in sorted((root / LOOP).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside: set[int] = set()
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "run":
                    inside |= {id(n) for n in ast.walk(fn)}
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in RUNS_A_STEP
                and id(node) not in inside
            ):
                where = path.relative_to(root).as_posix()
                out.append(f"{where}:{node.lineno} {ast.unparse(node.func)}")
    return out


def test_the_agent_loop_runs_its_steps_only_in_its_kinds() -> None:
    assert steps_run_outside_a_kind() == []
    source = (ROOT / LOOP / "loop.py").read_text(encoding="utf-8")
    assert ".advance(ModelTurn(" in source
    assert ".advance(ToolCall(" in source
    assert ".advance(Message." in source
    assert ".advance(StartSubagents(" in source
    assert ".advance(CollectSubagent(" in source
    assert ".advance(ListToolset(" in source


def test_the_loop_rule_names_a_step_run_around_the_advance(tmp_path: Path) -> None:
    """A mutant: the loop calling the model, the step executor or a message's delivery from a
    plain function (as ``_model_step``, ``_tool_step`` and ``_deliver_message`` did) is
    named; the same call in a kind's run is not."""
    (tmp_path / LOOP).mkdir(parents=True)
    (tmp_path / LOOP / "loop.py").write_text(
        "def _model_step(task, request):\n"
        "    return modelcall.call(task, request)\n"
        "class ModelTurn:\n"
        "    def run(self, at):\n"
        "        return modelcall.call(at.task, self.request)\n"
        "def _tool_step(task, effect, found):\n"
        "    return effects.run_effect(task, effect, found)\n"
        "def _deliver_message(task, row):\n"
        "    return task.deliver_message(row)\n"
    )
    assert steps_run_outside_a_kind(tmp_path) == [
        "runtime/agentloop/loop.py:2 modelcall.call",
        "runtime/agentloop/loop.py:7 effects.run_effect",
        "runtime/agentloop/loop.py:9 task.deliver_message",
    ]


# -- every model call's record is committed by the advance ------------------------------------

OUTSIDE_THE_PIPELINE = ("runtime", "tasks", "api", "cli")
MODEL_RECORD_WRITES = frozenset({"record_billed", "record_failed", "record_replayed"})
"""The writes of a model call's record (``modelcall.record_billed``, ``record_failed``,
``Task.record_replayed``): a kind hands one to the advance uncalled, as a ``Record``'s
``write`` (``modelcall.Made.write`` is one of them, bound)."""


def model_records_written_around_the_advance(root: Path = ROOT) -> list[str]:
    """Each place outside ``runtime/pipeline`` that writes a model call's record itself instead
    of giving it to the advance: a call of one of :data:`MODEL_RECORD_WRITES`, a call of a
    ``Made``'s ``write`` (``.write()`` with no argument: a file's takes one), or
    ``modelcall.call`` asked to record (a ``record`` keyword, the option that was removed)."""
    pipeline = root / "runtime" / "pipeline"
    out = []
    for folder in OUTSIDE_THE_PIPELINE:
        for path in sorted((root / folder).rglob("*.py")):
            if pipeline in path.parents:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                named = name in MODEL_RECORD_WRITES
                made_write = name == "write" and not node.args and not node.keywords
                recording = ast.unparse(func).endswith("modelcall.call") and any(
                    k.arg == "record" for k in node.keywords
                )
                if named or made_write or recording:
                    where = path.relative_to(root).as_posix()
                    out.append(f"{where}:{node.lineno} {ast.unparse(func)}")
    return out


def test_every_model_calls_record_is_committed_by_the_advance() -> None:
    """``modelcall.call`` writes no record (no ``record`` option; an answer, a fork's replayed
    one too, comes back only as ``Made``, its write for the advance), and no code outside the
    pipeline writes one itself (the store's writes: ``test_one_pipeline``)."""
    from runtime.pipeline import modelcall

    assert "record" not in inspect.signature(modelcall.call).parameters
    assert set(typing.get_args(modelcall.Outcome)) == {
        modelcall.Made,
        modelcall.Later,
        modelcall.Stopped,
        modelcall.Failed,
        modelcall.Interrupted,
    }
    assert model_records_written_around_the_advance() == []


def test_the_record_rule_names_a_model_call_recorded_around_the_advance(tmp_path: Path) -> None:
    """Mutants: a kind recording its model call itself (asking ``modelcall.call`` to, calling
    a ``Made``'s write, a billed failure's or a replayed answer's write) is named; handing the
    same writes to the advance, a file's write, and the pipeline's own calls are not."""
    kind = (
        "def run(self, at, made, f):\n"
        "    outcome = modelcall.call(at.task, self.request, record=True)\n"
        "    made.write()\n"
        "    modelcall.record_failed(at.task, request, body, row, usage, model)\n"
        "    at.task.record_replayed(row, original, hand_over=True)\n"
        "    f.write('text')\n"
        "    Record([made.row], write=made.write, then=made.logged)\n"
        "    return Record([row], write=functools.partial(modelcall.record_failed, at.task))\n"
    )
    for folder in ("runtime/durable", "runtime/pipeline", "tasks", "api", "cli"):
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "runtime/durable/billed.py").write_text(kind)
    (tmp_path / "runtime/pipeline/checkpoint.py").write_text(kind)
    assert model_records_written_around_the_advance(tmp_path) == [
        "runtime/durable/billed.py:2 modelcall.call",
        "runtime/durable/billed.py:3 made.write",
        "runtime/durable/billed.py:4 modelcall.record_failed",
        "runtime/durable/billed.py:5 at.task.record_replayed",
    ]
