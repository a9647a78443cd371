"""DBOS Transact doing the benchmark's workload on the same PostgreSQL database: a workflow
of N trivial durable steps (each step's output checkpointed by DBOS), many workflows at once.

The optional ``bench`` extra installs it (``pip install dbos``). :class:`DbosFleet` starts
one or two processes (``python -m bench.dbos_bench``), each DBOS-launched with its own
executor id; they stay up for a whole section. Each round, every process is sent
``go <workflows> <steps>`` on stdin, all at once, runs its workflows, and answers with the
wall-clock time at which each step body ran. DBOS keeps its tables in the schema ``dbos`` of
the benchmark database.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from typing import IO, Any

from bench.env import RESULTS, ROOT, BenchEnv
from bench.stats import span_rate, summary, window_rate

_times: list[float] = []
_lock = threading.Lock()


def available() -> str | None:
    """DBOS's version when installed, else ``None``."""
    try:
        from importlib.metadata import version

        import dbos  # noqa: F401

        return version("dbos")
    except Exception:
        return None


def _child(url: str, executor: str) -> None:
    from dbos import DBOS

    @DBOS.step()
    def bench_step(i: int) -> dict[str, Any]:
        with _lock:
            _times.append(time.time())
        return {"type": "tool_result", "i": i, "content": "ok"}

    @DBOS.workflow()
    def bench_workflow(n: int) -> int:
        for i in range(n):
            bench_step(i)
        return n

    DBOS(
        config={
            "name": "dar-bench-dbos",
            "system_database_url": url.replace("postgresql+psycopg://", "postgresql://"),
            "executor_id": executor,
            "log_level": "WARNING",
            "sys_db_pool_size": 20,
        }
    )
    DBOS.launch()
    bench_workflow(2)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        parts = line.split()
        if not parts or parts[0] != "go":
            break
        workflows, steps = int(parts[1]), int(parts[2])
        with _lock:
            _times.clear()
        handles = [DBOS.start_workflow(bench_workflow, steps) for _ in range(workflows)]
        for h in handles:
            h.get_result()
        with _lock:
            print(json.dumps({"times": _times}), flush=True)
    DBOS.destroy()


class DbosFleet:
    """``processes`` DBOS processes, kept up between rounds."""

    def __init__(self, env: BenchEnv, processes: int) -> None:
        self.env = env
        self.n = processes
        self.procs: list[subprocess.Popen[bytes]] = []
        self.log: IO[bytes] | None = None

    def start(self) -> DbosFleet:
        (RESULTS / "logs").mkdir(parents=True, exist_ok=True)
        self.log = (RESULTS / "logs" / f"dbos-{self.n}.log").open("ab")
        for i in range(self.n):
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "bench.dbos_bench",
                        self.env.database_url,
                        f"bench-{self.n}-{i}-{int(time.time())}",
                    ],
                    cwd=ROOT,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self.log,
                )
            )
        for p in self.procs:
            assert p.stdout is not None
            if b"ready" not in p.stdout.readline():
                self.stop()
                raise RuntimeError(f"a DBOS process did not start (see {self.log.name})")
        return self

    def round(self, workflows: int, steps: int) -> list[float]:
        """``workflows`` workflows of ``steps`` steps spread over the processes, started
        together; the times of every step body, sorted."""
        per = [workflows // self.n + (1 if i < workflows % self.n else 0) for i in range(self.n)]
        for p, k in zip(self.procs, per, strict=True):
            assert p.stdin is not None
            p.stdin.write(f"go {k} {steps}\n".encode())
            p.stdin.flush()
        times: list[float] = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("a DBOS process died (see bench/results/logs/dbos-*.log)")
            times += json.loads(line)["times"]
        return sorted(times)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write(b"quit\n")
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()
        if self.log is not None:
            self.log.close()

    def __enter__(self) -> DbosFleet:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def reset_schema(env: BenchEnv) -> None:
    """Drop DBOS's schema; the next launch creates it again."""
    from sqlalchemy import text

    with env.engine.begin() as conn:
        conn.execute(text("DROP SCHEMA IF EXISTS dbos CASCADE"))
    with DbosFleet(env, 1) as fleet:  # one process migrates, before two race to
        fleet.round(1, 2)


def dbos_latency(fleet: DbosFleet, steps: int) -> dict[str, Any]:
    """One workflow alone: ms per step, from one step body to the next (the previous
    step's checkpoint is in between)."""
    lat = fleet.round(1, steps)
    gaps = [(b - a) * 1000 for a, b in itertools.pairwise(lat)]
    return {"steps": steps, "ms_per_step": summary(gaps)}


def dbos_throughput(fleet: DbosFleet, workflows: int, steps: int) -> dict[str, float]:
    """``workflows`` workflows at once: steps/s in the steady window, and from the start to
    the last step."""
    t0 = time.time()
    times = fleet.round(workflows, steps)
    return {"steps_per_s": window_rate(times), "span_steps_per_s": span_rate(t0, times)}


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
