"""How deep the engine is between a worker's entry and a step's commit (issue 35, item 1: "a
durable step reaches its commit in <= 8 frames through <= 4 modules").

A durable function's ``steps.run`` step is driven on the real engine and PostgreSQL from the
function the Celery task calls (:meth:`runtime.engine.driver.Driver.drive`) to the store's
checkpoint write (``record_steps``); the stack between them is read at that write. Counted:
the engine's frames from the entry (itself included) to the one calling the store (included),
and their modules; the user's own function (the test's module) is not the engine's, and the
store's frames are the commit itself."""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest

from db.records import Claim, NewStep
from runtime.durable import Steps, durable_agent
from runtime.engine.bootstrap import Runtime
from runtime.engine.driver import Driver
from runtime.testing.testkit import DurableTester

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
