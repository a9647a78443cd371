"""CPU and memory per streamed model call, the runtime's client path against the bare SDK, in
one process each (issue 36: "CPU per streamed call against the bare client").

    python -m bench.streamcpu MODE --url URL --calls N --latency-ms L [--redis-url R]

``MODE``:

- ``bare``: the Anthropic SDK's own streaming (``messages.stream``, its event parsing and
  models), from gevent greenlets, one client for the process (as :mod:`bench.bare_client`);
- ``client``: the runtime's production client stack
  (``RetryingLlmClient(TimeLimitedLlmClient(AnthropicClient))``: its SSE parsing and
  assembly, the per-attempt greenlet and time limit, the retry loop) with no live stream;
- ``live``: the same with what a worker adds around each streamed call: the cancel watch,
  an attempt numbered in Redis and every text delta published to the run's live stream
  (:class:`~runtime.observe.live_channel.LiveChannel` on ``--redis-url``).

Every call is started at once (``--calls`` greenlets) and the process's CPU time is taken
with ``getrusage(RUSAGE_SELF)`` (user + system, every thread) around them: CPU seconds, not
wall time, so the figure hardly moves with the machine's load. Memory per open call: the
process's RSS when all calls are open, less its RSS before, over the calls. Prints one JSON
line. The durable step around a call (claim, replay, checkpoint, the Celery hop) is not here:
``python -m bench realclient`` measures the whole worker.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODEL = "claude-sonnet-4-5"


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (resource.getpagesize() // 1024)


def _bare(args: argparse.Namespace) -> Callable[[int], None]:
    from bench.sdk import bare_sdk_client

    client = bare_sdk_client(args.url, args.latency_ms)

    def one(i: int) -> None:
        text = []
        with client.messages.stream(
            model=MODEL, max_tokens=1024, messages=[{"role": "user", "content": _prompt(args, i)}]
        ) as stream:
            for event in stream:
                if event.type == "text":
                    text.append(event.text)
            stream.get_final_message()

    return one


def _ours(args: argparse.Namespace) -> Callable[[int], None]:
    import contextlib

    from runtime.llm.anthropic import AnthropicClient
    from runtime.llm.base import LlmRequest
    from runtime.llm.live_call import live_call
    from runtime.llm.retry import (
        HTTP_TIMEOUT_MARGIN_SECONDS,
        RetryingLlmClient,
        RetryPolicy,
        TimeLimitedLlmClient,
    )

    limit = args.latency_ms / 1000 * 3 + 60
    llm = RetryingLlmClient(
        TimeLimitedLlmClient(
            AnthropicClient(
                api_key="bench",
                base_url=args.url,
                timeout_seconds=limit + HTTP_TIMEOUT_MARGIN_SECONDS,
            ),
            limit,
        ),
        RetryPolicy(max_attempts=1),
    )
    channel: Any = None
    used: list[uuid.UUID] = []
    from runtime.observe.live_channel import LiveChannel, RedisLiveCall, attempts_key, stream_key

    if args.mode == "live":
        channel = LiveChannel(args.redis_url)

    def one(i: int) -> None:
        request = LlmRequest(
            model=MODEL, max_tokens=1024, messages=[{"role": "user", "content": _prompt(args, i)}]
        )
        if channel is None:
            llm.send(request)
            return
        run_id = uuid.uuid4()
        with channel.watch(run_id, interruptible=True) as watched:
            call = RedisLiveCall(channel, run_id, "model:1", lambda: 0, watched)
            with live_call(call):
                llm.send(request)
        used.append(run_id)

    def cleanup() -> None:
        if channel is not None:
            channel.flush()
            for run_id in used:
                with contextlib.suppress(Exception):
                    channel.redis.delete(stream_key(run_id), attempts_key(run_id))

    one.cleanup = cleanup  # type: ignore[attr-defined]
    return one


def _prompt(args: argparse.Namespace, i: int) -> str:
    return f"bench latency_ms={args.latency_ms} steps=1 run {i}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.streamcpu")
    ap.add_argument("mode", choices=("bare", "client", "live"))
    ap.add_argument("--url", required=True)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--latency-ms", type=int, default=2000)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    ap.add_argument("--profile", default="", help="write a cProfile of the calls here")
    ap.add_argument("--pause", action="store_true", help="say 'ready', wait for a line, measure")
    ap.add_argument(
        "--no-hiredis", action="store_true", help="redis-py's own (Python) protocol code"
    )
    args = ap.parse_args(argv)
    if args.no_hiredis:
        sys.modules["hiredis"] = None  # type: ignore[assignment]  # redis-py: not installed
    from gevent import monkey

    monkey.patch_all()
    import gevent

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    one = _bare(args) if args.mode == "bare" else _ours(args)
    one(-1)  # warm up: imports, the first connection, lazily built SDK models
    errors = 0

    def counted(i: int) -> None:
        nonlocal errors
        try:
            one(i)
        except Exception as e:  # reported, not raised: the figure says how many failed
            errors += 1
            print(f"call {i} failed: {type(e).__name__}: {e}", file=sys.stderr)

    if args.pause:
        print("ready", flush=True)
        sys.stdin.readline()
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    rss0 = _rss_kib()
    cpu0 = _cpu_s()
    t0 = time.monotonic()
    greenlets = [gevent.spawn(counted, i) for i in range(args.calls)]
    gevent.sleep(args.latency_ms / 2000)  # every call open: half way through its answer
    rss_open = _rss_kib()
    gevent.joinall(greenlets)
    cpu = _cpu_s() - cpu0
    elapsed = time.monotonic() - t0
    if prof is not None:
        prof.disable()
        prof.dump_stats(args.profile)
    if hasattr(one, "cleanup"):
        one.cleanup()
    print(
        json.dumps(
            {
                "mode": args.mode,
                "calls": args.calls,
                "errors": errors,
                "cpu_s": cpu,
                "cpu_ms_per_call": cpu * 1000 / args.calls,
                "kib_per_open_call": (rss_open - rss0) / args.calls,
                "elapsed_s": elapsed,
            }
        ),
        flush=True,
    )
    if args.pause:
        sys.stdin.readline()
    return 0


def instructions_per_call(
    mode: str,
    url: str,
    *,
    calls: int = 20,
    latency_ms: int = 1000,
    pythonpath: str = "",
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The same measurement under ``valgrind --tool=callgrind``: instructions executed by the
    process (every thread) while the calls ran, over the calls. Instruction counts do not
    depend on the machine's load (the timing does: a delta window gathers more entries
    when the process runs slower, so the live stream's share is if anything low)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = {**os.environ, "PYTHONPATH": pythonpath or os.environ.get("PYTHONPATH", "")}
        proc = subprocess.Popen(
            [
                "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                sys.executable, "-m", "bench.streamcpu", mode, "--url", url,
                "--calls", str(calls), "--latency-ms", str(latency_ms), "--pause", *extra,
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            text=True,
        )  # fmt: skip
        assert proc.stdin is not None
        assert proc.stdout is not None
        try:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"bench.streamcpu {mode} under callgrind did not start")
            subprocess.run(["callgrind_control", "--zero", str(proc.pid)], check=True,
                           capture_output=True)  # fmt: skip
            proc.stdin.write("go\n")
            proc.stdin.flush()
            result = dict(json.loads(proc.stdout.readline()))
            subprocess.run(["callgrind_control", "--dump", str(proc.pid)], check=True,
                           capture_output=True)  # fmt: skip
            proc.stdin.write("exit\n")
            proc.stdin.flush()
            proc.wait(600)
        finally:
            if proc.poll() is None:
                proc.kill()
        dumps = sorted(Path(tmp).glob("callgrind.out.*"))  # the --dump, then the exit's
        if not dumps:
            raise RuntimeError("callgrind wrote no dump")
        total = next(
            int(line.split()[1])
            for line in dumps[0].read_text(errors="replace").splitlines()
            if line.startswith(("summary:", "totals:"))
        )
    result["instructions_per_call"] = total / calls
    return result


if __name__ == "__main__":
    sys.exit(main())


def _one(
    mode: str, url: str, calls: int, latency_ms: int, extra: tuple[str, ...]
) -> dict[str, Any]:
    proc = subprocess.run(
        [
            sys.executable, "-m", "bench.streamcpu", mode, "--url", url, "--calls", str(calls),
            "--latency-ms", str(latency_ms), *extra,
        ],
        capture_output=True, text=True, timeout=latency_ms / 1000 * 20 + 300, check=False,
    )  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"bench.streamcpu {mode} failed: {proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def compare(
    url: str,
    *,
    calls: int = 200,
    latency_ms: int = 2000,
    repeats: int = 3,
    callgrind: bool = False,
    modes: tuple[str, ...] = ("bare", "client", "live"),
) -> dict[str, Any]:
    """Each mode ``repeats`` times, alternately (so drift in the machine's load touches them
    all), in a fresh process each: the median CPU ms and KiB per call by mode, the ratios to
    the bare SDK, and with ``callgrind`` the instructions per call (20 calls each, once)."""
    import statistics

    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for _ in range(repeats):
        for mode in modes:
            runs[mode].append(_one(mode, url, calls, latency_ms, ()))
    out: dict[str, Any] = {"calls": calls, "latency_ms": latency_ms, "repeats": repeats}
    for mode, rs in runs.items():
        out[mode] = {
            "cpu_ms_per_call": statistics.median(r["cpu_ms_per_call"] for r in rs),
            "cpu_ms_per_call_all": [round(r["cpu_ms_per_call"], 3) for r in rs],
            "kib_per_open_call": statistics.median(r["kib_per_open_call"] for r in rs),
            "errors": sum(r["errors"] for r in rs),
        }
        if callgrind:
            out[mode]["instructions_per_call"] = instructions_per_call(mode, url)[
                "instructions_per_call"
            ]
    bare = out.get("bare")
    if bare:
        for mode in modes:
            for k in ("cpu_ms_per_call", "instructions_per_call"):
                if k in out[mode] and bare.get(k):
                    out[mode][f"{k}_vs_bare"] = out[mode][k] / bare[k]
    return out


LABELS = {
    "bare": "bare Anthropic SDK (messages.stream)",
    "client": "runtime's client (Retrying(TimeLimited(AnthropicClient)))",
    "live": "runtime's client + live stream + cancel watch",
}


def table(res: dict[str, Any]) -> str:
    """The comparison as a Markdown table."""
    lines = [
        f"CPU per streamed call in one gevent process ({res['calls']} calls of "
        f"{res['latency_ms'] / 1000:g} s at once, median of {res['repeats']}; CPU time, "
        "not wall time; the durable step around a call is not in it)",
        "",
        "| who | CPU ms / call | vs bare | instructions / call (callgrind) | vs bare "
        "| KiB / open call |",
        "|---|---|---|---|---|---|",
    ]
    for mode, label in LABELS.items():
        r = res.get(mode)
        if not r:
            continue
        ins = r.get("instructions_per_call")
        ins_s = f"{ins / 1e6:.2f} M" if ins else "-"
        ins_vs = f"{r.get('instructions_per_call_vs_bare', 1):.2f}" if ins else "-"
        lines.append(
            f"| {label} | {r['cpu_ms_per_call']:.2f} | {r.get('cpu_ms_per_call_vs_bare', 1):.2f} "
            f"| {ins_s} | {ins_vs} | {r['kib_per_open_call']:.0f} |"
        )
    return "\n".join(lines)
