"""Billed tokens that no response brings back: the meter a model client reports them to.

The API bills what it generated, whether or not the caller is still there to read it. Two
attempts are billed with no response reaching the engine:

* an attempt :class:`~runtime.llm.retry.TimeLimitedLlmClient` gave up on, which completes
  later in its pool thread (its usage is in the response nobody waits for);
* a stream cut mid-way (a reset, a read past the deadline, an ``error`` event): the API bills
  the input ``message_start`` reported and the output generated so far.

The engine installs a meter around each model call (:func:`metering`); a client reports such
an attempt with :func:`bill_lost`, and the meter counts it against the run (its unrecorded
tokens). The meter is a ``ContextVar``: :class:`TimeLimitedLlmClient` carries the caller's
context into its pool thread and keeps the meter for an attempt that outlives the call.
Without a meter (a client used on its own) a lost attempt is only logged.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from typing import Protocol

from db.records import Usage

log = logging.getLogger(__name__)


class Meter(Protocol):
    """``meter(usage, model, why)``: count ``usage`` of a call to ``model`` billed with no
    response; ``why`` says how it was lost (for the log line); with ``estimated``, the usage
    is an estimate (an upper bound), not what the API reported."""

    def __call__(self, usage: Usage, model: str, why: str, *, estimated: bool = False) -> None: ...


_meter: contextvars.ContextVar[Meter | None] = contextvars.ContextVar("dar_meter", default=None)


@contextlib.contextmanager
def metering(meter: Meter) -> Iterator[None]:
    """Report lost attempts of the model calls made inside this block to ``meter``."""
    token = _meter.set(meter)
    try:
        yield
    finally:
        _meter.reset(token)


def current_meter() -> Meter | None:
    """The meter of the model call in progress, to keep for an attempt that outlives it."""
    return _meter.get()


def bill_lost(
    usage: Usage, model: str, why: str, meter: Meter | None = None, *, estimated: bool = False
) -> None:
    """Count ``usage`` (billed, never returned; ``estimated``: an estimate of it) on
    ``meter`` (by default the current one). Never raises: an attempt already lost must not
    also fail the call beside it."""
    if usage.total <= 0:
        return
    target = meter if meter is not None else _meter.get()
    if target is None:
        log.warning(
            "model call to %s billed %d tokens that no run records (%s)",
            model,
            usage.total,
            why,
            extra={"event": "llm.billed_lost", "action": "unmetered"},
        )
        return
    try:
        if estimated:
            target(usage, model, why, estimated=True)
        else:
            target(usage, model, why)
    except Exception:
        log.exception(
            "could not record %d billed tokens of a lost model call (%s)",
            usage.total,
            why,
            extra={"event": "llm.billed_lost", "action": "error"},
        )
