"""How deep the engine is between a worker's entry and a step's commit (issue 35, item 1: "a
durable step reaches its commit in <= 8 frames through <= 4 modules").

A durable function's ``steps.run`` step, and the agent loop's model turn and tool step (the
same advance, :meth:`runtime.pipeline.checkpoint.Program.advance`), are driven on the real
engine and PostgreSQL from the function the Celery task calls
(:meth:`runtime.engine.driver.Driver.drive`) to the store's checkpoint write (``record_steps``;
a model turn's ``checkpoint_model``); the stack between them is read at that write. Counted:
the engine's frames from the entry (itself included) to the one calling the store (included),
and their modules; the user's own function (the test's module) is not the engine's, and the
store's frames are the commit itself. A durable function's model calls (in ``steps.llm``,
``steps.model_call``) are read at their record too: the advance writes it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from db.records import Claim, NewStep, Usage
from runtime.durable import Billed, Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver
from runtime.llm.scripted import ScriptedLlm
from runtime.testing.testkit import DurableTester
from runtime.tools import tool
from tests.support import drive_to_end, register_agent, submit

MAX_FRAMES = 8
MAX_MODULES = 4


def _engine_frames(top: FrameType | None, entry: Callable[..., Any]) -> list[tuple[str, str]]:
    """(module, function) of the engine's frames from ``top`` down to ``entry``'s frame."""
    frames: list[tuple[str, str]] = []
    while top is not None:
        module = str(top.f_globals.get("__name__", ""))
        if module.startswith("runtime."):
            frames.append((module, top.f_code.co_qualname))
        if top.f_code is entry.__code__:
            return frames[::-1]
        top = top.f_back
    raise AssertionError(f"the write was not made under {entry.__qualname__}")


def _stacks_at_commit(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[tuple[str, str]]]:
    """The engine's frames at each ``record_steps`` a one-step function makes, by step key."""
    seen: dict[str, list[tuple[str, str]]] = {}
    write = runtime.store.record_steps

    def spy(claim: Claim, rows: list[NewStep]) -> Any:
        seen[rows[-1].step_key] = _engine_frames(sys._getframe(1), Driver.drive)
        return write(claim, rows)

    monkeypatch.setattr(runtime.store, "record_steps", spy)

    @durable_agent("depth")
    def depth(_: dict[str, int], steps: Steps) -> int:
        return steps.run("one", lambda: 1)

    DurableTester(runtime, None).run(depth, {})
    return seen


