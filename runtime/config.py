"""Configuration from the environment. Every setting is documented in the docs
(docs/reference/configuration.md).

``Settings.from_env()`` reads it once; everything else takes a ``Settings`` as an argument.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from db.engine import PREPARE_MODES, PrepareMode
from db.errors import DarError

WORKER_POOL = "gevent"
"""The worker's Celery pool as shipped (``DAR_WORKER_POOL``): a model call in flight is a
greenlet and a socket, so one process holds thousands; tool bodies run on native threads
(:mod:`runtime.native`), so a tool blocking in C code does not stall the calls beside it.
The Procfile, ``compose.yaml``, ``dar dev`` and the bench all use these two values
(``tests/unit/test_procfile.py`` checks it)."""
WORKER_CONCURRENCY = 2000
"""Steps one worker process runs at once, as shipped (``DAR_WORKER_CONCURRENCY``). A run's
step holds a slot for its whole model call, so slots must outnumber the runs in flight: at
1,000, two processes had exactly the 2,000 slots that 2,000 runs need, a step's next message
waited ~1.3 s for a slot to free, and the pair ran at 0.89 of the ideal rate; at 2,000, at
1.00 (``python -m bench defaults``, docs/benchmarks.md). A slot costs nothing until a step
takes it; a step in flight costs a greenlet and a socket (the worker raises its open-files
limit to match, :func:`tasks.signals.raise_open_files_limit`)."""


class ConfigError(DarError):
    """Invalid configuration."""


UPGRADE_POLICIES = ("pinned", "replay")
"""How an agent's runs move to a new version (``upgrade=`` when it is declared or registered):

- ``"pinned"`` (the default): a run stays on the version it started on until an operator
  upgrades it (``POST /api/versions/{v}/upgrade``, ``dar upgrade``);
- ``"replay"``: once no live worker serves a run's version, the newest live version's
  workers upgrade it themselves, through the same replay check (runtime.engine.upgrade)."""


def check_upgrade_policy(owner: str, policy: object) -> str:
    if policy not in UPGRADE_POLICIES:
        raise ConfigError(
            f"agent {owner!r}: upgrade={policy!r} is not a policy "
            f"(one of: {', '.join(repr(p) for p in UPGRADE_POLICIES)})"
        )
    return str(policy)


def _get(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, "").strip()
    return value if value else default


def _num(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0) -> float:
    raw = _get(env, name, str(default))
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {raw!r}")
    if value < minimum:
        raise ConfigError(f"{name} must be at least {minimum}, got {raw!r}")
    return value


_DEPLOYMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _deployment(env: Mapping[str, str]) -> str | None:
    """DAR_DEPLOYMENT, a name that is also part of a queue's name."""
    value = env.get("DAR_DEPLOYMENT", "").strip()
    if value and not _DEPLOYMENT.fullmatch(value):
        raise ConfigError(
            f"DAR_DEPLOYMENT must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a "
            f"letter or digit), got {value!r}"
        )
    return value or None


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    value = _num(env, name, default, minimum=minimum)
    if value != int(value):
        raise ConfigError(f"{name} must be a whole number, got {value}")
    return int(value)


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _get(env, name, "1" if default else "0").lower()
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name} must be true or false, got {raw!r}")


