"""Where the CPU went during a measurement: utime+stime of the worker processes, of
PostgreSQL's backends, of redis-server, of this bench process, and of everything else on the
machine (other people's tests, for instance), from /proc (Linux). Dividing by the steps
measured gives CPU milliseconds per step by component."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _proc_times() -> dict[int, tuple[str, float]]:
    out: dict[int, tuple[str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            raw = (d / "stat").read_text()
            comm = raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2 :].split()
            # fields[11], fields[12] = utime, stime (stat fields 14 and 15)
            out[int(d.name)] = (comm, (int(fields[11]) + int(fields[12])) / TICK)
    return out


def _machine_busy() -> float:
    parts = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    vals = [int(x) for x in parts]
    idle = vals[3] + vals[4]
    return (sum(vals) - idle) / TICK


@dataclass
class CpuMeter:
    """``start()`` then ``stop()``; CPU seconds by component in between."""

    worker_pids: Iterable[int] = ()
    _t0: dict[int, tuple[str, float]] = field(default_factory=dict)
    _busy0: float = 0.0
    result: dict[str, float] = field(default_factory=dict)

    def start(self) -> CpuMeter:
        self._t0 = _proc_times()
        self._busy0 = _machine_busy()
        return self

    def stop(self) -> dict[str, float]:
        t1 = _proc_times()
        busy = _machine_busy() - self._busy0
        workers = set(self.worker_pids)
        me = os.getpid()
        acc = {"workers": 0.0, "postgres": 0.0, "redis": 0.0, "bench": 0.0, "other": 0.0}
        for pid, (comm, cpu) in t1.items():
            before = self._t0.get(pid, (comm, 0.0))[1]
            d = max(0.0, cpu - before)
            if pid in workers:
                acc["workers"] += d
            elif comm == "postgres":
                acc["postgres"] += d
            elif comm.startswith("redis-server"):
                acc["redis"] += d
            elif pid == me:
                acc["bench"] += d
            else:
                acc["other"] += d
        acc["machine_busy"] = busy
        self.result = acc
        return acc


def per_step_ms(cpu: dict[str, float], steps: int) -> dict[str, float]:
    return {k: (v * 1000 / steps if steps else float("nan")) for k, v in cpu.items()}
