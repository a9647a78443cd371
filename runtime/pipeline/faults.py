"""Named crash points for fault-injection testing (the chaos suite), off unless configured.

``DAR_FAULTS="after_model_response=0.2,after_tool_effect=0.1"`` makes the process SIGKILL
itself at those points with those probabilities (``DAR_FAULTS_SEED`` seeds the draw). A real
process death, not an exception: nothing in the process gets to clean up, exactly like an
OOM kill or a node going away. Never set it in production.

Points, in the order a step passes them:

- ``after_claim``: the lease is held, nothing else done;
- ``before_model_call``: the request is built;
- ``after_model_response``: the model answered (and was paid), not yet checkpointed;
- ``after_tool_start``: the tool step is recorded STARTED (an idempotent one: not yet, see
  ``runtime.pipeline.effects`` rule 1), the tool has not run;
- ``after_tool_effect``: the tool ran (its side effect happened), not yet recorded;
- ``after_checkpoint``: the step is committed, the next message not yet sent;
- ``before_message_delivery``: a message posted to an agent-loop run is about to be
  recorded as its step (at a step boundary, or after it interrupted a model call);
- ``after_interrupt``: a model call was aborted by a message posted with ``policy:
  "interrupt"`` (its tokens counted), the message not yet recorded.
"""

from __future__ import annotations

import logging
import os
import random
import signal
from collections.abc import Mapping

log = logging.getLogger(__name__)

POINTS = (
    "after_claim",
    "before_model_call",
    "after_model_response",
    "after_tool_start",
    "after_tool_effect",
    "after_checkpoint",
)
MESSAGE_POINTS = ("before_message_delivery", "after_interrupt")
"""Reached only by runs that are sent messages (not in the chaos campaign's plan)."""


def parse(spec: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, prob = part.partition("=")
        if name not in POINTS + MESSAGE_POINTS:
            known = ", ".join(POINTS + MESSAGE_POINTS)
            raise ValueError(f"DAR_FAULTS: unknown crash point {name!r}; known: {known}")
        out[name] = float(prob or "1")
    return out


class Faults:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        e = os.environ if env is None else env
        self.points = parse(e.get("DAR_FAULTS", ""))
        seed = e.get("DAR_FAULTS_SEED")
        self._rng = random.Random(int(seed) + os.getpid() if seed else None)
        if self.points:
            log.warning("fault injection is ON: %s", self.points)

    def point(self, name: str) -> None:
        prob = self.points.get(name)
        if prob and self._rng.random() < prob:
            log.warning("fault injection: SIGKILL at %s", name)
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)


_faults: Faults | None = None


def crash_point(name: str) -> None:
    """A place where the chaos suite may kill this process. Costs a dict lookup when off."""
    global _faults
    if _faults is None:
        _faults = Faults()
    if _faults.points:
        _faults.point(name)
