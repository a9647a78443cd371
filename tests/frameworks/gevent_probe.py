"""Run by ``test_gevent.py`` in a process of its own, patched as the shipped worker is
(gevent): a framework agent's sync tool that holds the CPU in C code for a while must not
stop the process's other greenlets (a worker's heartbeat, its other steps). Prints the longest
pause a ticking greenlet saw while each framework's tool ran, as JSON."""

from gevent import monkey

monkey.patch_all()

import asyncio  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import gevent  # noqa: E402
from pydantic_ai import Agent  # noqa: E402
from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart  # noqa: E402
from pydantic_ai.models.function import AgentInfo, FunctionModel  # noqa: E402

from runtime.frameworks import pydantic_ai as adapter  # noqa: E402
from runtime.frameworks.bridge import framework_loop, on_loop  # noqa: E402

BURN_SECONDS = 1.0
gaps: list[float] = []
threads: list[int] = []


def tick() -> None:
    last = time.monotonic()
    while True:
        gevent.sleep(0.02)
        now = time.monotonic()
        gaps.append(now - last)
        last = now


def burn() -> str:
    """CPU in C code (hashlib releases the GIL; a greenlet would not yield)."""
    threads.append(threading.get_native_id())
    started = time.monotonic()
    while time.monotonic() - started < BURN_SECONDS:
        hashlib.sha256(b"x" * 5_000_000).digest()
    return "burnt"


def decide(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if len(messages) == 1:
        return ModelResponse(parts=[ToolCallPart("burn", {})])
    return ModelResponse(parts=[TextPart("done")])


def longest(run: Any) -> float:
    gaps.clear()
    run()
    return max(gaps)


def main() -> None:
    gevent.spawn(tick)
    framework_loop()
    agent = Agent(FunctionModel(decide), name="burner")
    agent.tool_plain(burn)
    options = adapter.Options()
    pydantic = longest(lambda: on_loop(adapter._agent_run(agent, "go", options, None)))  # type: ignore[arg-type]
    sdk = longest(lambda: on_loop(asyncio.to_thread(burn)))  # how the Agents SDK runs sync tools
    hub = threading.get_native_id()
    print(json.dumps({"pydantic_ai": pydantic, "agents": sdk, "off_hub": hub not in threads}))


if __name__ == "__main__":
    main()
