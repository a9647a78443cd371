"""The tables, as SQLAlchemy Core. Alembic migrations must produce exactly this schema
(``tests/integration/test_migrations.py`` compares them)."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Double,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB, TIMESTAMP, UUID

metadata = MetaData()

TZ = TIMESTAMP(timezone=True)

RUN_STATUSES = (
    "QUEUED",
    "RUNNING",
    "WAITING",
    "SUCCEEDED",
    "FAILED",
    "CANCELLED",
    "TIMED_OUT",
    "NEEDS_ATTENTION",
)

run = Table(
    "run",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("agent", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'QUEUED'")),
    # The run's input as JSON: a string for the agent loop, any JSON for durable functions.
    Column("input", JSONB, nullable=False),
    Column("model", Text, nullable=False),
    Column("max_steps", Integer, nullable=False),
    Column("token_budget", BigInteger, nullable=False),
    Column("tokens_used", BigInteger, nullable=False, server_default=text("0")),
    Column("input_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("output_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("cache_creation_input_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("cache_read_input_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("cost_usd", Numeric(18, 8), nullable=False, server_default=text("0")),
    Column("cost_budget_usd", Numeric(18, 8)),
    # Usage that was billed but could not be checkpointed (lease lost meanwhile): counted
    # against the budgets and in the run's cost, never as a step.
    Column("unrecorded_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("unrecorded_cost_usd", Numeric(18, 8), nullable=False, server_default=text("0")),
    # The part of unrecorded_tokens that is an estimate: calls lost with their worker.
    Column("unrecorded_estimated_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("deadline_at", TZ, nullable=False),
    # When the run may next be worked on; a durable timer when in the future.
    Column("run_at", TZ, nullable=False, server_default=text("now()")),
    Column("wait_reason", Text),
    # The earliest moment a wake may bring the run forward to (a server's retry-after, a
    # backoff, a sleep: its timer is a floor); NULL when it waits for what may come sooner.
    Column("wake_floor", TZ),
    # The lease: holder, expiry, and the fencing token bumped on every claim.
    Column("locked_by", Text),
    Column("locked_until", TZ),
    Column("lease_epoch", BigInteger, nullable=False, server_default=text("0")),
    # The dispatch token: only a drive_run message carrying the current token may claim the
    # run, so stale and duplicated messages run nothing and never start a second chain.
    Column("dispatch_token", UUID(as_uuid=True), nullable=False),
    Column("dispatched_at", TZ, nullable=False, server_default=text("now()")),
    # Claims since the last checkpoint: a run that keeps killing its worker is failed.
    Column("claims_without_progress", Integer, nullable=False, server_default=text("0")),
    # Model attempts made for the step in flight, kept across durable timers.
    Column("model_attempts", Integer, nullable=False, server_default=text("0")),
    Column("cancel_requested", Boolean, nullable=False, server_default=text("false")),
    Column("result", JSONB),
    Column("error", Text),
    Column("idempotency_key", Text),
    Column("request_hash", Text),
    Column("submitted_by", Text),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
    Column("updated_at", TZ, nullable=False, server_default=text("now()")),
    Column("finished_at", TZ),
    # The submitting token's tenant: runs, approvals, idempotency keys and lists are scoped
    # to it in the API. '' is the tenant of an open (development) API.
    Column("tenant", Text, nullable=False, server_default=text("''")),
    # The timeout it was submitted with: a resume by a non-admin token may not exceed it.
    Column("timeout_seconds", Integer),
    # A fork: the run it was forked from and the first step it executes itself (its steps
    # before that are copies). No foreign key: the lineage outlives the original's retention.
    Column("forked_from_run", UUID(as_uuid=True)),
    Column("forked_from_seq", Integer),
    # Answer model steps from the original's recorded responses while the requests match.
    Column("replay_model", Boolean, nullable=False, server_default=text("false")),
    # The number of the run's last event in run_event (kept by triggers, migration 0010).
    Column("event_seq", BigInteger, nullable=False, server_default=text("0")),
    # Flow control (migration 0011): at most DAR_KEY_CONCURRENCY runs of one key inside a
    # step at once; priority orders the runs waiting for a key slot or a model's limits.
    Column("concurrency_key", Text),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    # How many times the status changed (the status trigger, migration 0012): a worker's copy
    # of the step log catches up by epoch only while this has not moved (db/steplog.py).
    Column("status_changes", BigInteger, nullable=False, server_default=text("0")),
    # The schedule whose tick started it (migration 0014); no foreign key: a deleted schedule
    # leaves its runs.
    Column("schedule_id", UUID(as_uuid=True)),
    # A child run (migration 0017): the run whose steps.child started it. No foreign key, as
    # for forks: the lineage outlives retention.
    Column("parent_run_id", UUID(as_uuid=True)),
    # Messages posted to an agent-loop run and not delivered yet (migration 0020): read with
    # every claim, so a step boundary knows without a query.
    Column("messages_pending", Integer, nullable=False, server_default=text("0")),
    # The version of the code the run started on (migration 0050, runtime.engine.deployment):
    # only workers of this version drive it. NULL (stored before versions): any worker.
    Column("deployment", Text),
    CheckConstraint(
        "status IN (" + ", ".join(f"'{s}'" for s in RUN_STATUSES) + ")",
        name="run_status_ck",
    ),
)

# The claim and reaper scan only live rows.
Index(
    "run_claim_idx",
    run.c.run_at,
    postgresql_where=text("status IN ('QUEUED', 'RUNNING')"),
)
Index(
    "run_idempotency_uk",
    run.c.tenant,
    run.c.idempotency_key,
    unique=True,
    postgresql_where=text("idempotency_key IS NOT NULL"),
)
Index(
    "run_deployment_live_idx",
    run.c.deployment,
    postgresql_where=text("status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')"),
)
Index("run_status_created_idx", run.c.status, run.c.created_at.desc(), run.c.id.desc())
Index("run_created_idx", run.c.created_at.desc(), run.c.id.desc())
Index("run_tenant_created_idx", run.c.tenant, run.c.created_at.desc(), run.c.id.desc())
Index("run_agent_created_idx", run.c.agent, run.c.created_at.desc(), run.c.id.desc())
# A tenant's runs of one status (the console's status filter for a tenant, migration 0022).
Index(
    "run_tenant_status_created_idx",
    run.c.tenant,
    run.c.status,
    run.c.created_at.desc(),
    run.c.id.desc(),
)
# The retention sweep scans finished runs by age; the submit rate limit counts by submitter.
Index("run_finished_idx", run.c.finished_at, postgresql_where=text("finished_at IS NOT NULL"))
Index(
    "run_submitter_idx",
    run.c.submitted_by,
    run.c.created_at,
    postgresql_where=text("submitted_by IS NOT NULL"),
)

# The "runs waiting by concurrency key" gauge counts live keyed runs only.
Index(
    "run_concurrency_key_idx",
    run.c.concurrency_key,
    postgresql_where=text("concurrency_key IS NOT NULL AND status IN ('QUEUED', 'RUNNING')"),
)

# A parent's children in the order they were started, for GET /api/runs/{id} and its tree
# (migration 0025: the tree's walk reads only the children it shows) and the cancel cascade.
Index(
    "run_parent_created_idx",
    run.c.parent_run_id,
    run.c.created_at,
    run.c.id,
    postgresql_where=text("parent_run_id IS NOT NULL"),
)

# The overlap check of a schedule's tick reads its live runs.
Index(
    "run_schedule_live_idx",
    run.c.schedule_id,
    postgresql_where=text(
        "schedule_id IS NOT NULL AND status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')"
    ),
)

run_step = Table(
    "run_step",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
    Column("seq", Integer, nullable=False),
    # Deterministic and unique per run: model steps by turn, tool steps by tool_use id.
    Column("step_key", Text, nullable=False),
    Column("kind", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("tool_name", Text),
    Column("tool_use_id", Text),
    Column("model", Text),
    # The full request is optional (DAR_STORE_REQUESTS); its hash is always kept.
    Column("request", JSONB),
    Column("prompt_hash", Text),
    Column("response", JSONB),
    Column("stop_reason", Text),
    Column("input_tokens", Integer, nullable=False, server_default=text("0")),
    Column("output_tokens", Integer, nullable=False, server_default=text("0")),
    Column("cache_creation_input_tokens", Integer, nullable=False, server_default=text("0")),
    Column("cache_read_input_tokens", Integer, nullable=False, server_default=text("0")),
    Column("cost_usd", Numeric(18, 8), nullable=False, server_default=text("0")),
    Column("latency_ms", Integer),
    Column("request_id", Text),
    Column("error", Text),
    # An operator's decision on a tool step left STARTED (NEEDS_ATTENTION): 'retry'.
    Column("resolution", Text),
    # Durable functions: attempts of a retried step; the hash of an approval step's input.
    Column("attempt", Integer, nullable=False, server_default=text("0")),
    Column("input_hash", Text),
    # A completed step's compensation: 'module:qualname' (importable), 'step:<path>' (a
    # @step's declared compensation) or '*' (a closure known only to the code that ran it).
    Column("compensation", Text),
    Column("worker", Text),
    Column("lease_epoch", BigInteger, nullable=False),
    Column("started_at", TZ, nullable=False, server_default=text("now()")),
    Column("finished_at", TZ),
    # A fork's step it did not execute: 'copied' (from the original), 'edited' (copied, its
    # result replaced by the fork's edit) or 'replayed' (a model step answered from the
    # original's recorded response). Such a row bills nothing (its token and cost columns
    # are 0); what the original paid for it is kept apart.
    Column("origin", Text),
    Column("original_tokens", BigInteger),
    Column("original_cost_usd", Numeric(18, 8)),
    PrimaryKeyConstraint("run_id", "seq", name="run_step_pkey"),
    CheckConstraint(
        "kind IN ('MODEL', 'TOOL', 'STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'COMPENSATION', "
        "'VERSION', 'TOOLSET', 'WAIT', 'SEND', 'CHILD', 'MESSAGE')",
        name="run_step_kind_ck",
    ),
    CheckConstraint(
        "status IN ('STARTED', 'DONE', 'ERROR', 'RETRYING', 'PENDING', 'APPROVED', 'REJECTED', "
        "'PAUSED')",
        name="run_step_status_ck",
    ),
    CheckConstraint("origin IN ('copied', 'edited', 'replayed')", name="run_step_origin_ck"),
)

Index("run_step_key_uk", run_step.c.run_id, run_step.c.step_key, unique=True)
# The console's stats read the steps finished in a window, from the index alone (0013).
Index(
    "run_step_finished_idx",
    run_step.c.finished_at,
    postgresql_include=["kind", "model", "cost_usd", "latency_ms", "started_at", "run_id"],
    postgresql_where=text("finished_at IS NOT NULL"),
)
Index(
    "step_tool_uk",
    run_step.c.run_id,
    run_step.c.tool_use_id,
    unique=True,
    postgresql_where=text("kind = 'TOOL'"),
)

# A human decision a durable function waits for. Bound to a hash of exactly what is approved
# (the step key and its input), shown to the approver and checked on decision.
approval = Table(
    "approval",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
    Column("step_key", Text, nullable=False),
    Column("role", Text, nullable=False),
    Column("status", Text, nullable=False, server_default=text("'PENDING'")),
    Column("payload", JSONB, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("timeout_policy", Text, nullable=False),
    Column("requested_at", TZ, nullable=False, server_default=text("now()")),
    Column("expires_at", TZ, nullable=False),
    Column("decided_by", Text),
    Column("decided_at", TZ),
    Column("comment", Text),
    # A decision a fork copied from the run it was forked from (that run's id): history the
    # fork replays, never a decision made for the fork.
    Column("copied_from", UUID(as_uuid=True)),
    CheckConstraint(
        "status IN ('PENDING', 'APPROVED', 'REJECTED', 'EXPIRED', 'CANCELLED')",
        name="approval_status_ck",
    ),
    CheckConstraint("timeout_policy IN ('FAIL', 'REJECT', 'APPROVE')", name="approval_policy_ck"),
    UniqueConstraint("run_id", "step_key", name="approval_run_step_uk"),
)
Index(
    "approval_pending_idx",
    approval.c.role,
    approval.c.requested_at,
    postgresql_where=text("status = 'PENDING'"),
)
Index("approval_expiry_idx", approval.c.expires_at, postgresql_where=text("status = 'PENDING'"))

# The run's durable events for the live stream, numbered per run in commit order. Written
# only by the triggers of migration 0010 (a status change, a step row started or finished, an
# approval requested or decided); read by GET /api/runs/{id}/events.
run_event = Table(
    "run_event",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
    Column("n", BigInteger, nullable=False),
    Column("kind", Text, nullable=False),
    Column("step_seq", Integer),
    Column("approval_id", UUID(as_uuid=True)),
    Column("status", Text),
    Column("at", TZ, nullable=False, server_default=text("now()")),
    Column("audit_id", BigInteger),  # a run.recovery event's audit_event row (migration 0019)
    PrimaryKeyConstraint("run_id", "n", name="run_event_pkey"),
    CheckConstraint(
        "kind IN ('run.status', 'step.started', 'step.finished', 'approval.requested', "
        "'approval.decided', 'run.recovery')",
        name="run_event_kind_ck",
    ),
)

# A signal for a run (migration 0015): kept until a step of the run consumes it, in the
# transaction that records the step (delivered once, and kept for a wait that comes later).
run_signal = Table(
    "run_signal",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
    Column("name", Text, nullable=False),
    Column("payload", JSONB),
    # A retried POST, or the sending step's idempotency key (steps.send): one signal.
    Column("idempotency_key", Text),
    Column("sent_by", Text),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
    # The step key that consumed it.
    Column("consumed_by", Text),
    Column("consumed_at", TZ),
)
Index(
    "run_signal_idempotency_uk",
    run_signal.c.run_id,
    run_signal.c.idempotency_key,
    unique=True,
    postgresql_where=text("idempotency_key IS NOT NULL"),
)
Index(
    "run_signal_pending_idx",
    run_signal.c.run_id,
    run_signal.c.name,
    run_signal.c.id,
    postgresql_where=text("consumed_by IS NULL"),
)

# A model call in flight in a run tree with a shared budget (migration 0024): the call's
# worst case (estimated input + max_tokens, and its price), held against the root's budget
# from its admission until its tokens are counted on the run. Only runs with a parent write
# here. One row per lease: a row of an earlier lease of a live run is a call lost with its
# worker (counted as spent until the run's next call settles); a row of an ended run, or
# of a call recorded under its lease, is swept (runtime.pipeline.modelcall.share_tree_budget).
budget_hold = Table(
    "budget_hold",
    metadata,
    Column("run_id", UUID(as_uuid=True), ForeignKey("run.id", ondelete="CASCADE"), nullable=False),
    Column("lease_epoch", BigInteger, nullable=False),
    Column("root_run_id", UUID(as_uuid=True), nullable=False),
    Column("step_key", Text, nullable=False),
    Column("tokens", BigInteger, nullable=False),
    Column("cost_usd", Numeric(18, 8), nullable=False),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
    PrimaryKeyConstraint("run_id", "lease_epoch", name="budget_hold_pkey"),
)
Index("budget_hold_root_idx", budget_hold.c.root_run_id)

AUDIT_ACTIONS = (
    "cancel",
    "resume",
    "resolve",
    "approve",
    "reject",
    "fork",
    "submit",
    "timeout",
    # The runtime's own, with actor "reaper" or the worker: a run recovered after a crash
    # (migration 0019). Each is also a run.recovery event of the run's live stream.
    "recovery.redispatched",
    "recovery.resumed",
    # The new surfaces (migration 0026): a schedule's create and delete (on the schedule, no
    # run), a message or signal sent to a run (with its sender, key and size).
    "schedule.create",
    "schedule.delete",
    "message",
    "signal",
    # An operator moved a run to another version after a clean replay check (migration 0050).
    "upgrade",
)

# Who did what to a run, through the API: append-only (a trigger refuses UPDATE and DELETE).
# No foreign key: the trail outlives the run when retention deletes it.
audit_event = Table(
    "audit_event",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("at", TZ, nullable=False, server_default=text("now()")),
    Column("run_id", UUID(as_uuid=True)),  # none for a schedule's own entries (0026)
    Column("approval_id", UUID(as_uuid=True)),
    Column("tenant", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("detail", JSONB),
    Column("schedule_id", UUID(as_uuid=True)),
    CheckConstraint(
        "action IN (" + ", ".join(f"'{a}'" for a in AUDIT_ACTIONS) + ")",
        name="audit_event_action_ck",
    ),
)
Index("audit_event_run_idx", audit_event.c.run_id, audit_event.c.at)
Index(
    "audit_event_schedule_idx",
    audit_event.c.schedule_id,
    audit_event.c.at,
    postgresql_where=text("schedule_id IS NOT NULL"),
)
Index(
    "audit_event_actor_idx",
    audit_event.c.actor,
    audit_event.c.action,
    audit_event.c.at,
    postgresql_where=text("action IN ('message', 'signal', 'resume')"),
)

SCHEDULE_OVERLAPS = ("skip", "queue", "allow")
SCHEDULE_CATCH_UPS = ("none", "latest", "all")
TICK_STATUSES = ("STARTED", "SKIPPED", "QUEUED")

# An agent started on a cron expression (migration 0014): what each run gets, and the next
# tick no beat has claimed yet.
schedule = Table(
    "schedule",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("tenant", Text, nullable=False, server_default=text("''")),
    Column("agent", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("model", Text, nullable=False),
    Column("max_steps", Integer, nullable=False),
    Column("token_budget", BigInteger, nullable=False),
    Column("timeout_seconds", Integer, nullable=False),
    Column("cost_budget_usd", Numeric(18, 8)),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("overlap", Text, nullable=False),
    Column("catch_up", Text, nullable=False),
    Column("next_tick_at", TZ, nullable=False),
    Column("created_by", Text),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
    CheckConstraint(
        "overlap IN (" + ", ".join(f"'{o}'" for o in SCHEDULE_OVERLAPS) + ")",
        name="schedule_overlap_ck",
    ),
    CheckConstraint(
        "catch_up IN (" + ", ".join(f"'{c}'" for c in SCHEDULE_CATCH_UPS) + ")",
        name="schedule_catch_up_ck",
    ),
)
Index("schedule_next_tick_idx", schedule.c.next_tick_at)
Index("schedule_tenant_created_idx", schedule.c.tenant, schedule.c.created_at)

# One row per tick of a schedule, unique per (schedule, tick time): the insert that wins
# starts the tick's run in its transaction; every other beat's insert does nothing.
schedule_tick = Table(
    "schedule_tick",
    metadata,
    Column(
        "schedule_id",
        UUID(as_uuid=True),
        ForeignKey("schedule.id", ondelete="CASCADE"),
        nullable=False,
    ),
    Column("tick_at", TZ, nullable=False),
    Column("status", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True)),
    Column("created_at", TZ, nullable=False, server_default=text("now()")),
    Column("reason", Text),  # why a tick started no run (migration 0026)
    UniqueConstraint("schedule_id", "tick_at", name="schedule_tick_uk"),
    CheckConstraint(
        "status IN (" + ", ".join(f"'{t}'" for t in TICK_STATUSES) + ")",
        name="schedule_tick_status_ck",
    ),
)
Index("schedule_tick_created_idx", schedule_tick.c.created_at)
Index(
    "schedule_tick_queued_idx",
    schedule_tick.c.schedule_id,
    schedule_tick.c.tick_at,
    postgresql_where=text("status = 'QUEUED'"),
)

# The console's overview per closed UTC hour (migration 0023): what GET /api/stats returns
# for that hour, for every tenant together (every_tenant, tenant '') and per tenant; kept by
# the beat, read for the hours of the window it holds.
stats_rollup = Table(
    "stats_rollup",
    metadata,
    Column("every_tenant", Boolean, nullable=False),
    Column("tenant", Text, nullable=False),
    Column("bucket", TZ, nullable=False),
    Column("section", Text, nullable=False),
    Column("key", Text, nullable=False),
    Column("n", BigInteger),
    Column("usd", Numeric),
    Column("p50", Double),
    Column("p95", Double),
    PrimaryKeyConstraint(
        "every_tenant", "tenant", "bucket", "section", "key", name="stats_rollup_pkey"
    ),
    CheckConstraint("section IN ('finished', 'cost', 'latency')", name="stats_rollup_section_ck"),
)
Index("stats_rollup_bucket_idx", stats_rollup.c.bucket)

# The hours stats_rollup holds (an hour without activity has no row there).
stats_hour = Table(
    "stats_hour",
    metadata,
    Column("bucket", TZ, primary_key=True),
    Column("rolled_at", TZ, nullable=False, server_default=text("now()")),
)

# Hours a write changed after they were rolled up (the triggers of migration 0023): read raw
# until rolled up again. One row per write, duplicates allowed.
stats_hour_dirty = Table(
    "stats_hour_dirty",
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("bucket", TZ, nullable=False),
    Column("at", TZ, nullable=False, server_default=text("now()")),
)
Index("stats_hour_dirty_bucket_idx", stats_hour_dirty.c.bucket)

# The versions workers serve (migration 0050): each worker process upserts its row at every
# heartbeat; a version whose rows are all stale has no worker (GET /api/versions).
deployment_worker = Table(
    "deployment_worker",
    metadata,
    Column("worker", Text, primary_key=True),
    Column("deployment", Text, primary_key=True),
    Column("started_at", TZ, nullable=False, server_default=text("now()")),
    Column("last_seen", TZ, nullable=False, server_default=text("now()")),
)

# Each version's agent definitions (migration 0050), recorded by the first process of that
# version: what the replay check compares the new code's configuration with.
deployment_agent = Table(
    "deployment_agent",
    metadata,
    Column("deployment", Text, primary_key=True),
    Column("agent", Text, primary_key=True),
    Column("definition", JSONB, nullable=False),
    Column("recorded_at", TZ, nullable=False, server_default=text("now()")),
)
