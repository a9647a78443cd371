"""``python -m bench.streams [--streams 1000] [--submits 100]``: open event streams against the
Procfile's web process (gunicorn, gevent worker) while the API answers submits.

Starts ``web`` exactly as the Procfile does, on its own database (``DAR_BENCH_DB``, default
``dar_bench_streams``) and a queue nobody consumes; submits a few runs that never move (idle
streams, the expensive case for a thread-per-request server); opens ``--streams``
``GET /api/runs/{id}/events`` connections and keeps them open; times ``POST /api/runs``
before and while they are open; checks the streams are all still open (each got its
headers and first line) and reports the web process's memory. Prints figures; asserts
nothing about time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench.env import ROOT, prepare
from cli.embedded import free_port

RUNS = 10


def _procfile_web() -> str:
    for line in (ROOT / "Procfile").read_text().splitlines():
        if line.startswith("web:"):
            return line.split(":", 1)[1].strip()
    raise SystemExit("Procfile has no web process")


def _submit(port: int) -> tuple[float, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"input": "bench: which tickets are overdue?"})
    started = time.perf_counter()
    conn.request("POST", "/api/runs", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read())
    took = time.perf_counter() - started
    conn.close()
    if resp.status not in (200, 201):
        raise SystemExit(f"submit answered {resp.status}: {data}")
    return took, str(data["id"])


def _latencies(port: int, n: int) -> list[float]:
    return [_submit(port)[0] * 1000 for _ in range(n)]


def _open_stream(port: int, run_id: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        f"GET /api/runs/{run_id}/events HTTP/1.1\r\nHost: bench\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    head = b""
    while b"retry:" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise RuntimeError("stream closed before its first line")
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(head[:200].decode(errors="replace"))
    return sock


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return True  # nothing to read and not closed
    except OSError:
        return False
    finally:
        sock.setblocking(True)
    return bool(data)  # a heartbeat; b"" would be the server closing


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and its children (gunicorn's worker), in MB."""
    total = 0
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__)
    ap.add_argument("--streams", type=int, default=1000)
    ap.add_argument("--submits", type=int, default=100)
    args = ap.parse_args(argv)
    os.environ.setdefault("DAR_BENCH_DB", "dar_bench_streams")
    env = prepare()
    env.truncate()
    port = free_port()
    queue = f"dar-bench-streams-{uuid.uuid4().hex[:8]}"
    web_env = {
        **os.environ,
        "PORT": str(port),
        "DATABASE_URL": env.database_url,
        "REDIS_URL": env.redis_url,
        "DAR_QUEUE": queue,
        "ANTHROPIC_API_KEY": "",
        "DAR_LOG_LEVEL": "WARNING",
        "WEB_CONNECTIONS": str(args.streams + 200),
    }
    web_env.pop("DAR_API_TOKENS", None)
    log = open(os.devnull, "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        ["sh", "-c", "exec " + _procfile_web()], env=web_env, cwd=ROOT, stdout=log, stderr=log
    )
    socks: list[socket.socket] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/healthz")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit("web did not start") from None
                time.sleep(0.2)
        runs = [_submit(port)[1] for _ in range(RUNS)]
        _latencies(port, 10)  # warm up
        idle = _latencies(port, args.submits)
        rss_idle = _rss_mb(proc.pid)
        opened = time.perf_counter()
        for i in range(args.streams):
            socks.append(_open_stream(port, runs[i % RUNS]))
        open_s = time.perf_counter() - opened
        time.sleep(2)  # every stream through at least one poll of the hub
        loaded = _latencies(port, args.submits)
        rss_loaded = _rss_mb(proc.pid)
        alive = sum(_still_open(s) for s in socks)
        print(f"event streams against the Procfile web process ({sys.platform}, gevent worker)")
        print(f"  streams opened              {len(socks)} in {open_s:.1f} s; still open: {alive}")
        for label, lat in (("submit, no streams", idle), (f"submit, {len(socks)} open", loaded)):
            print(
                f"  {label:<27} p50 {statistics.median(lat):6.1f} ms   "
                f"p95 {_pct(lat, 0.95):6.1f} ms   max {max(lat):6.1f} ms   (n={len(lat)})"
            )
        per_stream = (rss_loaded - rss_idle) * 1024 / max(1, len(socks))
        print(
            f"  web RSS                     {rss_idle:.0f} MB idle, {rss_loaded:.0f} MB with "
            f"the streams (~{per_stream:.0f} KB per stream)"
        )
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        env.reset_redis([queue])
        env.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