def _choice(env: Mapping[str, str], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = _get(env, name, default).lower()
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


DEMO_MODEL = "demo"
"""The offline demo model's name (runtime.llm.demo): the default model without a key."""
CLAUDE_DEFAULT_MODEL = "claude-sonnet-4-5"


@dataclass(frozen=True)
class Settings:
    database_url: str | None = None
    redis_url: str | None = None
    anthropic_api_key: str | None = field(default=None, repr=False)
    anthropic_base_url: str | None = None
    default_model: str = ""
    """DAR_DEFAULT_MODEL; empty: :attr:`model_default` decides."""
    default_agent: str = "acme-tickets"
    agent_modules: tuple[str, ...] = ()
    max_tokens: int = 4096
    default_max_steps: int = 50
    lease_seconds: float = 8.0
    heartbeat_seconds: float = 8.0 / 3
    redispatch_after_seconds: float = 30.0
    reaper_interval_seconds: float = 1.0
    schedule_poll_seconds: float = 1.0
    """DAR_SCHEDULE_POLL_SECONDS: how often each beat looks for due schedule ticks."""
    max_claims_without_progress: int = 3
    store_requests: bool = False
    model_timeout_seconds: float = 120.0
    retry_max_attempts: int = 5
    retry_base_seconds: float = 0.5
    retry_cap_seconds: float = 30.0
    long_wait_seconds: float = 5.0
    max_countdown_seconds: float = 60.0
    on_max_tokens: str = "fail"
    strict_budget: bool = False
    prices_json: str | None = None
    max_tool_output_chars: int = 50_000
    cancel_grace_seconds: float = 5.0
    """After a step's timeout: how long it has to stop on its context's ``cancelled`` before
    it is treated as still running (in doubt)."""
    started_row_after_seconds: float = 0.25
    """An idempotent step's ``STARTED`` row is written only once it has run this long (0:
    before it runs, like every other step's). Running it again after a crash is allowed
    either way; the row is for the timeline and the live stream."""
    llm_factory: str | None = None
    metrics_port: int = 0
    metrics_addr: str = "127.0.0.1"
    metrics_public: bool = False
    """DAR_METRICS_PUBLIC: the web process's /metrics answers without a token (with tokens
    configured it otherwise needs the ``metrics`` role)."""
    api_tokens: str | None = field(default=None, repr=False)
    api_tokens_file: str | None = None
    """DAR_API_TOKENS_FILE: more token entries, one a line, read again when the file changes
    (add or revoke a token without a restart)."""
    submit_rate_per_minute: int = 0
    model_limits_json: str | None = None
    flow_control: bool = True
    """DAR_FLOW_CONTROL (default on): admit model calls against the limits learned from the
    API's rate-limit headers (and DAR_MODEL_LIMITS), fleet-wide in Redis."""
    flow_prefix: str = "dar:flow"
    """Where flow control keeps its buckets in Redis (tests use their own)."""
    token_max_active_runs: int = 0
    token_max_priority: int = 10
    """DAR_TOKEN_MAX_PRIORITY: the highest ``priority`` a submit by a token without ``admin``
    may carry (403 above it), so one tenant cannot jump every queue."""
    token_max_schedules: int = 20
    """DAR_TOKEN_MAX_SCHEDULES: schedules one token may have at once (0: no limit); a create
    past it is 429."""
    schedule_min_interval_seconds: int = 10
    """DAR_SCHEDULE_MIN_INTERVAL_SECONDS: the shortest gap between two ticks of a schedule a
    token without ``admin`` may create (``* * * * * *`` ticks every second: 400 at the
    default)."""
    message_rate_per_minute: int = 60
    """DAR_MESSAGE_RATE_PER_MINUTE: messages and signals one token may send per minute, all
    runs together (0: no limit); past it, 429 with Retry-After."""
    max_pending_per_run: int = 100
    """DAR_MAX_PENDING_PER_RUN: messages, and signals, a run may hold undelivered at once;
    one more is 409 until the run reads some."""
    key_concurrency: int = 0
    """DAR_KEY_CONCURRENCY: at most this many runs of one concurrencyKey inside a step at
    once (0: no limit)."""
    key_concurrency_overrides_json: str | None = None
    """DAR_KEY_CONCURRENCY_OVERRIDES: per-key limits, JSON {"key": n}
    (runtime.admission.concurrency_keys)."""
    key_recheck_seconds: float = 30.0
    """DAR_KEY_RECHECK_SECONDS: a run waiting for its key's slot is woken when one frees; if
    that wake is lost (its waker was killed) it asks again after this long."""
    max_page_size: int = 200
    retention_days: float = 30.0
    retention_interval_seconds: float = 3600.0
    retention_batch: int = 500
    strict_replay: bool = False
    deployment: str | None = None
    """DAR_DEPLOYMENT: the version this process's code is (runtime.engine.deployment); unset,
    it is derived from the agent modules' code and the agents' definitions."""
    approval_webhook_url: str | None = None
    demo_latency_ms: int = 3000
    queue: str = "dar"
    visibility_timeout_seconds: float = 3600.0
    max_body_bytes: int = 1_048_576
    max_input_chars: int = 100_000
    http_buffer_bytes: int = 64 * 1_048_576
    """DAR_HTTP_BUFFER_BYTES: bytes of chunked request bodies one web process holds while
    receiving them, all requests together; a body that would take more is a 503."""
    default_token_budget: int = 100_000
    max_token_budget: int = 10_000_000
    default_timeout_seconds: int = 600
    max_timeout_seconds: int = 7 * 86400
    mcp_servers_json: str | None = field(default=None, repr=False)
    """DAR_MCP_SERVERS: MCP servers by name (runtime.mcp.servers.parse_servers)."""
    mcp_tools_json: str | None = None
    """DAR_MCP_TOOLS: per-tool overrides of MCP annotations, by <server>__<tool>."""
    mcp_connect_timeout_seconds: float = 30.0
    mcp_startup_check: str = "strict"
    mcp_retry_seconds: float = 10.0
    events_poll_seconds: float = 1.0
    """DAR_EVENTS_POLL_SECONDS: how often an open event stream reads PostgreSQL for new
    durable events (deltas arrive as Redis delivers them, in between)."""
    events_heartbeat_seconds: float = 15.0
    """DAR_EVENTS_HEARTBEAT_SECONDS: a comment line on a quiet stream, so proxies keep it."""
    events_idle_seconds: float = 300.0
    """DAR_EVENTS_IDLE_SECONDS: a stream with no event for this long is closed (the client
    reconnects with Last-Event-ID when it still wants it)."""
    events_max_seconds: float = 3600.0
    """DAR_EVENTS_MAX_SECONDS: the longest one stream connection is held open."""
    events_streams_per_token: int = 8
    """DAR_EVENTS_STREAMS_PER_TOKEN: event streams one token may hold open in one web process
    (429 with Retry-After beyond it); 0 is unlimited."""
    events_streams_per_tenant: int = 32
    """DAR_EVENTS_STREAMS_PER_TENANT: the same, for all the tokens of one tenant."""
    events_streams_max: int = 1000
    """DAR_EVENTS_STREAMS_MAX: event streams one web process holds open in all (default: half
    of WEB_CONNECTIONS), so the other routes keep connections to answer with."""
    live_maxlen: int = 10_000
    """DAR_LIVE_MAXLEN: the cap (approximate) of a run's Redis stream of text deltas."""
    cancel_poll_seconds: float = 0.2
    """DAR_CANCEL_POLL_SECONDS: how often a model call in flight checks its run's cancel
    flag in Redis."""
    db_prepare: PrepareMode = "auto"
    """DAR_DB_PREPARE: auto|on|off, server-side prepared statements (db.engine.PREPARE_MODES):
    ``auto`` turns them off on connections that go through a pooler such as PgBouncer."""
    worker_name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")

    @property
    def model_default(self) -> str:
        """The model of a run when neither it nor its agent names one: DAR_DEFAULT_MODEL, else
        claude-sonnet-4-5 with a key (or a model client of your own), else ``demo``: with
        neither, the offline demo model answers, and the runs say so (priced at $0) rather
        than naming a Claude model."""
        if self.default_model:
            return self.default_model
        if self.anthropic_api_key or self.llm_factory:
            return CLAUDE_DEFAULT_MODEL
        return DEMO_MODEL

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        e: Mapping[str, str] = os.environ if env is None else env
        modules = tuple(m.strip() for m in _get(e, "DAR_AGENT_MODULES", "").split(",") if m.strip())
        lease = _num(e, "DAR_LEASE_SECONDS", 8.0, minimum=1)
        settings = cls(
            database_url=e.get("DATABASE_URL") or None,
            redis_url=e.get("REDIS_URL") or None,
            anthropic_api_key=e.get("ANTHROPIC_API_KEY") or None,
            anthropic_base_url=e.get("ANTHROPIC_BASE_URL") or None,
            db_prepare=_choice(e, "DAR_DB_PREPARE", "auto", PREPARE_MODES),  # type: ignore[arg-type]
            default_model=_get(e, "DAR_DEFAULT_MODEL", cls.default_model),
            default_agent=_get(e, "DAR_DEFAULT_AGENT", cls.default_agent),
            agent_modules=modules,
            max_tokens=_int(e, "DAR_MAX_TOKENS", cls.max_tokens, minimum=1),
            default_max_steps=_int(e, "DAR_DEFAULT_MAX_STEPS", cls.default_max_steps, minimum=1),
            lease_seconds=lease,
            heartbeat_seconds=_num(e, "DAR_HEARTBEAT_SECONDS", lease / 3, minimum=0.1),
            redispatch_after_seconds=_num(e, "DAR_REDISPATCH_AFTER_SECONDS", 30.0, minimum=1),
            reaper_interval_seconds=_num(e, "DAR_REAPER_INTERVAL_SECONDS", 1.0, minimum=0.1),
            schedule_poll_seconds=_num(e, "DAR_SCHEDULE_POLL_SECONDS", 1.0, minimum=0.1),
            max_claims_without_progress=_int(e, "DAR_MAX_CLAIMS_WITHOUT_PROGRESS", 3, minimum=1),
            store_requests=_bool(e, "DAR_STORE_REQUESTS", False),
            model_timeout_seconds=_num(e, "DAR_MODEL_TIMEOUT_SECONDS", 120.0, minimum=1),
            retry_max_attempts=_int(e, "DAR_RETRY_MAX_ATTEMPTS", 5, minimum=1),
            retry_base_seconds=_num(e, "DAR_RETRY_BASE_SECONDS", 0.5, minimum=0),
            retry_cap_seconds=_num(e, "DAR_RETRY_CAP_SECONDS", 30.0, minimum=0),
            long_wait_seconds=_num(e, "DAR_LONG_WAIT_SECONDS", 5.0, minimum=0),
            max_countdown_seconds=_num(e, "DAR_MAX_COUNTDOWN_SECONDS", 60.0, minimum=0),
            on_max_tokens=_choice(e, "DAR_ON_MAX_TOKENS", "fail", ("fail", "continue")),
            strict_budget=_bool(e, "DAR_STRICT_BUDGET", False),
            prices_json=e.get("DAR_PRICES") or None,
            max_tool_output_chars=_int(e, "DAR_MAX_TOOL_OUTPUT_CHARS", 50_000, minimum=100),
            cancel_grace_seconds=_num(e, "DAR_CANCEL_GRACE_SECONDS", 5.0, minimum=0),
            started_row_after_seconds=_num(e, "DAR_STARTED_ROW_AFTER_MS", 250, minimum=0) / 1000,
            llm_factory=e.get("DAR_LLM_FACTORY") or None,
            metrics_port=_int(e, "DAR_METRICS_PORT", 0),
            metrics_addr=_get(e, "DAR_METRICS_ADDR", "127.0.0.1"),
            metrics_public=_bool(e, "DAR_METRICS_PUBLIC", False),
            api_tokens=e.get("DAR_API_TOKENS") or None,
            api_tokens_file=e.get("DAR_API_TOKENS_FILE") or None,
            submit_rate_per_minute=_int(e, "DAR_SUBMIT_RATE_PER_MINUTE", 0),
            model_limits_json=e.get("DAR_MODEL_LIMITS") or None,
            flow_control=_bool(e, "DAR_FLOW_CONTROL", True),
            token_max_active_runs=_int(e, "DAR_TOKEN_MAX_ACTIVE_RUNS", 0),
            token_max_priority=_int(e, "DAR_TOKEN_MAX_PRIORITY", 10, minimum=-1000),
            token_max_schedules=_int(e, "DAR_TOKEN_MAX_SCHEDULES", 20),
            schedule_min_interval_seconds=_int(e, "DAR_SCHEDULE_MIN_INTERVAL_SECONDS", 10),
            message_rate_per_minute=_int(e, "DAR_MESSAGE_RATE_PER_MINUTE", 60),
            max_pending_per_run=_int(e, "DAR_MAX_PENDING_PER_RUN", 100, minimum=1),
            key_concurrency=_int(e, "DAR_KEY_CONCURRENCY", 0),
            key_concurrency_overrides_json=e.get("DAR_KEY_CONCURRENCY_OVERRIDES") or None,
            key_recheck_seconds=_num(e, "DAR_KEY_RECHECK_SECONDS", 30.0, minimum=0.5),
            max_page_size=_int(e, "DAR_MAX_PAGE_SIZE", 200, minimum=1),
            retention_days=_num(e, "DAR_RETENTION_DAYS", 30.0),
            retention_interval_seconds=_num(e, "DAR_RETENTION_INTERVAL_SECONDS", 3600, minimum=1),
            retention_batch=_int(e, "DAR_RETENTION_BATCH", 500, minimum=1),
            strict_replay=_bool(e, "DAR_STRICT_REPLAY", False),
            deployment=_deployment(e),
            approval_webhook_url=e.get("DAR_APPROVAL_WEBHOOK_URL") or None,
            demo_latency_ms=_int(e, "DAR_DEMO_LATENCY_MS", 3000),
            queue=_get(e, "DAR_QUEUE", "dar"),
            visibility_timeout_seconds=_num(e, "DAR_VISIBILITY_TIMEOUT_SECONDS", 3600, minimum=60),
            max_body_bytes=_int(e, "DAR_MAX_BODY_BYTES", 1_048_576, minimum=1024),
            max_input_chars=_int(e, "DAR_MAX_INPUT_CHARS", 100_000, minimum=1),
            http_buffer_bytes=_int(e, "DAR_HTTP_BUFFER_BYTES", 64 * 1_048_576, minimum=1024),
            default_token_budget=_int(e, "DAR_DEFAULT_TOKEN_BUDGET", 100_000, minimum=1),
            max_token_budget=_int(e, "DAR_MAX_TOKEN_BUDGET", 10_000_000, minimum=1),
            default_timeout_seconds=_int(e, "DAR_DEFAULT_TIMEOUT_SECONDS", 600, minimum=1),
            max_timeout_seconds=_int(e, "DAR_MAX_TIMEOUT_SECONDS", 7 * 86400, minimum=1),
            mcp_servers_json=e.get("DAR_MCP_SERVERS") or None,
            mcp_tools_json=e.get("DAR_MCP_TOOLS") or None,
            mcp_connect_timeout_seconds=_num(e, "DAR_MCP_CONNECT_TIMEOUT_SECONDS", 30.0, minimum=1),
            mcp_startup_check=_choice(
                e, "DAR_MCP_STARTUP_CHECK", "strict", ("strict", "warn", "off")
            ),
            mcp_retry_seconds=_num(e, "DAR_MCP_RETRY_SECONDS", 10.0, minimum=0.1),
            events_poll_seconds=_num(e, "DAR_EVENTS_POLL_SECONDS", 1.0, minimum=0.05),
            events_heartbeat_seconds=_num(e, "DAR_EVENTS_HEARTBEAT_SECONDS", 15.0, minimum=0.1),
            events_idle_seconds=_num(e, "DAR_EVENTS_IDLE_SECONDS", 300.0, minimum=1),
            events_max_seconds=_num(e, "DAR_EVENTS_MAX_SECONDS", 3600.0, minimum=1),
            events_streams_per_token=_int(e, "DAR_EVENTS_STREAMS_PER_TOKEN", 8, minimum=0),
            events_streams_per_tenant=_int(e, "DAR_EVENTS_STREAMS_PER_TENANT", 32, minimum=0),
            events_streams_max=_int(
                e,
                "DAR_EVENTS_STREAMS_MAX",
                max(1, _int(e, "WEB_CONNECTIONS", 2000, minimum=2) // 2),
                minimum=1,
            ),
            live_maxlen=_int(e, "DAR_LIVE_MAXLEN", 10_000, minimum=100),
            cancel_poll_seconds=_num(e, "DAR_CANCEL_POLL_SECONDS", 0.2, minimum=0.01),
            worker_name=_get(e, "DAR_WORKER_NAME", f"{socket.gethostname()}:{os.getpid()}"),
        )
        for default, maximum, dname, mname in (
            (
                settings.default_token_budget,
                settings.max_token_budget,
                "DAR_DEFAULT_TOKEN_BUDGET",
                "DAR_MAX_TOKEN_BUDGET",
            ),
            (
                settings.default_timeout_seconds,
                settings.max_timeout_seconds,
                "DAR_DEFAULT_TIMEOUT_SECONDS",
                "DAR_MAX_TIMEOUT_SECONDS",
            ),
        ):
            if default > maximum:
                raise ConfigError(
                    f"{dname} ({default}) is above {mname} ({maximum}): every submit that "
                    "leaves the field out would be rejected"
                )
        if settings.http_buffer_bytes <= settings.max_body_bytes:
            raise ConfigError(
                f"DAR_HTTP_BUFFER_BYTES ({settings.http_buffer_bytes}) must be above "
                f"DAR_MAX_BODY_BYTES ({settings.max_body_bytes}), or no chunked body could "
                "be received"
            )
        if settings.max_countdown_seconds >= settings.visibility_timeout_seconds:
            raise ConfigError(
                "DAR_MAX_COUNTDOWN_SECONDS must be below DAR_VISIBILITY_TIMEOUT_SECONDS: a "
                "Celery countdown longer than the visibility timeout gets redelivered"
            )
        if settings.heartbeat_seconds >= settings.lease_seconds:
            raise ConfigError(
                f"DAR_HEARTBEAT_SECONDS ({settings.heartbeat_seconds}) must be shorter than "
                f"DAR_LEASE_SECONDS ({settings.lease_seconds}) or leases lapse between beats"
            )
        return settings

    def require_database_url(self) -> str:
        if not self.database_url:
            raise ConfigError(
                "DATABASE_URL is not set: point it at PostgreSQL "
                "(postgresql://user@host:5432/db), or use `dar dev`, which starts one"
            )
        return self.database_url

    def require_redis_url(self) -> str:
        if not self.redis_url:
            raise ConfigError(
                "REDIS_URL is not set: point it at Redis (redis://host:6379/0), "
                "or use `dar dev`, which starts one"
            )
        return self.redis_url
