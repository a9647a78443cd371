"""The bare-client baselines: the same SDKs making the same calls as the runtime's runs, with
no runtime (no database, no broker, no checkpoint), in a process of their own:

    python -m bench.bare_client anthropic --url U --runs N --steps S --latency-ms L [--no-stream]
    python -m bench.bare_client pydantic-ai --url U --runs N --latency-ms L
    python -m bench.bare_client openai-agents --url U --runs N --latency-ms L

``anthropic``: gevent greenlets (as the runtime's worker), one ``anthropic.Anthropic`` client
for the process (its connection cap lifted as the runtime lifts it), each run ``steps``
calls in sequence, the conversation growing, streamed (the SDK's own event parsing) or not.
The frameworks: asyncio tasks, one agent run each. Runs start evenly over one latency (as
the runtime's are submitted). Prints one JSON line: elapsed seconds from the first start to
the last answer, calls made, errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

MODEL = "claude-sonnet-4-5"


def _anthropic(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    from gevent import monkey

    monkey.patch_all()
    import gevent

    from bench.sdk import bare_sdk_client

    client = bare_sdk_client(args.url, args.latency_ms)
    calls = errors = 0

    def one_run(i: int) -> None:
        nonlocal calls, errors
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": f"bench latency_ms={args.latency_ms} steps={args.steps} run {i}",
            }
        ]
        for _ in range(args.steps):
            try:
                if args.stream:
                    text = []
                    with client.messages.stream(
                        model=MODEL, max_tokens=1024, messages=messages
                    ) as stream:
                        for event in stream:
                            if event.type == "text":
                                text.append(event.text)
                        final = stream.get_final_message()
                else:
                    final = client.messages.create(model=MODEL, max_tokens=1024, messages=messages)
                calls += 1
            except Exception:
                errors += 1
                return
            messages.append({"role": "assistant", "content": final.model_dump()["content"]})
            if final.stop_reason != "pause_turn":
                return

    def go() -> dict[str, Any]:
        t0 = time.monotonic()
        spread = args.latency_ms / 1000
        greenlets = []
        for i in range(args.runs):
            gevent.sleep(max(0.0, t0 + spread * i / args.runs - time.monotonic()))
            greenlets.append(gevent.spawn(one_run, i))
        gevent.joinall(greenlets)
        return {"elapsed_s": time.monotonic() - t0, "calls": calls, "errors": errors}

    return go


def _asyncio(args: argparse.Namespace) -> Callable[[], dict[str, Any]]:
    import asyncio

    if args.kind == "pydantic-ai":
        import pydantic_ai  # noqa: F401  (imported before the meters start)
    else:
        import agents  # noqa: F401

    async def main() -> dict[str, Any]:
        if args.kind == "pydantic-ai":
            from bench.real_agents import pydantic_ai_agent

            agent: Any = pydantic_ai_agent()

            async def one_run(i: int) -> None:
                prompt = f"bench latency_ms={args.latency_ms} run {i}"
                async with agent.run_stream(prompt) as result:
                    async for _ in result.stream_text(delta=True):
                        pass

        else:
            from agents import Runner

            from bench.real_agents import openai_agents_agent

            agent = openai_agents_agent()

            async def one_run(i: int) -> None:
                result = Runner.run_streamed(agent, f"bench latency_ms={args.latency_ms} run {i}")
                async for _ in result.stream_events():
                    pass

        calls = errors = 0

        async def counted(i: int) -> None:
            nonlocal calls, errors
            try:
                await one_run(i)
                calls += 1
            except Exception:
                errors += 1

        t0 = time.monotonic()
        spread = args.latency_ms / 1000
        tasks = []
        for i in range(args.runs):
            await asyncio.sleep(max(0.0, t0 + spread * i / args.runs - time.monotonic()))
            tasks.append(asyncio.create_task(counted(i)))
        await asyncio.gather(*tasks)
        return {"elapsed_s": time.monotonic() - t0, "calls": calls, "errors": errors}

    return lambda: asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bare_client")
    ap.add_argument("kind", choices=("anthropic", "pydantic-ai", "openai-agents"))
    ap.add_argument("--url", required=True)
    ap.add_argument("--runs", type=int, required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--latency-ms", type=int, default=10_000)
    ap.add_argument("--no-stream", dest="stream", action="store_false")
    args = ap.parse_args(argv)
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per call in flight
    go = _anthropic(args) if args.kind == "anthropic" else _asyncio(args)
    print("ready", flush=True)
    sys.stdin.readline()  # the bench starts its meters, then says go
    print(json.dumps(go()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
