"""What a model client tells the live stream while a call is in flight, and how it learns that
the call is no longer wanted.

The engine sets a :class:`LiveCall` for the duration of one model call
(:func:`live_call`); a streaming client (:class:`~runtime.llm.anthropic.AnthropicClient`)
reads it with :func:`current_live_call`, announces each HTTP attempt, forwards text deltas and
registers how to abort its stream. Clients that do not stream ignore it. Carried by
``contextvars``, so it follows the call into :class:`~runtime.llm.retry.TimeLimitedLlmClient`'s
pool thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from db.records import Usage
from runtime.llm.base import LlmError


class LiveCall(Protocol):
    """One model call of one step, as the live stream sees it."""

    cancelled: threading.Event
    """Set when the run was cancelled while the call is in flight."""

    def begin_attempt(self) -> int:
        """A new HTTP attempt starts; returns its number (the previous attempt's deltas are
        retracted for clients)."""
        ...

    def delta(self, attempt: int, text: str) -> None:
        """Model text as it arrives (best effort: never raises)."""
        ...

    def on_cancel(self, abort: Callable[[], None]) -> Callable[[], None]:
        """Call ``abort`` (from another thread) when the run is cancelled; returns a function
        that unregisters it."""
        ...


class ModelCallCancelled(LlmError):
    """The run was cancelled while its model call was in flight; the call was aborted.

    ``usage`` is what was billed when it was cut: what the stream had reported, plus, for the
    output tokens it reports only at its end, ``estimated_tokens`` estimated from the content
    received."""

    def __init__(
        self,
        message: str,
        *,
        usage: Usage,
        request_id: str | None = None,
        estimated_tokens: int = 0,
    ) -> None:
        super().__init__(message, status=-1, request_id=request_id, retryable=False)
        self.usage = usage
        self.estimated_tokens = estimated_tokens


class ModelCallInterrupted(ModelCallCancelled):
    """A message posted with ``policy: "interrupt"`` aborted the call: the step is made again
    with the message. ``usage`` is what the cut stream had reported as billed."""


_current: contextvars.ContextVar[LiveCall | None] = contextvars.ContextVar(
    "dar_live_call", default=None
)


def current_live_call() -> LiveCall | None:
    return _current.get()


@contextlib.contextmanager
def live_call(call: LiveCall | None) -> Iterator[None]:
    token = _current.set(call)
    try:
        yield
    finally:
        _current.reset(token)
