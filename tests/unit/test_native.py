"""Tool bodies run on native OS threads, also under gevent: a call blocking in C code (here
libc's ``sleep``, which gevent cannot patch) does not stall the greenlets beside it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime import native

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    from gevent import monkey
    monkey.patch_all()
    import ctypes, sys, time
    import gevent
    from runtime import native

    libc = ctypes.CDLL(None)
    gaps, last = [], [time.monotonic()]

    def tick():
        while True:
            gevent.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last[0])
            last[0] = now

    ticker = gevent.spawn(tick)
    gevent.sleep(0.05)
    if sys.argv[1] == "native":
        future = native.submit(libc.sleep, 2)
        assert native.wait(future, 30), "not done"
        assert future.result() == 0
    else:
        libc.sleep(2)  # on the hub's own thread: what a tool did before
    gevent.sleep(0.05)
    ticker.kill()
    print(f"{max(gaps):.3f} {native.gevent_patched()}")
    """
)


def _max_gap(mode: str) -> tuple[float, str]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return float(out[0]), out[1]


def test_a_call_blocking_in_c_on_the_step_pool_leaves_the_greenlets_running() -> None:
    gap, patched = _max_gap("native")
    assert patched == "True"
    assert gap < 1.0  # ticks every 10 ms throughout the 2 s call (generous for a loaded host)


def test_the_same_call_on_the_hub_stalls_every_greenlet() -> None:
    gap, _ = _max_gap("inline")
    assert gap >= 1.9


def test_without_gevent_the_pool_is_plain_threads() -> None:
    assert not native.gevent_patched()
    future = native.submit(lambda x: x * 2, 21)
    assert native.wait(future, 10)
    assert future.result() == 42
    slow = native.submit(__import__("time").sleep, 0.5)
    assert not native.wait(slow, 0.01)
    assert native.wait(slow, 10)


@pytest.mark.parametrize("timeout", [-1.0, 0.0])
def test_waiting_no_time_only_looks(timeout: float) -> None:
    done = native.submit(int, "7")
    native.wait(done, 10)
    assert native.wait(done, timeout)
