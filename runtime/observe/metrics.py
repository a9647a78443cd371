"""The runtime's Prometheus metrics.

Counters and histograms are observed by the process that does the work (a worker) and
exported from that process (``DAR_METRICS_PORT``): workers run one process with threads, so
one registry per process is correct. Fleet-wide gauges (runs by status, stale leases) are read
from PostgreSQL at scrape time by :class:`FleetCollector`, so they are true for the whole fleet
whichever process serves them (the API's ``/metrics``).
"""

from __future__ import annotations

from collections.abc import Iterator
from decimal import Decimal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from db.deployments import DeploymentStore
from db.records import RunStatus, Usage
from db.store import RunStore
from runtime.llm.pricing import PriceTable

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RUN_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.tokens = Counter(
            "dar_tokens",
            "Model tokens, by model and direction (input, output, cache_write, cache_read).",
            ["model", "direction"],
            registry=registry,
        )
        self.cost = Counter(
            "dar_cost_usd", "Model cost in US dollars, by model.", ["model"], registry=registry
        )
        self.step_latency = Histogram(
            "dar_step_latency_seconds",
            "Duration of a step's model call or tool call, by kind and outcome.",
            ["kind", "outcome"],
            buckets=STEP_BUCKETS,
            registry=registry,
        )
        self.run_duration = Histogram(
            "dar_run_duration_seconds",
            "From submit to the end of the run, by final status.",
            ["status"],
            buckets=RUN_BUCKETS,
            registry=registry,
        )

        self._watched: list[PriceTable] = []
        self.unpriced = Counter(
            "dar_unpriced_cost_lookups",
            "Costs computed for a model DAR_PRICES does not price (charged at the highest "
            "known rate), by model.",
            ["model"],
            registry=registry,
        )
        self.flow_admitted = Counter(
            "dar_flow_admitted",
            "Model calls admitted by flow control (DAR_MODEL_LIMITS), by model.",
            ["model"],
            registry=registry,
        )
        self.flow_refused = Counter(
            "dar_flow_waits",
            "Model calls refused admission and put on a durable timer, by model and the limit "
            "that refused (requests, input, output, concurrent).",
            ["model", "limit"],
            registry=registry,
        )
        self.flow_granted = Counter(
            "dar_flow_granted_tokens",
            "Tokens granted at admission (estimated input, max_tokens output), by model and "
            "direction; its rate per minute compares with dar_flow_limit_per_minute.",
            ["model", "direction"],
            registry=registry,
        )
        self.flow_limit = Gauge(
            "dar_flow_limit_per_minute",
            "The configured limit per minute, by model entry and limit (requests, input, output).",
            ["model", "limit"],
            registry=registry,
        )
        self.flow_fail_open = Counter(
            "dar_flow_fail_open",
            "Flow-control decisions skipped because Redis was unreachable (calls went ahead "
            "unadmitted), by action (admit, settle, key).",
            ["action"],
            registry=registry,
        )
        self.key_refused = Counter(
            "dar_key_waits",
            "Steps refused a concurrency-key slot (DAR_KEY_CONCURRENCY) and put on a timer.",
            registry=registry,
        )

    def watch(self, pricing: PriceTable) -> None:
        """Count the costs ``pricing`` computes for models it has no price for."""
        if any(p is pricing for p in self._watched):
            return
        self._watched.append(pricing)
        pricing.on_unpriced(lambda model: self.unpriced.labels(model).inc())

    def model_call(self, model: str, usage: Usage, cost: Decimal) -> None:
        for direction, n in (
            ("input", usage.input_tokens),
            ("output", usage.output_tokens),
            ("cache_write", usage.cache_creation_input_tokens),
            ("cache_read", usage.cache_read_input_tokens),
        ):
            if n:
                self.tokens.labels(model, direction).inc(n)
        if cost:
            self.cost.labels(model).inc(float(cost))

    def step(self, kind: str, outcome: str, seconds: float) -> None:
        self.step_latency.labels(kind, outcome).observe(seconds)

    def run_finished(self, status: str, seconds: float) -> None:
        self.run_duration.labels(status).observe(max(0.0, seconds))


TOP_KEYS = 20
"""Tenants named in ``dar_runs_waiting_for_key``; the others are summed."""


class FleetCollector(Collector):
    """Gauges read from PostgreSQL when scraped: true for the whole fleet."""

    def __init__(self, store: RunStore, versions: DeploymentStore | None = None) -> None:
        self.store = store
        self.versions = versions if versions is not None else DeploymentStore(store.engine)

    def collect(self) -> Iterator[Metric]:
        runs = GaugeMetricFamily("dar_runs", "Runs by status (whole fleet).", labels=["status"])
        counts = self.store.count_runs_by_status()
        for status in RunStatus:
            runs.add_metric([str(status)], counts.get(str(status), 0))
        yield runs
        approvals = GaugeMetricFamily(
            "dar_approvals_pending", "Approvals waiting for a decision, by role.", labels=["role"]
        )
        for role, n in sorted(self.store.count_pending_approvals().items()):
            approvals.add_metric([role], n)
        yield approvals
        waiting = GaugeMetricFamily(
            "dar_runs_waiting_for_key",
            "Runs waiting for a slot of their concurrency key, by tenant (never by key: a "
            f"key's name is its tenant's), for the {TOP_KEYS} tenants with the most waiting "
            '(the rest summed under tenant="(other)"): a bounded label set.',
            labels=["tenant"],
        )
        top, total = self.store.count_key_waiters_by_tenant(TOP_KEYS)
        for key, n in top:
            waiting.add_metric([key], n)
        if total > sum(n for _, n in top):
            waiting.add_metric(["(other)"], total - sum(n for _, n in top))
        yield waiting
        ready = self.store.count_ready_runs()
        yield GaugeMetricFamily(
            "dar_runs_ready",
            "Runs a worker could take now that no worker holds (whole fleet): the backlog "
            "more workers would shrink. Runs waiting for a timer, a key slot or a rate limit "
            "are not counted.",
            value=ready.ready,
        )
        yield GaugeMetricFamily(
            "dar_runs_ready_oldest_seconds",
            "How long the oldest ready run has waited for a worker (0 with none ready).",
            value=ready.oldest_seconds,
        )
        yield GaugeMetricFamily(
            "dar_runs_in_step",
            "Runs inside a step now (a worker holds their lease): the slots in use.",
            value=ready.in_step,
        )
        yield GaugeMetricFamily(
            "dar_stale_leases",
            "RUNNING runs whose lease has lapsed: a worker died and the run awaits the reaper.",
            value=self.store.count_stale_leases(),
        )
        yield GaugeMetricFamily(
            "dar_runs_unserved",
            "Runs in flight of a deployment version no live worker serves: they wait for a "
            "worker of their version, or for an operator's upgrade (GET /api/versions).",
            value=self.versions.count_unserved_runs(),
        )
        found = self.versions.deployments()
        in_flight = GaugeMetricFamily(
            "dar_version_runs",
            "Runs in flight by deployment version (none: stored before versions).",
            labels=["deployment"],
        )
        workers = GaugeMetricFamily(
            "dar_version_workers",
            "Live worker processes by the deployment version they serve.",
            labels=["deployment"],
        )
        for d in found:
            in_flight.add_metric([d.deployment or "none"], d.in_flight)
            workers.add_metric([d.deployment or "none"], d.live_workers)
        yield in_flight
        yield workers
