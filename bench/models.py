"""The benchmark model: a scripted LlmClient whose workload is written in the run's input.

Worker processes load it with ``DAR_LLM_FACTORY=bench.models:build`` (the runtime's hook for
a custom model client), so no runtime code is edited. The run input is a spec string:

    "bench mode=tools tools=20 latency_ms=0"   the model calls the ``noop`` tool 20 times,
                                               one call per turn, then ends: 41 steps
    "bench mode=pause steps=10 latency_ms=1000" 10 model steps, each answering
                                               ``pause_turn`` (the run continues with
                                               another model call) and the last ``end_turn``

    "bench mode=digest tools=10 rounds=20"    the model calls the ``digest`` tool 10 times
                                               (50 MB hashed 20 times a call: C code)
    "bench mode=hub tools=10 rounds=20"        the same hashing done by the model call
                                               itself, on the step's greenlet: what a tool
                                               blocking in C did to a gevent worker before
                                               tool bodies ran on native threads

Besides those two modes it does no work of its own but ``time.sleep(latency_ms)``: its
replies are a few constant dicts and its token usage is constant, so a step's wall time
minus the model's latency is the runtime's overhead.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from db.records import Usage
from runtime.llm.base import LlmRequest, LlmResponse

MODEL_NAME = "bench-model"
USAGE = Usage(input_tokens=10, output_tokens=5)


@dataclass(frozen=True)
class Spec:
    mode: str = "tools"
    tools: int = 20
    steps: int = 10
    latency_ms: float = 0.0
    rounds: int = 1


@functools.lru_cache(maxsize=256)
def parse_spec(raw: str) -> Spec:
    values: dict[str, str] = {}
    for part in raw.split()[1:]:
        k, _, v = part.partition("=")
        values[k] = v
    return Spec(
        mode=values.get("mode", "tools"),
        tools=int(values.get("tools", 20)),
        steps=int(values.get("steps", 10)),
        latency_ms=float(values.get("latency_ms", 0)),
        rounds=int(values.get("rounds", 1)),
    )


def spec(
    mode: str = "tools",
    *,
    tools: int = 20,
    steps: int = 10,
    latency_ms: float = 0,
    rounds: int = 1,
) -> str:
    return (
        f"bench mode={mode} tools={tools} steps={steps} latency_ms={latency_ms:g} rounds={rounds}"
    )


class BenchModel:
    def send(self, request: LlmRequest) -> LlmResponse:
        first = request.messages[0]["content"]
        s = parse_spec(first if isinstance(first, str) else "bench")
        if s.latency_ms:
            time.sleep(s.latency_ms / 1000)
        content: list[dict[str, Any]]
        if s.mode == "pause":
            last = request.messages[-1]
            done = len(last["content"]) if last["role"] == "assistant" else 0
            if done + 1 < s.steps:
                return LlmResponse([{"type": "text", "text": "."}], "pause_turn", USAGE, MODEL_NAME)
            return LlmResponse([{"type": "text", "text": "done"}], "end_turn", USAGE, MODEL_NAME)
        turns = sum(1 for m in request.messages if m["role"] == "assistant")
        if s.mode == "hub" and turns < s.tools:
            from bench.agents import hash_blocking

            hash_blocking(50, s.rounds)  # on this step's greenlet: the hub is held
            return LlmResponse([{"type": "text", "text": "."}], "pause_turn", USAGE, MODEL_NAME)
        if turns < s.tools:
            name, arguments = "noop", {"i": turns + 1}
            if s.mode == "digest":
                name, arguments = "digest", {"mb": 50, "rounds": s.rounds}
            content = [
                {
                    "type": "tool_use",
                    "id": f"toolu_bench_{turns + 1:05d}",
                    "name": name,
                    "input": arguments,
                }
            ]
            return LlmResponse(content, "tool_use", USAGE, MODEL_NAME)
        return LlmResponse([{"type": "text", "text": "done"}], "end_turn", USAGE, MODEL_NAME)


def build(settings: Any = None) -> BenchModel:
    """``DAR_LLM_FACTORY=bench.models:build``."""
    return BenchModel()