def test_a_durable_step_reaches_its_commit_in_few_frames_and_modules(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    frames = _stacks_at_commit(runtime, monkeypatch)["one:0"]
    path = " -> ".join(f"{m.rsplit('.', 1)[-1]}.{f}" for m, f in frames)
    modules = {m for m, _ in frames}
    assert frames[0] == ("runtime.engine.driver", "Driver.drive"), path
    assert len(frames) <= MAX_FRAMES, f"{len(frames)} frames: {path}"
    assert len(modules) <= MAX_MODULES, f"{len(modules)} modules: {sorted(modules)}"


def _loop_stacks_at_commit(
    runtime: Runtime, llm: ScriptedLlm, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[tuple[str, str]]]:
    """The engine's frames at each step write of an agent-loop run (a model turn asking for a
    tool, the tool, the answer), by step key."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for name in ("record_steps", "checkpoint_model"):
        write = getattr(runtime.store, name)

        def spy(claim: Claim, rows: Any, write: Callable[..., Any] = write) -> Any:
            last = rows[-1] if isinstance(rows, list) else rows
            seen[last.step_key] = _engine_frames(sys._getframe(1), Driver.drive)
            return write(claim, rows)

        monkeypatch.setattr(runtime.store, name, spy)

    @tool
    def lookup(q: str) -> str:
        """Look something up."""
        return "found"

    register_agent(runtime.agents, lookup)
    llm.then_tool_use("toolu_1", "lookup", {"q": "x"}).then_text("done")
    _, dispatch = submit(runtime.store)
    drive_to_end(runtime.driver(), dispatch)
    return seen


@pytest.mark.parametrize(
    ("key", "max_frames", "max_modules"), [("model:1", 7, 4), ("tool:toolu_1", 7, 3)]
)
def test_an_agent_loop_step_reaches_its_commit_in_few_frames_and_modules(
    runtime: Runtime,
    llm: ScriptedLlm,
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    max_frames: int,
    max_modules: int,
) -> None:
    """The agent loop's model turn and tool step go through the same advance as a durable
    step, within the issue's target and held at what they reach: a model turn is Driver.drive
    -> execute -> _run_program -> run_agent -> Program.advance -> record_billed -> durably (7
    frames, 4 modules; 11 before it went through the advance), a tool step the same to
    Task.checkpoint -> durably (7 frames, 3 modules)."""
    assert max_frames <= MAX_FRAMES
    assert max_modules <= MAX_MODULES
    frames = _loop_stacks_at_commit(runtime, llm, monkeypatch)[key]
    path = " -> ".join(f"{m.rsplit('.', 1)[-1]}.{f}" for m, f in frames)
    modules = {m for m, _ in frames}
    assert frames[0] == ("runtime.engine.driver", "Driver.drive"), path
    assert ("runtime.pipeline.checkpoint", "Program.advance") in frames, path
    assert len(frames) <= max_frames, f"{len(frames)} frames: {path}"
    assert len(modules) <= max_modules, f"{len(modules)} modules: {sorted(modules)}"


def _model_records_at_commit(
    runtime: Runtime, llm: ScriptedLlm, monkeypatch: pytest.MonkeyPatch
) -> dict[str, list[tuple[str, str]]]:
    """The engine's frames at the record of a durable function's model calls: one inside
    ``steps.llm`` (``record_child``) and a framework's ``steps.model_call``
    (``checkpoint_model``), by step key."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for name in ("record_child", "checkpoint_model"):
        write = getattr(runtime.store, name)

        def spy(claim: Claim, row: NewStep, write: Callable[..., Any] = write) -> Any:
            seen[row.step_key] = _engine_frames(sys._getframe(1), Driver.drive)
            return write(claim, row)

        monkeypatch.setattr(runtime.store, name, spy)
    llm.then_text("hi")

    @durable_agent("depth-model")
    def depth(_: dict[str, int], steps: Steps) -> Any:
        said = steps.llm("ask", lambda model: model.complete("hello"))
        billed = Billed(value=said, model="framework-model", usage=Usage(3, 2))
        return steps.model_call("framework", lambda _live: billed, prompt="p", model="m")

    assert DurableTester(runtime, None).run(depth, {}).result == "hi"
    return seen


@pytest.mark.parametrize(
    ("key", "store_write"), [("ask:0/llm:0", "record_child"), ("framework:0", "checkpoint_model")]
)
def test_a_durable_functions_model_call_is_recorded_by_the_advance(
    runtime: Runtime,
    llm: ScriptedLlm,
    monkeypatch: pytest.MonkeyPatch,
    key: str,
    store_write: str,
) -> None:
    """A model call inside ``steps.llm`` and a framework's ``steps.model_call`` are recorded
    by the advance, as the agent loop's model turn: the record is written from
    :meth:`Program.advance` through the billed record and the checkpoint's retry (``-> advance
    -> record_billed -> durably``), not from inside the model call (it was ``-> advance ->
    LlmCall.run / BilledCall.run -> modelcall.call -> _admit_and_call -> record_billed ->
    durably``: three frames more)."""
    frames = _model_records_at_commit(runtime, llm, monkeypatch)[key]
    path = " -> ".join(f"{m.rsplit('.', 1)[-1]}.{f}" for m, f in frames)
    assert frames[-3:] == [
        ("runtime.pipeline.checkpoint", "Program.advance"),
        ("runtime.pipeline.modelcall", "record_billed"),
        ("runtime.pipeline.checkpoint", "Task.durably"),
    ], f"{store_write}: {path}"


def test_the_count_sees_a_deeper_path(runtime: Runtime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The measure can fail: one more engine frame between the entry and the write (a
    wrapper of the checkpoint, as the pipeline's own code) is counted."""
    from runtime.pipeline import checkpoint

    before = _stacks_at_commit(runtime, monkeypatch)["one:0"]
    namespace: dict[str, Any] = {
        "__name__": checkpoint.__name__,
        "real": checkpoint.Task.checkpoint,
    }
    exec("def wrapped(self, rows):\n    return real(self, rows)\n", namespace)
    monkeypatch.setattr(checkpoint.Task, "checkpoint", namespace["wrapped"])
    after = _stacks_at_commit(runtime, monkeypatch)["one:0"]
    assert len(after) == len(before) + 1
    assert (checkpoint.__name__, "wrapped") in after
