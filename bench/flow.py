"""``python -m bench.flow [--quick] [--minutes M] [--runs N]``: flow control against a rate
limited model API.

The fake Messages API (``tests/fakes/messages_api.py``) enforces real token buckets, 60
requests/min and 40,000 input tokens/min by default, answering 429 with ``retry-after`` and
the ``anthropic-ratelimit-*`` headers when a request does not fit. 300 runs (one model call
each, ~800 input tokens, so input tokens/min is the binding limit: 50 calls/min) are
submitted at once to 3 worker processes talking to it through the real Anthropic SDK, twice:

- **flow control on**: ``DAR_MODEL_LIMITS`` set to the API's limits; each model call asks
  the fleet-wide bucket in Redis for admission first, and a refused run waits on a durable
  timer;
- **flow control off**: every worker calls and meets the 429s, retrying with the server's
  ``retry-after`` as a floor (the old path).

For each it prints, after the first minute (the warm-up, when both buckets start full): the
429s answered, and the throughput granted as a fraction of the binding limit; and overall,
the 429s (wasted calls) and the runs that failed. ``--quick`` doubles the limits and measures
two minutes per phase (30 s warm-up), about five minutes in all; the full run four minutes
per phase. Writes
``bench/results/flow-<time>.json`` and the plot ``docs/bench-flow.png`` (granted
requests/min over time, on and off). Not part of pytest; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.env import RESULTS, ROOT, BenchEnv, prepare
from bench.stack import RuntimeFleet
from db.records import Dispatch, NewRun
from tasks.dispatch import send_drive
from tests.fakes.messages_api import FakeMessagesApi, RateLimit, count_input_tokens

MODEL = "claude-sonnet-4-5"
WORKERS = 3
CONCURRENCY = 4
PAD = "lorem ipsum dolor sit amet " * 110
"""About 3,000 characters: with the system prompt and the tool, ~800 input tokens a call."""


@dataclass(frozen=True)
class Plan:
    runs: int
    minutes: float
    warmup: float
    requests_per_minute: int
    input_tokens_per_minute: int

    @classmethod
    def make(cls, *, quick: bool, minutes: float | None, runs: int) -> Plan:
        scale = 2 if quick else 1
        return cls(
            runs=runs,
            minutes=minutes if minutes is not None else (2.0 if quick else 4.0),
            warmup=30.0 if quick else 60.0,
            requests_per_minute=60 * scale,
            input_tokens_per_minute=40_000 * scale,
        )

    def limits_json(self) -> str:
        return json.dumps(
            {
                "claude-*": {
                    "requestsPerMinute": self.requests_per_minute,
                    "inputTokensPerMinute": self.input_tokens_per_minute,
                }
            }
        )


def _sampler(fake: FakeMessagesApi, stop: threading.Event, out: list[dict[str, Any]]) -> None:
    """Once a second: requests answered so far, 200s, 429s and the input tokens of the 200s."""
    started = time.monotonic()
    seen = 0
    ok = limited = tokens = 0
    while not stop.wait(1.0):
        reqs = fake.requests
        for r in reqs[seen:]:
            if r.status == 200:
                ok += 1
                tokens += count_input_tokens(r.json) if isinstance(r.json, dict) else 0
            elif r.status == 429:
                limited += 1
        seen = len(reqs)
        out.append({"t": time.monotonic() - started, "ok": ok, "429": limited, "tokens": tokens})


def _clear_flow_keys(env: BenchEnv) -> None:
    client = redis.Redis.from_url(env.redis_url)
    try:
        for key in client.scan_iter("dar:flow:*"):
            client.delete(key)
    finally:
        client.close()


def phase(env: BenchEnv, plan: Plan, *, flow: bool) -> dict[str, Any]:
    queue = f"dar-bench-flow-{os.getpid()}"  # never another benchmark's workers' queue
    env.truncate()
    env.reset_redis([queue])
    _clear_flow_keys(env)
    limit = RateLimit(
        requests_per_minute=plan.requests_per_minute,
        input_tokens_per_minute=plan.input_tokens_per_minute,
    )
    samples: list[dict[str, Any]] = []
    stop = threading.Event()
    with FakeMessagesApi(default_responder=True, rate_limits={"claude-*": limit}) as fake:
        extra = {
            "ANTHROPIC_BASE_URL": fake.url,
            "ANTHROPIC_API_KEY": "bench",
            "DAR_LLM_FACTORY": "",
            "DAR_LOG_LEVEL": os.environ.get("DAR_BENCH_LOG_LEVEL", "WARNING"),
            "DAR_MAX_TOKENS": "256",
        }
        if flow:
            extra["DAR_MODEL_LIMITS"] = plan.limits_json()
        name = "flow-on" if flow else "flow-off"
        with RuntimeFleet(
            env, workers=WORKERS, concurrency=CONCURRENCY, name=name, extra_env=extra, queue=queue
        ) as fleet:
            ids = []
            for i in range(plan.runs):
                run, _ = env.store.create_run(
                    NewRun(
                        agent="bench",
                        input=f"run {i}: {PAD}",
                        model=MODEL,
                        max_steps=10,
                        token_budget=1_000_000,
                        timeout_seconds=3600,
                    )
                )
                ids.append(run.id)
                fleet_dispatch = Dispatch(run.id, run.dispatch_token)
                send_drive(fleet.app, env.store, fleet_dispatch)
            sampler = threading.Thread(target=_sampler, args=(fake, stop, samples), daemon=True)
            sampler.start()
            time.sleep(plan.minutes * 60)
            stop.set()
            sampler.join()
            counts = _statuses(env, ids)
    return {"flow": flow, "samples": samples, "statuses": counts, **_figures(plan, samples)}


def _statuses(env: BenchEnv, ids: list[Any]) -> dict[str, int]:
    from sqlalchemy import text

    with env.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT status, count(*) FROM run WHERE id = ANY(:ids) GROUP BY status"),
            {"ids": ids},
        ).all()
    return {str(s): int(n) for s, n in rows}


def _at(samples: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """The last sample taken at or before ``t`` seconds."""
    best = {"t": 0.0, "ok": 0, "429": 0, "tokens": 0}
    for s in samples:
        if s["t"] <= t + 0.5:
            best = s
    return best


def _figures(plan: Plan, samples: list[dict[str, Any]]) -> dict[str, Any]:
    if not samples:
        return {}
    start, end = _at(samples, plan.warmup), samples[-1]
    minutes = (end["t"] - start["t"]) / 60
    ok_rate = (end["ok"] - start["ok"]) / minutes
    token_rate = (end["tokens"] - start["tokens"]) / minutes
    frac_requests = ok_rate / plan.requests_per_minute
    frac_tokens = token_rate / plan.input_tokens_per_minute
    return {
        "after_warmup": {
            "seconds": round(end["t"] - start["t"], 1),
            "429s": end["429"] - start["429"],
            "granted_requests_per_minute": round(ok_rate, 1),
            "granted_input_tokens_per_minute": round(token_rate),
            "fraction_of_requests_limit": round(frac_requests, 3),
            "fraction_of_input_tokens_limit": round(frac_tokens, 3),
            "fraction_of_binding_limit": round(max(frac_requests, frac_tokens), 3),
        },
        "total": {"200s": end["ok"], "429s": end["429"]},
    }


def _per_minute(samples: list[dict[str, Any]], field: str, bin_s: float) -> tuple[list, list]:
    """``field`` per minute in bins of ``bin_s`` seconds (x: each bin's start)."""
    xs, ys = [], []
    t = bin_s
    while samples and t <= samples[-1]["t"] + 0.5:
        a, b = _at(samples, t - bin_s), _at(samples, t)
        xs.append(t - bin_s)
        ys.append((b[field] - a[field]) * 60 / bin_s)
        t += bin_s
    return xs, ys


def plot(plan: Plan, results: list[dict[str, Any]], path: Path, bin_s: float = 15.0) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for res in sorted(results, key=lambda r: bool(r["flow"])):  # "on" drawn last, on top
        label = "flow control on" if res["flow"] else "flow control off"
        color = "tab:blue" if res["flow"] else "tab:red"
        xs, ys = _per_minute(res["samples"], "ok", bin_s)
        top.step(xs, ys, where="post", label=label, color=color, lw=2)
        xs, zs = _per_minute(res["samples"], "429", bin_s)
        bottom.step(xs, zs, where="post", label=label, color=color, lw=2)
    last = results[0]["samples"][-1]
    binding = min(
        plan.requests_per_minute, plan.input_tokens_per_minute * last["ok"] / max(1, last["tokens"])
    )
    top.axhline(binding, color="grey", lw=1, ls=":", label="the API's limit (input tokens/min)")
    for ax in (top, bottom):
        ax.axvline(plan.warmup, color="grey", lw=0.8)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8, loc="upper right")
    top.set_ylim(0, binding * 4)
    top.set_ylabel(f"granted requests/min\n({bin_s:.0f} s bins)")
    bottom.set_ylabel("429 answers/min")
    bottom.set_xlabel(
        f"seconds since {plan.runs} runs were submitted (the first bin holds the buckets' "
        "initial burst)"
    )
    top.set_title(
        f"{plan.runs} runs, {WORKERS} workers, API limits {plan.requests_per_minute} req/min "
        f"and {plan.input_tokens_per_minute:,} input tokens/min",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _print(plan: Plan, res: dict[str, Any]) -> None:
    a, t = res["after_warmup"], res["total"]
    label = "on " if res["flow"] else "off"
    print(
        f"  flow control {label}  after {plan.warmup:.0f} s: {a['429s']:4d} 429s, "
        f"granted {a['granted_requests_per_minute']:6.1f} req/min, "
        f"{a['granted_input_tokens_per_minute']:7d} input tok/min = "
        f"{a['fraction_of_binding_limit']:.0%} of the binding limit | whole window: "
        f"{t['200s']} answered, {t['429s']} 429s (wasted calls); runs {res['statuses']}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.flow", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="limits x2, 2 min per phase")
    ap.add_argument("--minutes", type=float, default=None, help="measured minutes per phase")
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--only", choices=("on", "off"), help="run one phase only")
    ap.add_argument("--plot", default=str(ROOT / "docs" / "bench-flow.png"))
    ap.add_argument("--replot", metavar="JSON", help="only draw the plot of a results file")
    args = ap.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        plot(Plan(**saved["plan"]), saved["results"], Path(args.plot))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # a database and a Redis database of its own: flow control's buckets are fleet-wide
    os.environ.setdefault("DAR_BENCH_DB", "dar_bench_flow")
    os.environ.setdefault("DAR_BENCH_REDIS_URL", "redis://127.0.0.1:6379/13")
    plan = Plan.make(quick=args.quick, minutes=args.minutes, runs=args.runs)
    env = prepare()
    results = []
    try:
        for flow in (True, False):
            if args.only and args.only != ("on" if flow else "off"):
                continue
            results.append(phase(env, plan, flow=flow))
            _print(plan, results[-1])
    finally:
        env.close()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"flow-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"plan": plan.__dict__, "results": results}, indent=1))
    print(f"  results: {out}")
    if results:
        plot(plan, results, Path(args.plot))
        print(f"  plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
