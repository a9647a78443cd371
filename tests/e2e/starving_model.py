"""The model of ``tests/e2e/test_starved_heartbeat.py``: every call burns CPU on the step's
greenlet for a while, in small slices with a yield between them (what parsing a long stream
of server-sent events does to a gevent worker), and counts itself in Redis before it answers.
It waits (cooperatively) for the test's signal before it burns, so that every call is open
when the hub starts starving.

Loaded by the workers with ``DAR_LLM_FACTORY=tests.e2e.starving_model:build``. A run's input
says how long its call takes and how it burns: ``"starve <tag> seconds=8 slice_ms=40"``; on a
worker other than ``worker-A`` the call sleeps instead (an idle worker, ready to take a run
over)."""

from __future__ import annotations

import time
from typing import Any

import redis

from db.records import Usage
from runtime.llm.base import LlmRequest, LlmResponse

CALLS_KEY = "dar-test-starve:calls"
"""Redis hash: run input -> model calls made for it (by any worker)."""
GO_KEY = "dar-test-starve:go"
"""Set by the test once every call is open: they all burn from then on, together."""


def _spec(text: str) -> dict[str, float]:
    values = dict(part.partition("=")[::2] for part in text.split()[2:])
    return {k: float(v) for k, v in values.items()}


class StarvingModel:
    def __init__(self, redis_url: str, worker: str) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.burns = worker == "worker-A"

    def send(self, request: LlmRequest) -> LlmResponse:
        first: Any = request.messages[0]["content"]
        self.redis.hincrby(CALLS_KEY, str(first), 1)
        spec = _spec(str(first))
        while not self.redis.exists(GO_KEY):  # an open call waiting for its answer
            time.sleep(0.05)
        end = time.monotonic() + spec.get("seconds", 5.0)
        if not self.burns:
            time.sleep(end - time.monotonic())
        slice_s = spec.get("slice_ms", 5.0) / 1000
        while time.monotonic() < end:
            busy = time.perf_counter() + slice_s
            while time.perf_counter() < busy:  # pure Python: holds the hub
                pass
            time.sleep(0)  # gevent's patched sleep: the other greenlets' turn
        return LlmResponse(
            [{"type": "text", "text": "done"}],
            "end_turn",
            Usage(input_tokens=100, output_tokens=10),
            "starving-model",
        )


def build(settings: Any) -> StarvingModel:
    """``DAR_LLM_FACTORY=tests.e2e.starving_model:build``."""
    return StarvingModel(settings.redis_url, settings.worker_name)
