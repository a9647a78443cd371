"""DBOS Transact doing the real-client workload: a workflow per run, each model call a DBOS
step (its answer checkpointed by DBOS), through the same Anthropic SDK client, streamed, on
the benchmark's PostgreSQL (schema ``dbos``). As DBOS documents it: workflows started with
``DBOS.start_workflow`` run on DBOS's executor threads (native threads; DBOS does not use
gevent), its default configuration otherwise.

    python -m bench.dbos_llm DATABASE_URL EXECUTOR_ID --url U --runs N --steps S --latency-ms L

Prints "ready", waits for a line on stdin, starts the workflows evenly over one latency,
and prints one JSON line (elapsed seconds, calls, errors) when all have ended.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

MODEL = "claude-sonnet-4-5"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.dbos_llm")
    ap.add_argument("database_url")
    ap.add_argument("executor")
    ap.add_argument("--url", required=True)
    ap.add_argument("--runs", type=int, required=True)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--latency-ms", type=int, default=10_000)
    args = ap.parse_args(argv)

    from dbos import DBOS

    from bench.sdk import bare_sdk_client

    client = bare_sdk_client(args.url, args.latency_ms)
    lock = threading.Lock()
    counts = {"calls": 0}

    @DBOS.step()
    def model_call(messages: list[dict[str, Any]]) -> dict[str, Any]:
        with client.messages.stream(model=MODEL, max_tokens=1024, messages=messages) as stream:
            for _ in stream:
                pass
            final = stream.get_final_message()
        with lock:
            counts["calls"] += 1
        return {"content": final.model_dump()["content"], "stop_reason": final.stop_reason}

    @DBOS.workflow()
    def agent_run(prompt: str, steps: int) -> int:
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        for n in range(steps):
            answer = model_call(messages)
            messages.append({"role": "assistant", "content": answer["content"]})
            if answer["stop_reason"] != "pause_turn":
                return n + 1
        return steps

    DBOS(
        config={
            "name": "dar-bench-dbos-llm",
            "system_database_url": args.database_url.replace(
                "postgresql+psycopg://", "postgresql://"
            ),
            "executor_id": args.executor,
            "log_level": "WARNING",
        }
    )
    DBOS.launch()
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.monotonic()
    spread = args.latency_ms / 1000
    handles = []
    for i in range(args.runs):
        time.sleep(max(0.0, t0 + spread * i / args.runs - time.monotonic()))
        prompt = f"bench latency_ms={args.latency_ms} steps={args.steps} run {i} {args.executor}"
        handles.append(DBOS.start_workflow(agent_run, prompt, args.steps))
    errors = 0
    for h in handles:
        try:
            h.get_result()
        except Exception:
            errors += 1
    out = {"elapsed_s": time.monotonic() - t0, "calls": counts["calls"], "errors": errors}
    print(json.dumps(out), flush=True)
    DBOS.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
