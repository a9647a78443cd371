"""(f) Runs in flight through the real model clients, as shipped (issue 36).

Everything goes over HTTP to :mod:`bench.fake_llm`, started here in a process of its own: the
runtime's runs through the production client (``Retrying(TimeLimited(AnthropicClient))``,
the official SDK), streamed and not, a Pydantic AI agent and an OpenAI Agents SDK agent; the
worker exactly as the Procfile ships it (``WORKER_POOL``, ``WORKER_CONCURRENCY``, no tuning),
2 processes. Beside each, in the same section, the bare client (:mod:`bench.bare_client`:
the same SDK making the same calls from plain greenlets or asyncio tasks, no runtime): the
host's ceiling for that many calls. And DBOS Transact (:mod:`bench.dbos_llm`) on the same
workload, the same SDK client and the same fake.

The fake counts the calls open at once (``peak_open``); every run is submitted evenly over
one model latency, so the ideal is ``latency x (steps + 1)`` from the first submit to the last
answer. ``ratio_to_ceiling`` is the runtime's call rate over min(ideal rate, bare-client
rate). Memory per open call: the processes' RSS when most calls were open, less their RSS
before the first submit, over the calls open then. CPU per call: the processes' CPU time
(user + system of every thread, from /proc: not wall time) over the calls made
(PostgreSQL's and the fake's apart); ``cpu_vs_bare`` the runtime's over the bare client's of
the same run. And :mod:`bench.streamcpu`: CPU per streamed call of the runtime's client path
(with and without the live stream) against the bare SDK, one process each, without the
durable step around it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

import psutil

from bench.cpu import CpuMeter
from bench.env import RESULTS, ROOT, BenchEnv
from bench.stack import RuntimeFleet, log_file
from db.records import NewRun
from runtime.config import WORKER_CONCURRENCY, WORKER_POOL, Settings
from tasks.dispatch import send_drive

MODEL = "claude-sonnet-4-5"
WORKERS = 2


@dataclass(frozen=True)
class Level:
    """One workload: ``runs`` runs of ``steps`` model calls of ``latency_ms`` each."""

    runs: int
    steps: int
    latency_ms: int

    @classmethod
    def parse(cls, raw: str) -> Level:
        """``RUNSxSTEPSxLATENCY_MS``, e.g. ``2000x3x10000``."""
        runs, steps, latency = (int(x) for x in raw.lower().split("x"))
        return cls(runs, steps, latency)

    @property
    def ideal_s(self) -> float:
        return self.latency_ms / 1000 * (self.steps + 1)

    def label(self) -> str:
        return f"{self.runs} runs x {self.steps} calls of {self.latency_ms / 1000:g} s"


def no_stream_client(settings: Settings) -> Any:
    """``DAR_LLM_FACTORY=bench.realclient:no_stream_client``: the production stack with the
    Messages API not streamed (``AnthropicClient(stream=False)``)."""
    from runtime.llm.anthropic import AnthropicClient
    from runtime.llm.retry import (
        HTTP_TIMEOUT_MARGIN_SECONDS,
        RetryingLlmClient,
        RetryPolicy,
        TimeLimitedLlmClient,
    )

    timeout = settings.model_timeout_seconds
    http = AnthropicClient(
        api_key=settings.anthropic_api_key,
        base_url=settings.anthropic_base_url,
        timeout_seconds=timeout + HTTP_TIMEOUT_MARGIN_SECONDS,
        stream=False,
    )
    return RetryingLlmClient(
        TimeLimitedLlmClient(http, timeout),
        RetryPolicy(
            max_attempts=settings.retry_max_attempts,
            base=settings.retry_base_seconds,
            cap=settings.retry_cap_seconds,
            long_wait_threshold=settings.long_wait_seconds,
        ),
    )


# -- the fake API ---------------------------------------------------------------------------


class FakeApi:
    """``python -m bench.fake_llm`` in a process of its own."""

    def __init__(self, tokens: int = 300, delta_tokens: int = 5) -> None:
        self.tokens = tokens
        self.delta_tokens = delta_tokens
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""

    def __enter__(self) -> FakeApi:
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "bench.fake_llm", "--port", "0",
                "--tokens", str(self.tokens), "--delta-tokens", str(self.delta_tokens),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("listening"):
            raise RuntimeError(f"bench.fake_llm did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _call(self, method: str, path: str) -> dict[str, int]:
        req = urllib.request.Request(
            self.url + path, method=method, data=b"" if method == "POST" else None
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return dict(json.loads(r.read()))

    def stats(self) -> dict[str, int]:
        return self._call("GET", "/stats")

    def reset(self) -> dict[str, int]:
        return self._call("POST", "/stats/reset")


# -- measuring ----------------------------------------------------------------------------


def _rss(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            total += psutil.Process(pid).memory_info().rss
    return total / 2**20


def _cpu_s(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


@contextlib.contextmanager
def measured(fake: FakeApi, pids: Callable[[], list[int]], out: dict[str, Any]) -> Iterator[None]:
    """Samples the fake's open calls and the processes' RSS every 0.5 s while the block
    runs; CPU of the processes, PostgreSQL and the fake over the block."""
    fake.reset()
    time.sleep(0.5)
    rss0 = _rss(pids())
    stop = threading.Event()
    samples: list[tuple[int, float]] = []

    def sample() -> None:
        while not stop.wait(0.5):
            with contextlib.suppress(Exception):
                samples.append((fake.stats()["open"], _rss(pids())))

    sampler = threading.Thread(target=sample, daemon=True)
    meter = CpuMeter(pids()).start()
    fake_cpu0 = _cpu_s(fake.pid)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        cpu = meter.stop()
        stats = fake.stats()
        top = max(samples, default=(0, rss0))
        calls = max(1, stats["answered"])
        out.update(
            peak_open=stats["peak"],
            calls=stats["answered"],
            aborted=stats["aborted"],
            rss_before_mib=rss0,
            rss_at_most_open_mib=top[1],
            open_when_sampled=top[0],
            kib_per_open_call=(top[1] - rss0) * 1024 / top[0] if top[0] else math.nan,
            cpu_ms_per_call=cpu["workers"] * 1000 / calls,
            postgres_cpu_ms_per_call=cpu["postgres"] * 1000 / calls,
            fake_cpu_ms_per_call=(_cpu_s(fake.pid) - fake_cpu0) * 1000 / calls,
            machine_busy_cpu_s=cpu["machine_busy"],
        )


def _finish(out: dict[str, Any], level: Level) -> dict[str, Any]:
    out.update(
        runs=level.runs,
        steps=level.steps,
        latency_ms=level.latency_ms,
        ideal_s=level.ideal_s,
        ratio_to_ideal=level.ideal_s / out["elapsed_s"] if out.get("elapsed_s") else math.nan,
    )
    return out


# -- the runtime --------------------------------------------------------------------------


def _fleet_env(fake: FakeApi, llm_factory: str) -> dict[str, str]:
    return {
        "ANTHROPIC_BASE_URL": fake.url,
        "ANTHROPIC_API_KEY": "bench",
        "OPENAI_BASE_URL": fake.url + "/v1",
        "OPENAI_API_KEY": "bench",
        "OPENAI_AGENTS_DISABLE_TRACING": "1",
        "DAR_AGENT_MODULES": "bench.agents,bench.real_agents",
        "DAR_LLM_FACTORY": llm_factory,
        "DAR_LOG_LEVEL": os.environ.get("BENCH_WORKER_LOG_LEVEL", "WARNING"),
    }


def runtime_level(
    env: BenchEnv, fleet: RuntimeFleet, fake: FakeApi, level: Level, agent: str
) -> dict[str, Any]:
    env.truncate()
    out: dict[str, Any] = {"agent": agent}
    spread = level.latency_ms / 1000
    with measured(fake, lambda: list(fleet.pids().values()), out):
        t0 = time.time()
        ids: list[uuid.UUID] = []
        for i in range(level.runs):
            time.sleep(max(0.0, t0 + spread * i / level.runs - time.time()))
            run, _ = env.store.create_run(
                NewRun(
                    agent=agent,
                    input=f"bench latency_ms={level.latency_ms} steps={level.steps} run {i}",
                    model=MODEL,
                    max_steps=1000,
                    token_budget=1_000_000_000,
                    timeout_seconds=3600,
                )
            )
            from db.records import Dispatch

            send_drive(fleet.app, env.store, Dispatch(run.id, run.dispatch_token))
            ids.append(run.id)
        out["submit_s"] = time.time() - t0
        out["statuses"] = env.wait_terminal(
            ids, timeout=level.ideal_s * 10 + 300, poll=1.0, stall=120
        )
        rows = env.run_rows(ids)
        out["elapsed_s"] = max(float(r["finished"] or 0) for r in rows) - t0
    out["all_succeeded"] = out["statuses"].get("SUCCEEDED", 0) == level.runs
    return _finish(out, level)


# -- the bare client and DBOS ---------------------------------------------------------------


def _child_level(
    fake: FakeApi, level: Level, argv: list[str], name: str, extra_env: dict[str, str]
) -> dict[str, Any]:
    log: IO[bytes] = log_file(name)
    env = {**os.environ, **extra_env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        if b"ready" not in proc.stdout.readline():
            raise RuntimeError(f"{name} did not start (see {log.name})")
        out: dict[str, Any] = {}
        with measured(fake, lambda: [proc.pid], out):
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{name} died (see {log.name})")
            out.update(json.loads(line))
        out["all_succeeded"] = out.get("errors", 1) == 0
        return _finish(out, level)
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def bare_level(fake: FakeApi, level: Level, kind: str, *, stream: bool = True) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "bench.bare_client", kind, "--url", fake.url,
        "--runs", str(level.runs), "--steps", str(level.steps),
        "--latency-ms", str(level.latency_ms),
    ]  # fmt: skip
    if not stream:
        argv.append("--no-stream")
    return _child_level(fake, level, argv, f"bare-{kind}", _fleet_env(fake, ""))


def dbos_level(env: BenchEnv, fake: FakeApi, level: Level) -> dict[str, Any]:
    from sqlalchemy import text

    with env.engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS dbos CASCADE"))
    argv = [
        sys.executable, "-m", "bench.dbos_llm", env.database_url, f"bench-llm-{int(time.time())}",
        "--url", fake.url, "--runs", str(level.runs), "--steps", str(level.steps),
        "--latency-ms", str(level.latency_ms),
    ]  # fmt: skip
    return _child_level(fake, level, argv, "dbos-llm", {})


# -- the section ---------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ceiling(rt: dict[str, Any], bare: dict[str, Any]) -> None:
    """The runtime against min(ideal, bare client): the slower of the two sets the pace."""
    floor_s = max(rt["ideal_s"], bare.get("elapsed_s") or rt["ideal_s"])
    rt["bare_elapsed_s"] = bare.get("elapsed_s")
    rt["ratio_to_ceiling"] = floor_s / rt["elapsed_s"] if rt.get("elapsed_s") else math.nan
    # CPU time (not wall time) per call, each side's own processes, same run: ours over bare
    rt["bare_cpu_ms_per_call"] = bare.get("cpu_ms_per_call")
    rt["cpu_vs_bare"] = (
        rt["cpu_ms_per_call"] / bare["cpu_ms_per_call"] if bare.get("cpu_ms_per_call") else math.nan
    )
    rt["bare_kib_per_open_call"] = bare.get("kib_per_open_call")


def section_realclient(
    env: BenchEnv,
    levels: tuple[Level, ...],
    framework_level: Level | None,
    *,
    dbos: bool,
    no_stream: bool = True,
    stream_cpu: tuple[int, int] | None = (200, 2000),
    callgrind: bool = False,
) -> dict[str, Any]:
    """The figures listed in the module docstring, for each level (the first is also run
    unstreamed, by the frameworks' agents at ``framework_level``, and on DBOS); with
    ``stream_cpu`` (calls, latency ms), CPU per streamed call of the runtime's client path
    against the bare SDK, one process each (:mod:`bench.streamcpu`; with ``callgrind`` also
    instructions per call)."""
    from bench.dbos_bench import available as dbos_available

    out: dict[str, Any] = {
        "workers": WORKERS,
        "pool": WORKER_POOL,
        "concurrency": WORKER_CONCURRENCY,
        "rows": [],
    }
    rows: list[dict[str, Any]] = out["rows"]
    env.truncate()  # runs left by an interrupted bench would be driven beside the baseline
    env.reset_redis()
    with FakeApi() as fake:
        with RuntimeFleet(
            env,
            workers=WORKERS,
            concurrency=WORKER_CONCURRENCY,
            pool=WORKER_POOL,
            name="realclient",
            extra_env=_fleet_env(fake, ""),
        ) as fleet:
            for level in levels:
                _log(f"real client: bare SDK, streamed, {level.label()}")
                bare = bare_level(fake, level, "anthropic")
                _log(f"real client: runtime, streamed, {level.label()}")
                rt = runtime_level(env, fleet, fake, level, "bench")
                _ceiling(rt, bare)
                rows += [
                    {"who": "bare anthropic SDK (gevent)", "stream": True, **bare},
                    {"who": "runtime (Anthropic client)", "stream": True, **rt},
                ]
                _log(f"  -> {_brief(rt)}; bare {_brief(bare)}")
            if stream_cpu is not None:
                from bench import streamcpu

                calls, latency_ms = stream_cpu
                _log(f"CPU per streamed call, one process: {calls} x {latency_ms} ms, bare/ours")
                out["stream_cpu"] = streamcpu.compare(
                    fake.url, calls=calls, latency_ms=latency_ms, callgrind=callgrind
                )
                _log("  -> " + streamcpu.table(out["stream_cpu"]).replace("\n", "\n     "))
            if framework_level is not None:
                for kind, agent in (("pydantic-ai", "bench-pai"), ("openai-agents", "bench-oai")):
                    _log(f"real client: bare {kind}, {framework_level.label()}")
                    bare = bare_level(fake, framework_level, kind)
                    _log(f"real client: runtime, {agent}, {framework_level.label()}")
                    rt = runtime_level(env, fleet, fake, framework_level, agent)
                    _ceiling(rt, bare)
                    rows += [
                        {"who": f"bare {kind} (asyncio)", "stream": True, **bare},
                        {"who": f"runtime ({kind} agent)", "stream": True, **rt},
                    ]
                    _log(f"  -> {_brief(rt)}; bare {_brief(bare)}")
        if no_stream:
            level = levels[0]
            env.reset_redis()
            with RuntimeFleet(
                env,
                workers=WORKERS,
                concurrency=WORKER_CONCURRENCY,
                pool=WORKER_POOL,
                name="realclient-nostream",
                extra_env=_fleet_env(fake, "bench.realclient:no_stream_client"),
            ) as fleet:
                _log(f"real client: bare SDK, not streamed, {level.label()}")
                bare = bare_level(fake, level, "anthropic", stream=False)
                _log(f"real client: runtime, not streamed, {level.label()}")
                rt = runtime_level(env, fleet, fake, level, "bench")
                _ceiling(rt, bare)
                rows += [
                    {"who": "bare anthropic SDK (gevent)", "stream": False, **bare},
                    {"who": "runtime (Anthropic client)", "stream": False, **rt},
                ]
                _log(f"  -> {_brief(rt)}; bare {_brief(bare)}")
        if dbos and dbos_available():
            level = levels[0]
            _log(f"real client: DBOS Transact, streamed, {level.label()}")
            d = dbos_level(env, fake, level)
            rows.append({"who": "DBOS Transact (threads)", "stream": True, **d})
            _log(f"  -> {_brief(d)}")
    return out


def _brief(r: dict[str, Any]) -> str:
    return (
        f"{r.get('elapsed_s', math.nan):.1f} s (ideal {r['ideal_s']:.0f}), "
        f"peak {r['peak_open']} open, {r['calls']} calls, "
        f"{r['cpu_ms_per_call']:.1f} ms CPU/call, {r['kib_per_open_call']:.0f} KiB/open call, "
        f"ok={r.get('all_succeeded')}"
    )


def table(section: dict[str, Any]) -> str:
    """The section as a Markdown table."""
    head = (
        "| who | stream | runs x calls x latency | calls open at once (peak) | end (s) | ideal (s) "
        "| vs ideal | vs min(ideal, bare) | CPU ms/call | CPU vs bare | PG CPU ms/call "
        "| KiB/open call | all ok |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in section["rows"]:
        lines.append(
            f"| {r['who']} | {'yes' if r['stream'] else 'no'} "
            f"| {r['runs']:,} x {r['steps']} x {r['latency_ms'] / 1000:g} s "
            f"| {r['peak_open']:,} | {r.get('elapsed_s', math.nan):.1f} | {r['ideal_s']:.0f} "
            f"| {r['ratio_to_ideal']:.2f} | {r.get('ratio_to_ceiling', math.nan):.2f} "
            f"| {r['cpu_ms_per_call']:.1f} | {r.get('cpu_vs_bare', math.nan):.2f} "
            f"| {r['postgres_cpu_ms_per_call']:.1f} "
            f"| {r['kib_per_open_call']:.0f} | {r.get('all_succeeded')} |"
        )
    if section.get("stream_cpu"):
        from bench import streamcpu

        lines += ["", streamcpu.table(section["stream_cpu"])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.realclient [--level RUNSxSTEPSxMS ...] [--frameworks RUNSxSTEPSxMS]
    [--no-dbos] [--no-unstreamed]``: this section alone (``python -m bench realclient`` runs
    it inside the suite)."""
    import argparse

    from bench.env import prepare

    ap = argparse.ArgumentParser(prog="python -m bench.realclient")
    ap.add_argument("--level", action="append", default=None, help="RUNSxSTEPSxLATENCY_MS")
    ap.add_argument("--frameworks", default="200x1x10000", help="RUNSxSTEPSxMS, or 'none'")
    ap.add_argument("--no-dbos", action="store_true")
    ap.add_argument("--no-unstreamed", action="store_true")
    ap.add_argument(
        "--stream-cpu",
        default="200x2000",
        help="CALLSxMS: CPU per streamed call, ours vs the bare SDK, one process each; 'none'",
    )
    ap.add_argument("--callgrind", action="store_true", help="also instructions per call")
    args = ap.parse_args(argv)
    levels = tuple(Level.parse(x) for x in (args.level or ["2000x3x10000"]))
    fw = None if args.frameworks == "none" else Level.parse(args.frameworks)
    env = prepare()
    try:
        sc = None if args.stream_cpu == "none" else Level.parse(f"0x{args.stream_cpu}")
        res = section_realclient(
            env,
            levels,
            fw,
            dbos=not args.no_dbos,
            no_stream=not args.no_unstreamed,
            stream_cpu=(sc.steps, sc.latency_ms) if sc else None,
            callgrind=args.callgrind,
        )
    finally:
        env.close()
    res["loadavg_end"] = os.getloadavg()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"realclient-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(res, indent=1, default=str))
    print(table(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
