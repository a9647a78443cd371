"""The table: every figure with its baseline, the ratio, and the target it is read against
(targets are reported, never asserted)."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.env import RESULTS, ROOT
from runtime.config import Settings

# The reference figures of issue 7, measured on some 2-core machine: used only to show how
# fast this machine runs the baselines compared with that one.
REFERENCE = {
    "hop_ms": 2.5,
    "hop_steps_per_s_2": 440.0,
    "dbos_ms": 3.6,
    "dbos_steps_per_s_1": 260.0,
    "dbos_steps_per_s_2": 370.0,
}


def _f(x: Any, nd: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _ratio(a: Any, b: Any) -> float:
    try:
        return float(a) / float(b) if b else math.nan
    except (TypeError, ValueError):
        return math.nan


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("meets" if ok else "MISSES")


def rows(sections: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def add(
        fig: str,
        measure: str,
        value: Any,
        base_name: str,
        base: Any,
        target: str = "",
        ok: bool | None = None,
        ratio: Any = None,
        nd: int = 1,
    ) -> None:
        r = ratio if ratio is not None else _ratio(value, base)
        out.append(
            {
                "fig": fig,
                "measure": measure,
                "value": value,
                "baseline": base_name,
                "baseline_value": base,
                "ratio": r,
                "target": target,
                "verdict": _verdict(ok),
                "nd": nd,
            }
        )

    lat = sections.get("latency")
    if lat:
        dbos = lat.get("dbos_p50_ms")
        p50 = lat["runtime_p50_ms"]
        # Target 1 (issue 13): <= 1.3x the bare hop with its checkpoint; DBOS, which takes no
        # broker hop at all, is printed beside it as the reference.
        add(
            "a",
            "step overhead p50, ms",
            p50,
            "bare hop p50",
            lat["hop_p50_ms"],
            "<= 1.3 x hop",
            lat["ratio_to_hop_p50"] <= 1.3,
            ratio=lat["ratio_to_hop_p50"],
        )
        if dbos:
            add(
                "a",
                "step overhead p50, ms",
                p50,
                "DBOS p50 (reference)",
                dbos,
                ratio=lat["ratio_to_dbos_p50"],
            )
        add("a", "step overhead p99, ms", lat["runtime_p99_ms"], "bare hop p99", lat["hop_p99_ms"])
        if lat.get("dbos_p99_ms"):
            add("a", "step overhead p99, ms", lat["runtime_p99_ms"], "DBOS p99", lat["dbos_p99_ms"])
        calls = lat.get("db_calls_per_step") or {}
        hop_rt = (lat.get("hop_db_calls_per_step") or {}).get("round_trips")
        for kind in ("MODEL", "TOOL"):
            if kind in calls:
                add(
                    "a",
                    f"DB round trips per {kind.lower()} step ({calls[kind]['commits']:.1f} "
                    f"tx, {calls[kind]['checkouts']:.1f} pings)",
                    calls[kind]["round_trips"],
                    "bare hop",
                    hop_rt,
                )
        ip = lat["inproc"]["ms_per_step"]["p50"]
        add(
            "a",
            "in-process driver p50, ms (no hop)",
            ip,
            "raw checkpoint p50",
            lat["raw_checkpoint_p50_ms"],
        )

    tp = sections.get("throughput")
    if tp:
        for n, row in tp["by_processes"].items():
            n = int(n)
            v = row["runtime_steps_per_s"]
            # The targets are judged from the first submit to the last end (the span rows).
            target, ok = "", None
            add(
                "b",
                f"steps/s, {n} proc, {tp['runs']} runs",
                v,
                f"bare hop {n} proc",
                row["hop_steps_per_s"],
                target,
                ok,
                ratio=row["ratio_to_hop"],
                nd=0,
            )
            if "dbos_steps_per_s" in row:
                t2, ok2 = "", None
                add(
                    "b",
                    f"steps/s, {n} proc, {tp['runs']} runs",
                    v,
                    f"DBOS {n} proc",
                    row["dbos_steps_per_s"],
                    t2,
                    ok2,
                    ratio=row["ratio_to_dbos"],
                    nd=0,
                )
            if row.get("span_steps_per_s"):
                # From the first submit to the last run's end: stalls and stragglers count.
                add(
                    "b",
                    f"  same, first submit to last end, {n} proc",
                    row["span_steps_per_s"],
                    f"bare hop {n} proc, same",
                    row["hop_span_steps_per_s"],
                    ">= 0.80 x hop" if n == 2 else "",
                    (row["span_steps_per_s"] >= 0.8 * row["hop_span_steps_per_s"])
                    if n == 2
                    else None,
                    nd=0,
                )
                if row.get("dbos_span_steps_per_s"):
                    add(
                        "b",
                        f"  same, first submit to last end, {n} proc",
                        row["span_steps_per_s"],
                        f"DBOS {n} proc, same",
                        row["dbos_span_steps_per_s"],
                        ">= DBOS" if n == 2 else "",
                        (row["span_steps_per_s"] >= row["dbos_span_steps_per_s"])
                        if n == 2
                        else None,
                        nd=0,
                    )
            floor = row.get("broker_floor_steps_per_s")
            if floor and "dbos_steps_per_s" in row:
                # The broker alone, no database: the ceiling of any step handed on through it.
                add(
                    "b",
                    f"broker floor: bare hop without PostgreSQL, {n} proc",
                    floor,
                    f"DBOS {n} proc",
                    row["dbos_steps_per_s"],
                    "",
                    None,
                    ratio=floor / row["dbos_steps_per_s"],
                    nd=0,
                )

    shipped = sections.get("defaults")
    if shipped:
        for lv in shipped["levels"]:
            add(
                "c",
                f"steps/s, {lv['runs']} in flight, {lv['model_latency_ms']} ms model, SHIPPED "
                f"defaults (--pool {shipped['pool']} --concurrency {shipped['concurrency']})",
                lv["steps_per_s"],
                "ideal in_flight/latency",
                lv["ideal_steps_per_s"],
                ">= 0.90 x ideal",
                lv["ratio_to_ideal"] >= 0.9,
                nd=0,
            )
        alone = next((b for b in shipped["blocking"] if b["label"] == "alone"), None)
        for b in shipped["blocking"]:
            add(
                "c",
                f"steps/s, {b['runs']} model calls of {b['model_latency_ms']} ms, {b['label']}",
                b["steps_per_s"],
                "the same alone" if alone is not None and b is not alone else "ideal",
                alone["steps_per_s"]
                if alone is not None and b is not alone
                else b["ideal_steps_per_s"],
                nd=0,
            )
            add(
                "c",
                f"  model call returned late, p50 / p99 ms, {b['label']}",
                b["model_stretch_ms"].get("p50"),
                "p99",
                b["model_stretch_ms"].get("p99"),
                nd=0,
            )
    inf = sections.get("inflight")
    if inf:
        hop2 = ((tp or {}).get("by_processes") or {}).get(2) or (
            (tp or {}).get("by_processes") or {}
        ).get("2")
        # Target 3: >= 90% of ideal for 2,000 runs with a 10 s model, and with a 1 s model
        # up to 0.8x the bare hop's rate (2 processes); a level whose ideal rate is above
        # that asks more of the host than the broker's own floor and is shown unjudged.
        cap = 0.8 * hop2["hop_steps_per_s"] if hop2 else None
        for lv in inf["levels"]:
            judged = (lv["runs"] >= 2000 and lv["model_latency_ms"] >= 10_000) or (
                cap is not None and lv["ideal_steps_per_s"] <= cap
            )
            add(
                "c",
                f"steps/s, {lv['runs']} in flight, {lv['model_latency_ms']} ms model, "
                f"{lv.get('pool', 'threads')}",
                lv["steps_per_s"],
                "ideal in_flight/latency",
                lv["ideal_steps_per_s"],
                ">= 0.90 x ideal" if judged else "(above 0.8x hop)" if cap is not None else "",
                (lv["ratio_to_ideal"] >= 0.9) if judged else None,
                nd=0,
            )
            if "window_steps_per_s" in lv:
                add(
                    "c",
                    f"  same, commits/s in the 5-95% window, {lv['runs']} in flight",
                    lv["window_steps_per_s"],
                    "ideal in_flight/latency",
                    lv["ideal_steps_per_s"],
                    nd=0,
                )
            add(
                "c",
                f"leases held (runs in a step), {lv['runs']} submitted, "
                f"{lv.get('pool', 'threads')}",
                lv["leases_held_median"],
                "runs submitted",
                lv["runs"],
                nd=0,
            )
        add(
            "c",
            "largest level tested at >= 90% of ideal, runs in flight",
            inf["largest_level_at_90pct"],
            "target",
            2000,
            ">= 2000",
            (inf["largest_level_at_90pct"] or 0) >= 2000,
            nd=0,
        )
        big = [lv for lv in inf["levels"] if lv["runs"] >= 500]
        if hop2 and big:
            add(
                "c",
                "host ceiling: bare hop steps/s, 2 proc (from b)",
                hop2["hop_steps_per_s"],
                "ideal for 500 in flight",
                big[0]["ideal_steps_per_s"],
                nd=0,
            )
        for lv in inf["levels"]:
            mib = max((lv["connections"].get("rss_mib_max") or {}).values(), default=None)
            if mib is not None and lv["runs"] >= 2000:
                add(
                    "c",
                    f"resident memory per worker process, max, {lv['runs']} in flight, MiB",
                    mib,
                    "limit",
                    1024,
                    "<= 1024",
                    mib <= 1024,
                    nd=0,
                )
        m = inf["max_connections_per_process"]
        add(
            "c",
            "DB connections per worker process, max",
            m,
            "limit",
            20,
            "<= 20",
            m is not None and m <= 20,
            nd=0,
        )

    rp = sections.get("replay")
    if rp:
        add(
            "d",
            f"ms/step at steps {rp['steps_per_run'] - 9}-{rp['steps_per_run']}",
            rp["last_steps_ms_p50"],
            "steps 2-11 (next run)",
            rp["first_steps_ms_p50"],
            "<= 1.2 x",
            rp["ratio"] <= 1.2,
            ratio=rp["ratio"],
        )
        ph = rp.get("inproc_phases_p50") or {}
        if "read_steps" in ph.get("last", {}):
            add(
                "d",
                "store.steps() (read every step), in-process, ms",
                ph["last"]["read_steps"],
                "at steps 2-11",
                ph["first"]["read_steps"],
            )
        rv = rp.get("read_variants_ms") or {}
        if rv:
            base = rv["store.steps()"]
            for key in ("only the columns replay uses", "only the last 5 rows (seq > last - 5)"):
                add("d", f"read {int(rv['rows'])} steps: {key}, ms", rv[key], "store.steps()", base)
        add(
            "d",
            "same, in-process driver",
            rp["inproc_last_ms"],
            "steps 2-11 in-process",
            rp["inproc_first_ms"],
        )

    rc = sections.get("recovery")
    if rc:
        for c in rc["configs"]:
            lease = float(c["settings"].get("DAR_LEASE_SECONDS", Settings().lease_seconds))
            add(
                "e",
                f"recovery max, s, {c['label']} ({c['held_by_victim']} runs held)",
                c["recovery_max_s"],
                "lease, s",
                lease,
                "<= 10 s",
                c["recovery_max_s"] <= 10 if c["recovered"] else False,
            )

    dg = sections.get("diagnose")
    if dg:
        labels = {
            "worker_events": "runtime, worker task events on (Flower)",
            "log_warning": "runtime, DAR_LOG_LEVEL=WARNING",
            "hop": "bare hop",
        }
        sp = dg["steps_per_s"]
        for key, label in labels.items():
            add(
                "diag",
                f"steps/s, 2 proc: {label}",
                sp[key],
                "runtime as shipped",
                sp["default"],
                nd=0,
            )
        add(
            "diag",
            "steps/s, 2 proc: bare hop with task events",
            sp["hop_events"],
            "bare hop",
            sp["hop"],
            nd=0,
        )

    if lat:
        add(
            "f",
            "raw checkpoint tx p50, ms (1 thread)",
            lat["raw_checkpoint_p50_ms"],
            "",
            None,
            nd=2,
        )
        add("f", "raw checkpoint tx/s, 1 thread", lat["raw_checkpoint_tx_per_s_1"], "", None, nd=0)
        add("f", "raw checkpoint tx/s, 8 threads", lat["raw_checkpoint_tx_per_s_8"], "", None, nd=0)
        add("f", "bare hop ms/hop p50", lat["hop_p50_ms"], "issue's reference", REFERENCE["hop_ms"])
        if lat.get("dbos_p50_ms"):
            add(
                "f",
                "DBOS ms/step p50",
                lat["dbos_p50_ms"],
                "issue's reference",
                REFERENCE["dbos_ms"],
            )
    if tp:
        for n, row in tp["by_processes"].items():
            n = int(n)
            ref = REFERENCE["hop_steps_per_s_2"] if n == 2 else None
            add(
                "f",
                f"bare hop steps/s, {n} proc",
                row["hop_steps_per_s"],
                "issue's reference" if ref else "",
                ref,
                nd=0,
            )
            if "dbos_steps_per_s" in row:
                add(
                    "f",
                    f"DBOS steps/s, {n} proc",
                    row["dbos_steps_per_s"],
                    "issue's reference",
                    REFERENCE.get(f"dbos_steps_per_s_{n}"),
                    nd=0,
                )
    real = sections.get("realclient")
    if real:
        bare: dict[tuple[str, bool, int], Any] = {}
        for r in real["rows"]:
            if r["who"].startswith("bare"):
                bare[(r["who"].split()[1], r["stream"], r["runs"])] = r
                continue
            shape = f"{r['runs']:,} runs x {r['steps']} x {r['latency_ms'] / 1000:g} s"
            how = f"{r['who']}, {'streamed' if r['stream'] else 'not streamed'}"
            add(
                "f",
                f"model calls open at once, {shape}, {how}",
                r["peak_open"],
                "runs",
                r["runs"],
                nd=0,
            )
            if "ratio_to_ceiling" in r:
                add(
                    "f",
                    f"  end to end s, {how} (all SUCCEEDED: {r.get('all_succeeded')})",
                    r.get("elapsed_s"),
                    "bare client's s (ideal " + f"{r['ideal_s']:.0f})",
                    r.get("bare_elapsed_s"),
                    ">= 0.90 x min(ideal, bare)",
                    r["ratio_to_ceiling"] >= 0.9 and bool(r.get("all_succeeded")),
                    ratio=r["ratio_to_ceiling"],
                )
            add(
                "f",
                f"  CPU ms per call (CPU time, not wall), {how}",
                r["cpu_ms_per_call"],
                "bare client's" if r.get("bare_cpu_ms_per_call") else "",
                r.get("bare_cpu_ms_per_call"),
            )
            add(
                "f",
                f"  KiB per open call, {how}",
                r["kib_per_open_call"],
                "bare client's" if r.get("bare_kib_per_open_call") else "",
                r.get("bare_kib_per_open_call"),
                nd=0,
            )
        sc = real.get("stream_cpu") or {}
        bare_sc = sc.get("bare") or {}
        for mode, what in (("client", "runtime's client"), ("live", "client + live stream")):
            if mode not in sc:
                continue
            add(
                "f",
                f"CPU ms per streamed call, one process, {what}",
                sc[mode]["cpu_ms_per_call"],
                "bare SDK's",
                bare_sc.get("cpu_ms_per_call"),
                nd=2,
            )
            if "instructions_per_call" in sc[mode]:
                add(
                    "f",
                    f"  M instructions per streamed call (callgrind), {what}",
                    sc[mode]["instructions_per_call"] / 1e6,
                    "bare SDK's",
                    (bare_sc.get("instructions_per_call") or 0) / 1e6 or None,
                    nd=2,
                )
    return out


def profile_lines(sections: dict[str, Any]) -> list[str]:
    prof = (sections.get("diagnose") or {}).get("profile") or {}
    if "shares_pct" not in prof:
        return [f"profile: {prof['skipped']}"] if "skipped" in prof else []
    lines = ["share of one worker's busy samples (py-spy, inclusive; lines overlap):"]
    lines += [f"  {v:5.1f}%  {k}" for k, v in prof["shares_pct"].items()]
    return lines


def table(rs: list[dict[str, Any]]) -> str:
    head = ("fig", "measure", "value", "baseline", "base", "ratio", "target", "verdict")
    lines = []
    for r in rs:
        nd = r["nd"]
        lines.append(
            (
                r["fig"],
                r["measure"],
                _f(r["value"], nd),
                r["baseline"],
                _f(r["baseline_value"], nd),
                _f(r["ratio"], 2),
                r["target"],
                r["verdict"],
            )
        )
    widths = [max(len(str(x)) for x in col) for col in zip(head, *lines, strict=False)]
    fmt = " | ".join(f"{{:{'>' if i in (2, 4, 5) else '<'}{w}}}" for i, w in enumerate(widths))
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt.format(*head), sep, *(fmt.format(*ln) for ln in lines)])


def markdown(rs: list[dict[str, Any]]) -> str:
    out = [
        "| fig | measure | value | baseline | baseline value | ratio | target | verdict |",
        "|---|---|---:|---|---:|---:|---|---|",
    ]
    for r in rs:
        nd = r["nd"]
        out.append(
            f"| ({r['fig']}) | {r['measure']} | {_f(r['value'], nd)} | {r['baseline']} | "
            f"{_f(r['baseline_value'], nd)} | {_f(r['ratio'], 2)} | {r['target']} | "
            f"{r['verdict']} |"
        )
    return "\n".join(out)


def machine(env_info: dict[str, Any]) -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    except OSError:
        commit = ""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "commit": commit,
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        **env_info,
    }


def write(payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"bench-{stamp}.json"
    text = json.dumps(payload, indent=1, default=str)
    path.write_text(text)
    (RESULTS / "latest.json").write_text(text)
    return path
