"""Pictures of a bench run, written next to docs/benchmarks.md: per-step overhead against
the baselines, a step's cost against its number in the run, and steps/s against runs in
flight. Needs matplotlib (the ``bench`` extra); without it, no pictures and a note."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent / "docs"


def write(sections: dict[str, Any], out: Path = DOCS) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plots (pip install -e '.[bench]')")
        return []
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    lat = sections.get("latency")
    if lat:
        names = ["this runtime", "bare Celery hop\n+ checkpoint", "DBOS"]
        p50 = [lat.get("runtime_p50_ms"), lat.get("hop_p50_ms"), lat.get("dbos_p50_ms")]
        p99 = [lat.get("runtime_p99_ms"), lat.get("hop_p99_ms"), lat.get("dbos_p99_ms")]
        keep = [i for i, v in enumerate(p50) if v is not None]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs = range(len(keep))
        ax.bar([x - 0.2 for x in xs], [p50[i] for i in keep], 0.4, label="p50")
        ax.bar([x + 0.2 for x in xs], [p99[i] or 0 for i in keep], 0.4, label="p99")
        ax.set_xticks(list(xs), [names[i] for i in keep])
        ax.set_ylabel("ms per step (without the model)")
        ax.set_title("(a) per-step overhead, same machine, same run")
        ax.legend()
        written.append(_save(fig, out / "bench-overhead.png"))

    rp = sections.get("replay")
    if rp and rp.get("p50_ms_by_seq"):
        pts = sorted((int(k), v) for k, v in rp["p50_ms_by_seq"].items())
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("step number in the run")
        ax.set_ylabel("ms per step, p50")
        ax.set_title(f"(d) step cost along a {rp['steps_per_run']}-step run")
        written.append(_save(fig, out / "bench-step-cost.png"))

    inf = sections.get("inflight")
    if inf and inf.get("levels"):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for lv in inf["levels"]:
            label = f"{lv.get('pool', 'threads')}, {lv['model_latency_ms'] / 1000:g} s model"
            ax.scatter(lv["runs"], lv["steps_per_s"], label=f"{label}: measured")
            ax.scatter(lv["runs"], lv["ideal_steps_per_s"], marker="_", s=300, color="grey")
        ax.set_xscale("log")
        ax.set_xlabel("runs in flight (2 worker processes)")
        ax.set_ylabel("steps/s (grey: ideal, runs / latency)")
        ax.set_title("(c) throughput against runs in flight")
        ax.legend(fontsize=7)
        written.append(_save(fig, out / "bench-inflight.png"))
    real = sections.get("realclient")
    if real and real.get("rows"):
        written.append(_realclient(real, out, plt))
    return written


def defaults_by_concurrency(results: list[Path], out: Path = DOCS) -> Path:
    """(c) with the shipped defaults, one bar per bench result file (``python -m bench
    defaults`` runs, each at its worker concurrency): the rate against the ideal, and the
    wait a step spent between model calls (p50, p99)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for path in results:
        section = json.loads(path.read_text())["sections"]["defaults"]
        level = section["levels"][0]
        runs.append((section["concurrency"], level))
    fig, (rate, wait) = plt.subplots(1, 2, figsize=(8, 3.5))
    labels = [f"{c}\nrun {i + 1}" for i, (c, _) in enumerate(runs)]
    rate.bar(labels, [lv["ratio_to_ideal"] for _, lv in runs])
    rate.axhline(0.9, color="red", linestyle="--", label="target 0.9")
    rate.set_ylim(0.8, 1.02)
    rate.set_ylabel("steps/s / ideal (200)")
    rate.set_xlabel("--concurrency per worker process")
    rate.legend(loc="lower right")
    xs = range(len(runs))
    p50 = [lv["overhead_ms_per_step"]["p50"] for _, lv in runs]
    p99 = [lv["overhead_ms_per_step"]["p99"] for _, lv in runs]
    wait.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    wait.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    wait.legend()
    wait.set_xticks(list(xs), labels)
    wait.set_ylabel("ms between two model calls")
    wait.set_xlabel("--concurrency per worker process")
    fig.suptitle("(c) 2,000 runs x 10 s model, 2 worker processes, shipped defaults", y=0.99)
    return _save(fig, out / "bench-defaults-concurrency.png")


def _realclient(real: dict[str, Any], out: Path, plt: Any) -> Path:
    rows = [r for r in real["rows"] if r.get("elapsed_s")]
    labels = [
        f"{r['who']}\n{'streamed' if r['stream'] else 'not streamed'}, {r['runs']:,} runs"
        for r in rows
    ]
    fig, (opened, took) = plt.subplots(1, 2, figsize=(12, 0.55 * len(rows) + 2))
    y = list(range(len(rows)))
    opened.barh(y, [r["peak_open"] for r in rows], color="#4477aa")
    opened.set_yticks(y, labels, fontsize=7)
    opened.invert_yaxis()
    opened.set_xlabel("model calls open at the API at once (peak)")
    took.barh(y, [r["elapsed_s"] for r in rows], color="#cc6677")
    took.scatter([r["ideal_s"] for r in rows], y, color="black", marker="|", s=200, label="ideal")
    took.set_yticks(y, [""] * len(rows))
    took.invert_yaxis()
    took.set_xlabel("first submit to last answer, s")
    took.legend(fontsize=7)
    fig.suptitle(
        f"(f) through the real model clients over HTTP, {real['workers']} worker processes "
        f"(--pool {real['pool']} --concurrency {real['concurrency']}), a shared 2-core host",
        fontsize=9,
    )
    return _save(fig, out / "bench-realclient.png")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


if __name__ == "__main__":
    import sys

    print(defaults_by_concurrency([Path(p) for p in sys.argv[1:]]))
