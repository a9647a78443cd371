"""``steps.model_call``: a framework's model call (Pydantic AI, the Agents SDK) as one billed
top-level step, a kind of the one protocol (:mod:`runtime.durable.simple`), driven by the one
advance; the same guard, flow control, live stream, cancel and billing as ours
(:func:`runtime.pipeline.modelcall.call`). A call the provider billed is recorded with its
usage whatever its outcome."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from db.records import Dispatch, NewStep, StepStatus, Usage
from runtime.durable.api import Billed, BilledFailure
from runtime.durable.container import type_name
from runtime.durable.simple import At, SimpleKind
from runtime.llm.base import LlmRequest, LlmResponse
from runtime.llm.live_call import LiveCall, current_live_call
from runtime.observe.logctx import error_text, set_step
from runtime.pipeline import modelcall
from runtime.pipeline.checkpoint import Record
from runtime.pipeline.codec import encode
from runtime.pipeline.kinds import StepKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BilledCall(SimpleKind):
    step_name: str
    fn: Callable[[LiveCall | None], Billed]
    prompt: Any
    model: str
    kind: ClassVar[StepKind] = StepKind.FRAMEWORK_MODEL
    api: ClassVar[str] = "steps.model_call"

    @property
    def name(self) -> str:
        return self.step_name

    def misplaced(self, nested: bool) -> str | None:
        return "steps.model_call belongs at the top level, not in a step" if nested else None

    def replay(self, at: At) -> Any:
        return at.row.response  # type: ignore[union-attr]

    def run(self, at: At) -> Record:
        task, key, seq, model = at.task, at.key, at.seq, self.model
        set_step(seq)
        body = {"model": model, "prompt": self.prompt}
        request = LlmRequest(model=model, max_tokens=at.ex.default_max_tokens, messages=[])

        def make() -> LlmResponse:
            billed = self.fn(current_live_call())
            value = encode(billed.value)
            return LlmResponse(
                value, billed.stop_reason, billed.usage, billed.model or model, billed.request_id
            )

        started = time.monotonic()
        with at.ex.engine_call():
            outcome = modelcall.call(
                task, request, kind=self.kind, key=key, seq=seq, body=body, make=make
            )
        if isinstance(outcome, modelcall.Made):  # a fork's replayed answer too
            return Record([outcome.row], write=outcome.write, then=outcome.logged)
        if isinstance(outcome, modelcall.Later):
            with at.ex.engine_call():
                at.end(
                    task.schedule(
                        outcome.delay_seconds,
                        outcome.reason,
                        model_attempts=outcome.model_attempts,
                        admission=outcome.admission,
                        wakeable=outcome.wakeable,
                    )
                )
        if isinstance(outcome, modelcall.Stopped):
            with at.ex.engine_call():
                at.ex.stop(outcome.status, outcome.reason)
        assert isinstance(outcome, modelcall.Failed)  # (its kind is not interruptible)
        billed = outcome.error if isinstance(outcome.error, BilledFailure) else None
        error = billed.error if billed is not None else outcome.error  # billed all the same
        text = f"{type_name(error)}: {error}"
        row = at.new(
            StepStatus.ERROR,
            error=text,
            model=model,
            latency_ms=int((time.monotonic() - started) * 1000),
        )
        log.info("run=%s seq=%d MODEL %s failed: %s", task.rid, seq, key, error_text(text))
        if billed is not None:
            return Record([row], write=_billed_failure(at, request, body, row, billed))
        return Record([row])


def _billed_failure(
    at: At, request: LlmRequest, body: dict[str, Any], row: NewStep, failure: BilledFailure
) -> Callable[[], Dispatch | None]:
    """The write of the error row of a framework's call the provider billed, with its usage
    (:func:`runtime.pipeline.modelcall.record_failed`); an estimate (its input from the
    request, its output at ``max_tokens`` unless the framework said) when the framework
    raised before its usage could be read."""
    usage, model = failure.billed.usage, failure.billed.model or request.model
    if failure.estimated:
        usage = Usage(
            input_tokens=usage.input_tokens or modelcall.estimate_tokens(body),
            output_tokens=usage.output_tokens or request.max_tokens,
        )
    return functools.partial(
        modelcall.record_failed,
        at.task,
        request,
        body,
        row,
        usage,
        model,
        request_id=failure.billed.request_id,
        estimated=failure.estimated,
    )
