"""The shipped alert rules parse and refer only to metrics the runtime really exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

from db.records import ReadyRuns
from runtime.observe.metrics import FleetCollector, Metrics

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {"counter": ("_total",), "histogram": ("_count", "_sum", "_bucket"), "gauge": ("",)}


class _Counts:
    """Stands in for the store's counting queries (no database in a unit test)."""

    def count_runs_by_status(self) -> dict[str, int]:
        return {}

    def count_stale_leases(self) -> int:
        return 0

    def count_ready_runs(self) -> ReadyRuns:
        return ReadyRuns(0, 0.0, 0)

    def count_pending_approvals(self) -> dict[str, int]:
        return {}

    def count_key_waiters_by_tenant(self, top: int) -> tuple[list[tuple[str, int]], int]:
        return [], 0

    def count_unserved_runs(self) -> int:
        return 0

    def deployments(self) -> list[Any]:
        return []


def _exported() -> set[str]:
    registry = CollectorRegistry()
    Metrics(registry)
    registry.register(FleetCollector(_Counts(), _Counts()))  # type: ignore[arg-type]
    names = set()
    for family in registry.collect():
        names |= {family.name + s for s in SUFFIXES[family.type]}
    return names


def test_alert_rules_use_exported_metrics() -> None:
    exported = _exported()
    assert "dar_tokens_total" in exported
    assert "dar_stale_leases" in exported
    doc = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    assert {"DarRunCostHigh", "DarStaleLeases", "DarRunFailureRateHigh"} <= {
        r["alert"] for r in rules
    }
    for rule in rules:
        used = set(re.findall(r"\b(dar_[a-z_]+)", rule["expr"]))
        assert used, rule["alert"]
        assert used <= exported, (rule["alert"], used - exported)
        assert rule["labels"]["severity"] in {"warning", "critical"}


def test_the_keda_example_scales_on_exported_metrics() -> None:
    exported = _exported()
    doc = yaml.safe_load((ROOT / "deploy/keda/scaledobject.yaml").read_text())
    assert doc["kind"] == "ScaledObject"
    queries = [t["metadata"]["query"] for t in doc["spec"]["triggers"]]
    assert any("dar_runs_ready" in q for q in queries)
    for query in queries:
        used = set(re.findall(r"\b(dar_[a-z_]+)", query))
        assert used, query
        assert used <= exported, (query, used - exported)
