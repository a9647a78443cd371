-- Every SQL statement of the runtime, named once. Loaded by db/queries.py; only db/store/
-- uses them (the demo's own tables have theirs in db/demo.sql). Parameters are SQLAlchemy ":name" binds. A name starting with "_"
-- is a fragment shared by statements, not a statement: a line {{_name}} stands for it.
--
-- The fence: every write a worker makes after claiming is conditioned on
--   locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING'
-- and the caller raises LeaseLost (rolling back) when it matches no row. Times come from the
-- database's clock (now()), never the worker's.

-- create_run --
-- A new QUEUED run. With an idempotency key that exists already nothing is inserted and the
-- caller reads the existing run instead.
-- Idempotency keys are scoped to the tenant: another tenant's key is another key.
-- Its version (deployment): a child's is its parent's, any other run's :deployment.
INSERT INTO run (id, agent, input, model, max_steps, token_budget, cost_budget_usd,
                 deadline_at, dispatch_token, idempotency_key, request_hash, submitted_by,
                 tenant, timeout_seconds, concurrency_key, priority, schedule_id,
                 parent_run_id, deployment)
VALUES (:id, :agent, CAST(:input AS jsonb), :model, :max_steps, :token_budget,
        :cost_budget_usd, now() + make_interval(secs => :timeout_seconds), :token,
        :idempotency_key, :request_hash, :submitted_by, :tenant, :timeout_seconds,
        :concurrency_key, :priority, :schedule_id, :parent_run_id,
        COALESCE((SELECT p.deployment FROM run p WHERE p.id = :parent_run_id),
                 CAST(:deployment AS text)))
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING *;

-- get_run_by_idempotency_key --
SELECT * FROM run WHERE tenant = :tenant AND idempotency_key = :idempotency_key;

-- get_run --
SELECT * FROM run WHERE id = :id;

-- _claim_due --
-- A fragment, not a statement: a statement's line {{_claim_due}} stands for it. The run of
-- the drive_run message carrying its current dispatch token, when it is due and no lease on
-- it is live.
-- A worker serving a version (:deployment) claims only runs of that version, or of none
-- (stored before versions); NULL :deployment claims any (a test's driver, a plain loop).
    WHERE id = :id AND dispatch_token = :token
      AND status IN ('QUEUED', 'RUNNING') AND run_at <= now()
      AND (locked_until IS NULL OR locked_until < now())
      AND (deployment IS NULL OR CAST(:deployment AS text) IS NULL
           OR deployment = CAST(:deployment AS text))

-- _claim_set --
-- A fragment, not a statement: a statement's line {{_claim_set}} stands for it. What every
-- claim writes: the lease to :worker, a new fencing token (lease_epoch), one more claim since
-- the last checkpoint.
UPDATE run r
SET status = 'RUNNING', locked_by = :worker,
    locked_until = now() + make_interval(secs => :lease_seconds),
    lease_epoch = r.lease_epoch + 1,
    claims_without_progress = r.claims_without_progress + 1,
    updated_at = now()

-- claim_run --
-- Claim one run for the drive_run message carrying its current dispatch token. A stale or
-- duplicated message, a run whose lease is live, a timer not yet due: no row. Bumps the
-- fencing token (lease_epoch) and counts claims since the last checkpoint.
-- FOR UPDATE waits (briefly) instead of SKIP LOCKED: a row lock held for a moment by another
-- transaction (a heartbeat whose UPDATE re-checked the row the previous step just handed over
-- keeps that lock until it commits) must not make the message carrying the current token
-- look stale. Every transaction on a run row is short, so the wait is too.
WITH target AS (
    SELECT id FROM run
{{_claim_due}}
    FOR UPDATE
)
{{_claim_set}}
FROM target WHERE r.id = target.id
RETURNING r.*, now() AS db_now;

-- claim_run_to_end --
-- claim_run, for the worker that has just handed the run on with :token after a step that
-- ended its conversation, to end the run itself instead of sending the message: the same
-- claim, only when no message was posted to the run meanwhile (delivering one is a step of
-- its own, for the message to carry to any worker).
WITH target AS (
    SELECT id FROM run
{{_claim_due}}
      AND messages_pending = 0
    FOR UPDATE
)
{{_claim_set}}
FROM target WHERE r.id = target.id
RETURNING r.*, now() AS db_now;

-- claim_next_run --
-- Claim whichever run is due, for a driver that polls instead of taking messages: QUEUED
-- rows, and RUNNING rows whose lease has lapsed. Concurrent claimers skip each other's rows.
WITH next AS (
    SELECT id FROM run
    WHERE status IN ('QUEUED', 'RUNNING') AND run_at <= now()
      AND (locked_until IS NULL OR locked_until < now())
      AND (deployment IS NULL OR CAST(:deployment AS text) IS NULL
           OR deployment = CAST(:deployment AS text))
    ORDER BY run_at
    FOR UPDATE SKIP LOCKED
    LIMIT 1
)
{{_claim_set}}
FROM next WHERE r.id = next.id
RETURNING r.*, now() AS db_now;

-- renew_leases --
-- The heartbeat: extend every lease this worker still holds, one statement for all of them.
-- A row another transaction holds locked is skipped, not waited for: on a saturated gevent
-- worker one greenlet's write may hold its run's row for seconds, and waiting for it let every
-- other lease lapse and be taken over (skipped, it is renewed at the next beat; while locked,
-- no claim can take it).
-- Returns each run asked about with its current epoch and whether it was renewed: one not
-- renewed with a higher epoch was taken over; with the same epoch this worker released it
-- (a step committed meanwhile).
WITH lockable AS (
    SELECT r.id
    FROM run r
    JOIN unnest(CAST(:ids AS uuid[]), CAST(:epochs AS bigint[])) AS held(id, epoch)
      ON r.id = held.id AND r.lease_epoch = held.epoch
    WHERE r.locked_by = :worker AND r.status = 'RUNNING'
    FOR UPDATE OF r SKIP LOCKED
), renewed AS (
    UPDATE run r
    SET locked_until = now() + make_interval(secs => :lease_seconds)
    FROM lockable
    WHERE r.id = lockable.id
    RETURNING r.id
)
SELECT r.id, r.lease_epoch, EXISTS (SELECT 1 FROM renewed WHERE renewed.id = r.id) AS renewed
FROM run r
WHERE r.id = ANY(CAST(:ids AS uuid[]));

-- renew_claims --
-- The heartbeat, for claims this worker has sent and not yet read the answer of (on a busy
-- gevent hub a greenlet may read it seconds after it committed, while its lease runs): the
-- live lease of each run claimed by :worker for the message carrying the token given,
-- whatever its epoch (not known yet). A run another worker holds, or whose token moved on,
-- is left; so is a lapsed lease: a claim's own is renewed before it lapses (a beat is a
-- third of a lease), and a lapsed one under the same name and token is a dead predecessor's
-- (names collide), which the claim being sent is there to take over.
UPDATE run r
SET locked_until = now() + make_interval(secs => :lease_seconds)
FROM unnest(CAST(:ids AS uuid[]), CAST(:tokens AS uuid[])) AS claiming(id, token)
WHERE r.id = claiming.id AND r.dispatch_token = claiming.token
  AND r.locked_by = :worker AND r.status = 'RUNNING' AND r.locked_until > now();

-- record_step --
-- Record one step row, fenced, in ONE statement (one round trip, one commit): the run must
-- still be held by this worker under this lease epoch, else nothing is written and no row is
-- returned (the caller raises LeaseLost). The row's tokens and cost are added to the run, the
-- no-progress counter and the model attempts of the step in flight are reset, and with
-- :hand_over the lease is handed on to the next drive_run message (a new dispatch token).
-- A key seen before (a STARTED tool or step, a retried or approved step) keeps its seq and
-- gets its new status, result and attempt; its tokens add up. Returns the row written (the
-- store keeps the step log of the runs it hands on: see db/steplog.py).
WITH fenced AS (
    UPDATE run
    SET tokens_used = tokens_used + :total_tokens,
        input_tokens = input_tokens + :input_tokens,
        output_tokens = output_tokens + :output_tokens,
        cache_creation_input_tokens = cache_creation_input_tokens
                                      + :cache_creation_input_tokens,
        cache_read_input_tokens = cache_read_input_tokens + :cache_read_input_tokens,
        cost_usd = cost_usd + :cost_usd,
        claims_without_progress = 0, model_attempts = 0,
        locked_by = CASE WHEN :hand_over THEN NULL ELSE locked_by END,
        locked_until = CASE WHEN :hand_over THEN NULL ELSE locked_until END,
        dispatch_token = CASE WHEN :hand_over THEN CAST(:next_token AS uuid)
                              ELSE dispatch_token END,
        dispatched_at = CASE WHEN :hand_over THEN now() ELSE dispatched_at END,
        wait_reason = CASE WHEN :hand_over THEN NULL ELSE wait_reason END,
        updated_at = now()
    WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING'
    RETURNING id
)
INSERT INTO run_step (run_id, seq, step_key, kind, status, response, error, attempt,
                      input_hash, model, request, prompt_hash, input_tokens, output_tokens,
                      cache_creation_input_tokens, cache_read_input_tokens, cost_usd,
                      latency_ms, request_id, tool_name, tool_use_id, compensation,
                      stop_reason, worker, lease_epoch, started_at, finished_at)
SELECT fenced.id, :seq, :step_key, :kind, :status, CAST(:response AS jsonb), :error, :attempt,
       :input_hash, :model, CAST(:request AS jsonb), :prompt_hash, :input_tokens,
       :output_tokens, :cache_creation_input_tokens, :cache_read_input_tokens, :cost_usd,
       :latency_ms, :request_id, :tool_name, :tool_use_id, :compensation, :stop_reason,
       :worker, :epoch,
       now() - make_interval(secs => COALESCE(:latency_ms, 0) / 1000.0),
       CASE WHEN :status IN ('DONE', 'ERROR', 'REJECTED') THEN now() END
FROM fenced
ON CONFLICT (run_id, step_key) DO UPDATE
SET status = EXCLUDED.status, response = EXCLUDED.response, error = EXCLUDED.error,
    compensation = COALESCE(EXCLUDED.compensation, run_step.compensation),
    attempt = EXCLUDED.attempt, input_hash = COALESCE(EXCLUDED.input_hash, run_step.input_hash),
    model = COALESCE(EXCLUDED.model, run_step.model),
    request = COALESCE(EXCLUDED.request, run_step.request),
    prompt_hash = COALESCE(EXCLUDED.prompt_hash, run_step.prompt_hash),
    input_tokens = run_step.input_tokens + EXCLUDED.input_tokens,
    output_tokens = run_step.output_tokens + EXCLUDED.output_tokens,
    cache_creation_input_tokens = run_step.cache_creation_input_tokens
                                  + EXCLUDED.cache_creation_input_tokens,
    cache_read_input_tokens = run_step.cache_read_input_tokens
                              + EXCLUDED.cache_read_input_tokens,
    cost_usd = run_step.cost_usd + EXCLUDED.cost_usd,
    latency_ms = EXCLUDED.latency_ms, request_id = EXCLUDED.request_id,
    stop_reason = EXCLUDED.stop_reason,
    worker = EXCLUDED.worker, lease_epoch = EXCLUDED.lease_epoch,
    finished_at = EXCLUDED.finished_at,
    -- written by this run's worker: the run's own now, no longer a fork's copy of its source
    origin = NULL, original_tokens = NULL, original_cost_usd = NULL
RETURNING *;

-- hand_over_run --
-- Hand the lease on without a step row (after several rows were recorded, each fenced, in
-- the same transaction). Fenced.
UPDATE run
SET locked_by = NULL, locked_until = NULL,
    dispatch_token = :next_token, dispatched_at = now(),
    wait_reason = NULL, updated_at = now()
WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING';

-- schedule_run --
-- A durable timer: the step could not run now (rate limited, overloaded, a retry backoff).
-- Release the lease and set run_at; no worker slot waits. dispatched_at stays before run_at,
-- so the reaper re-dispatches the run at its first sweep after the timer is due unless the
-- countdown message (when one was sent) claimed it first: a countdown that fires early (the
-- worker's clock ahead of the database's) or is lost costs at most one reaper interval.
-- A timer is not progress: claims_without_progress is reset only when step rows were
-- recorded with it (:progress). model_attempts carries the attempts of the step in flight.
-- Fenced.
-- An admission wait (a key slot or a model's limit refused the step before it began) hands
-- back the claim's count too: waiting for capacity is not a claim that stopped its worker.
-- :wakeable: the run waits for what may come sooner (a signal, a child's end, a key slot, flow
-- control's capacity: asked again when it wakes), and
-- a wake (wake_run) brings it forward; otherwise the timer is a floor (a server's retry-after,
-- a backoff, a sleep) that no wake crosses.
-- A timer never lies beyond the run's deadline: a run parked on a long sleep or wait is sent
-- at its deadline (by the reaper), and the guard ends it TIMED_OUT, instead of it staying
-- RUNNING, in flight, past it.
UPDATE run
SET run_at = LEAST(now() + make_interval(secs => :delay_seconds), GREATEST(deadline_at, now())),
    dispatched_at = now(),
    dispatch_token = :next_token,
    locked_by = NULL, locked_until = NULL,
    claims_without_progress = CASE WHEN :progress THEN 0
                                   WHEN :admission THEN GREATEST(claims_without_progress - 1, 0)
                                   ELSE claims_without_progress END,
    model_attempts = :model_attempts,
    wait_reason = :reason,
    wake_floor = CASE WHEN :wakeable THEN NULL
                      ELSE LEAST(now() + make_interval(secs => :delay_seconds),
                                 GREATEST(deadline_at, now())) END,
    updated_at = now()
WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING';

-- record_unrecorded_usage --
-- A model call was billed but its checkpoint was refused (lease lost, run ended meanwhile),
-- or was lost with its worker (then an estimate, counted in unrecorded_estimated_tokens too).
-- Not fenced on purpose: the money was spent whoever holds the run now. With :step_key, only
-- unless that step's row was written under :epoch (a checkpoint whose commit was not seen,
-- its connection dropped: it is counted on its row already).
UPDATE run
SET unrecorded_tokens = unrecorded_tokens + :total_tokens,
    unrecorded_cost_usd = unrecorded_cost_usd + :cost_usd,
    unrecorded_estimated_tokens = unrecorded_estimated_tokens + :estimated_tokens
WHERE id = :id
  AND (CAST(:step_key AS text) IS NULL OR NOT EXISTS (
        SELECT 1 FROM run_step s
        WHERE s.run_id = :id AND s.step_key = :step_key AND s.lease_epoch = :epoch
          AND s.origin IS NULL));

-- start_step --
-- Write a step with an effect STARTED before its code runs (a tool, a durable step, an
-- approved action, a compensation). Entering it again (a retry, an operator's one-time
-- 'retry', a paused body) rewrites the same row and consumes the resolution. Fenced: no row
-- when the lease is gone.
INSERT INTO run_step (run_id, seq, step_key, kind, status, tool_name, tool_use_id, attempt,
                      input_hash, worker, lease_epoch)
SELECT r.id, :seq, :step_key, :kind, 'STARTED', :tool_name, :tool_use_id, :attempt,
       :input_hash, :worker, :epoch
FROM run r
WHERE r.id = :id AND r.locked_by = :worker AND r.lease_epoch = :epoch AND r.status = 'RUNNING'
-- The row lock makes the fence hold: a claim committed meanwhile is seen after the wait.
FOR SHARE OF r
ON CONFLICT (run_id, step_key) DO UPDATE
SET status = 'STARTED', resolution = NULL, attempt = EXCLUDED.attempt, error = NULL,
    input_hash = COALESCE(EXCLUDED.input_hash, run_step.input_hash),
    worker = EXCLUDED.worker, lease_epoch = EXCLUDED.lease_epoch,
    started_at = now(), finished_at = NULL
RETURNING *;

-- finish_run --
-- End the run (or park it for a human, NEEDS_ATTENTION), releasing the lease. Fenced.
-- A cancel requested meanwhile turns parking for a human into the end of the run.
-- A run about to end SUCCEEDED with a message posted meanwhile (messages_pending) goes on
-- instead: it stays RUNNING, unheld and due, for the reaper's next sweep to send (a message
-- is never left behind by the end of its conversation).
-- Returns the run as it ends (no second read of it to log and count its end).
UPDATE run
SET status = CASE WHEN :status = 'NEEDS_ATTENTION' AND cancel_requested THEN 'CANCELLED'
                  WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN 'RUNNING'
                  ELSE :status END,
    result = CASE WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN NULL
                  ELSE CAST(:result AS jsonb) END,
    error = CASE WHEN :status = 'NEEDS_ATTENTION' AND cancel_requested
                 THEN 'cancelled by request' ELSE :error END,
    locked_by = NULL, locked_until = NULL,
    finished_at = CASE WHEN :status = 'NEEDS_ATTENTION' AND NOT cancel_requested THEN NULL
                       WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN NULL
                       ELSE now() END,
    run_at = CASE WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN now()
                  ELSE run_at END,
    dispatched_at = CASE WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN 'epoch'
                         ELSE dispatched_at END,
    -- going on with a message is progress: the claim that ended it is no failed one (else
    -- the next claim is taken for a recovery, as in message_arrived)
    claims_without_progress = CASE WHEN :status = 'SUCCEEDED' AND messages_pending > 0 THEN 0
                                   ELSE claims_without_progress END,
    updated_at = now()
WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING'
RETURNING *;

-- begin_stop --
-- A run the engine stops early (its worker kept dying) keeps the reason on the row while its
-- compensations run, one per task: the next task reads it and goes on unwinding instead of
-- running the function again. Only RUNNING has an error while running. Fenced.
UPDATE run
SET error = :error, updated_at = now()
WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING'
RETURNING status;

-- _undo_left --
-- A fragment, not a statement: a line {{_undo_left}} stands for it, in a statement over run
-- r. Whether the run may have a compensation left to run: a completed step of a compensable
-- kind (:compensable, db.store.COMPENSABLE_KINDS: the rows of every kind the pipeline's table
-- declares compensable; a unit test keeps the two equal) or with a declared compensation,
-- not a fork's copy (never undone by the fork), not a model call inside a step, and not
-- compensated yet. Only the function's code knows for sure: a worker looks.
EXISTS (
    SELECT 1 FROM run_step s
    WHERE s.run_id = r.id AND s.status = 'DONE' AND s.origin IS NULL
      AND (s.kind = ANY(CAST(:compensable AS text[])) OR s.compensation IS NOT NULL)
      AND s.step_key !~ '/(llm|usage):[0-9]+$'
      AND NOT EXISTS (
          SELECT 1 FROM run_step c
          WHERE c.run_id = s.run_id AND c.step_key = 'compensate:' || s.step_key
            AND c.status IN ('DONE', 'ERROR'))
) AS undo

-- cancel_run --
-- Cooperative cancel. A run no worker holds (queued, between steps, parked) ends at once,
-- unless it is a durable function with completed steps that may have compensations (only
-- its code knows): then it is handed to the next reaper sweep (RUNNING, due now) so a worker
-- runs them, one per task, and ends it CANCELLED. A run whose lease is live notices at its
-- next guard.
WITH state AS (
    SELECT r.id,
           (r.locked_until IS NULL OR r.locked_until < now()) AS free,
{{_undo_left}}
    FROM run r
    WHERE r.id = :id AND r.status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')
    FOR UPDATE OF r
)
UPDATE run
SET cancel_requested = true,
    status = CASE WHEN NOT state.free THEN run.status
                  WHEN state.undo THEN 'RUNNING' ELSE 'CANCELLED' END,
    error = CASE WHEN state.free AND NOT state.undo THEN 'cancelled by request'
                 ELSE run.error END,
    finished_at = CASE WHEN state.free AND NOT state.undo THEN now() ELSE run.finished_at END,
    locked_by = CASE WHEN state.free THEN NULL ELSE run.locked_by END,
    dispatch_token = CASE WHEN state.free AND state.undo THEN gen_random_uuid()
                          ELSE run.dispatch_token END,
    dispatched_at = CASE WHEN state.free AND state.undo THEN 'epoch' ELSE run.dispatched_at END,
    run_at = CASE WHEN state.free AND state.undo THEN now() ELSE run.run_at END,
    updated_at = now()
FROM state WHERE run.id = state.id
RETURNING run.status, run.parent_run_id;

-- resolve_reopen_run --
-- An operator resolved a NEEDS_ATTENTION run: it runs again under a new dispatch token.
UPDATE run
SET status = 'RUNNING', error = NULL, claims_without_progress = 0,
    dispatch_token = :next_token, dispatched_at = now(), updated_at = now()
WHERE id = :id AND status = 'NEEDS_ATTENTION'
RETURNING id;

-- resolve_supply_result --
-- The operator supplies the result of the step left STARTED: the outermost one, which is the
-- one replay meets first and the one the run's reason names (a step nested in it is asked
-- about, if still in doubt, once the outer one is settled).
UPDATE run_step
SET status = :status, response = CAST(:response AS jsonb), resolution = 'supplied',
    error = CASE WHEN :status = 'ERROR' THEN 'supplied by ' || :operator END,
    worker = :operator, finished_at = now()
WHERE run_id = :id AND status = 'STARTED'
  AND seq = (SELECT min(seq) FROM run_step WHERE run_id = :id AND status = 'STARTED');

-- resolve_retry_step --
-- The operator authorises exactly one more execution of the step left STARTED: the flag is
-- consumed when the step is written STARTED again.
UPDATE run_step SET resolution = 'retry'
WHERE run_id = :id AND status = 'STARTED'
  AND seq = (SELECT min(seq) FROM run_step WHERE run_id = :id AND status = 'STARTED');

-- resolve_fail_run --
-- An operator fails a NEEDS_ATTENTION run: the engine's stop, as for a cancel. With nothing to
-- undo it ends FAILED here; a durable function that may have compensations left is handed to
-- a worker (RUNNING, due now, under :next_token, its error the stop's reason: every task of
-- it then unwinds, Task.stopping), whose stop runs them, one per task, and ends it FAILED.
-- The run's children are cancelled by the caller in the same transaction.
WITH state AS (
    SELECT r.id,
{{_undo_left}}
    FROM run r
    WHERE r.id = :id AND r.status = 'NEEDS_ATTENTION'
    FOR UPDATE OF r
)
UPDATE run
SET status = CASE WHEN state.undo THEN 'RUNNING' ELSE 'FAILED' END,
    error = :error,
    finished_at = CASE WHEN state.undo THEN NULL ELSE now() END,
    dispatch_token = CASE WHEN state.undo THEN :next_token ELSE run.dispatch_token END,
    dispatched_at = CASE WHEN state.undo THEN now() ELSE run.dispatched_at END,
    run_at = CASE WHEN state.undo THEN now() ELSE run.run_at END,
    wake_floor = NULL, claims_without_progress = 0,
    updated_at = now()
FROM state WHERE run.id = state.id
RETURNING run.id, run.status;

-- suspend_run --
-- Suspend for a human: no lease, no worker slot, a new dispatch token so any message still
-- in flight for the run is stale. Fenced.
-- A cancel that arrived while the step ran ends the run instead.
UPDATE run
SET status = CASE WHEN cancel_requested THEN 'CANCELLED' ELSE 'WAITING' END,
    error = CASE WHEN cancel_requested THEN 'cancelled by request' ELSE error END,
    finished_at = CASE WHEN cancel_requested THEN now() ELSE finished_at END,
    locked_by = NULL, locked_until = NULL,
    dispatch_token = :next_token, claims_without_progress = 0,
    wait_reason = :reason, updated_at = now()
WHERE id = :id AND locked_by = :worker AND lease_epoch = :epoch AND status = 'RUNNING'
RETURNING status;

-- insert_approval --
INSERT INTO approval (id, run_id, step_key, role, payload, payload_hash, timeout_policy,
                      expires_at)
VALUES (:approval_id, :id, :step_key, :role, CAST(:payload AS jsonb), :payload_hash,
        :timeout_policy, now() + make_interval(secs => :timeout_seconds))
-- Asked again for the same step (a resumed run whose approval expired): ask afresh.
ON CONFLICT (run_id, step_key) DO UPDATE
SET status = 'PENDING', payload = EXCLUDED.payload, payload_hash = EXCLUDED.payload_hash,
    role = EXCLUDED.role, timeout_policy = EXCLUDED.timeout_policy,
    requested_at = now(), expires_at = EXCLUDED.expires_at,
    decided_by = NULL, decided_at = NULL, comment = NULL, copied_from = NULL
RETURNING id;

-- lock_run_of_approval --
-- Decisions lock the run before the approval, in the same order as cancel, so the two
-- cannot deadlock.
SELECT r.id FROM run r JOIN approval a ON a.run_id = r.id
WHERE a.id = :approval_id
FOR UPDATE OF r;

-- decide_approval --
-- A decision on a PENDING approval, only for the payload the approver was shown.
UPDATE approval
SET status = :status, decided_by = :decided_by, decided_at = now(), comment = :comment
WHERE id = :approval_id AND status = 'PENDING'
  AND (CAST(:payload_hash AS text) IS NULL OR payload_hash = :payload_hash)
RETURNING run_id, step_key;

-- set_step_status --
UPDATE run_step
SET status = :status, error = :error,
    finished_at = CASE WHEN :status IN ('DONE', 'ERROR', 'REJECTED') THEN now() END
WHERE run_id = :id AND step_key = :step_key;

-- wake_waiting_run --
-- A decision wakes the run where it stopped: a new dispatch token, a message follows.
UPDATE run
SET status = 'RUNNING', dispatch_token = :next_token, dispatched_at = now(),
    wait_reason = NULL, updated_at = now()
WHERE id = :id AND status = 'WAITING'
RETURNING id;

-- get_approval --
-- One approval, if its run is in :tenant (NULL: any tenant). Another tenant's approval and
-- no approval are the same statement, the same plan and the same empty answer: its time does
-- not tell the two apart.
SELECT a.* FROM approval a JOIN run r ON r.id = a.run_id
WHERE a.id = :approval_id AND (CAST(:tenant AS text) IS NULL OR r.tenant = :tenant);

-- list_approvals --
SELECT * FROM approval
WHERE (CAST(:status AS text) IS NULL OR status = :status)
  AND (CAST(:role AS text) IS NULL OR role = :role)
  AND (CAST(:run_id AS uuid) IS NULL OR run_id = :run_id)
  AND (CAST(:tenant AS text) IS NULL
       OR run_id IN (SELECT id FROM run WHERE tenant = :tenant))
ORDER BY requested_at, id
LIMIT :limit;

-- due_approvals --
-- Pending approvals past their deadline, for the reaper to apply their timeout policy.
SELECT id, timeout_policy FROM approval
WHERE status = 'PENDING' AND expires_at < now()
ORDER BY expires_at
LIMIT :limit;

-- cancel_pending_approvals --
UPDATE approval SET status = 'CANCELLED', decided_at = now(), comment = 'run cancelled'
WHERE run_id = :id AND status = 'PENDING';

-- count_pending_approvals --
SELECT role, count(*) AS n FROM approval WHERE status = 'PENDING' GROUP BY role;

-- resume_failed_run --
-- Retry a FAILED or TIMED_OUT run from the first step without a result.
UPDATE run
SET status = 'RUNNING', error = NULL, finished_at = NULL, cancel_requested = false,
    claims_without_progress = 0, locked_by = NULL, locked_until = NULL,
    token_budget = COALESCE(CAST(:token_budget AS bigint), token_budget),
    deadline_at = CASE WHEN CAST(:timeout_seconds AS integer) IS NOT NULL
                       THEN now() + make_interval(secs => CAST(:timeout_seconds AS integer))
                       WHEN deadline_at <= now()
                            AND CAST(:default_timeout_seconds AS integer) IS NOT NULL
                       THEN now() + make_interval(
                                secs => CAST(:default_timeout_seconds AS integer))
                       ELSE deadline_at END,
    dispatch_token = :next_token, dispatched_at = now(), updated_at = now()
WHERE id = :id AND status IN ('FAILED', 'TIMED_OUT')
RETURNING id;

-- retry_failed_steps --
-- A resumed durable function runs its failed steps again (history kept: attempt goes on).
-- A fork's copied failed step becomes the fork's own: the fork executes it now, so the row
-- bills the fork and the fork compensates it; what the original paid is no longer apart.
UPDATE run_step
SET status = 'RETRYING', origin = NULL, original_tokens = NULL, original_cost_usd = NULL
WHERE run_id = :id AND status = 'ERROR'
  AND kind IN ('STEP', 'LLM', 'SIDE_EFFECT', 'APPROVAL', 'VERSION');

-- count_compensations --
SELECT count(*) FROM run_step WHERE run_id = :id AND kind = 'COMPENSATION';

-- list_steps --
-- Every column but the optional full request (DAR_STORE_REQUESTS), which replay never needs
-- and which is the largest by far when kept.
SELECT run_id, seq, step_key, kind, status, tool_name, tool_use_id, model, prompt_hash,
       response, stop_reason, input_tokens, output_tokens, cache_creation_input_tokens,
       cache_read_input_tokens, cost_usd, latency_ms, request_id, error, resolution, attempt,
       input_hash, compensation, worker, lease_epoch, started_at, finished_at,
       origin, original_tokens, original_cost_usd
FROM run_step WHERE run_id = :id ORDER BY seq;

-- list_steps_since --
-- A worker's copy of the log catching up (db/steplog.py): the rows written under lease epoch
-- :since or later, the columns of list_steps, each beside the run's number of rows (one row
-- of NULLs beside it when none qualify), in seq order.
SELECT c.total, s.*
FROM (SELECT count(*) AS total FROM run_step WHERE run_id = :id) c
LEFT JOIN LATERAL (
    SELECT run_id, seq, step_key, kind, status, tool_name, tool_use_id, model, prompt_hash,
           response, stop_reason, input_tokens, output_tokens, cache_creation_input_tokens,
           cache_read_input_tokens, cost_usd, latency_ms, request_id, error, resolution,
           attempt, input_hash, compensation, worker, lease_epoch, started_at, finished_at,
           origin, original_tokens, original_cost_usd
    FROM run_step WHERE run_id = :id AND lease_epoch >= :since
) s ON true
ORDER BY s.seq;

-- lock_run_for_fork --
-- The run to fork, held (shared) for the fork's transaction: no checkpoint of it commits
-- while its steps are read and copied, so the copy is one consistent moment of its history.
SELECT * FROM run WHERE id = :id FOR SHARE;

-- create_fork_run --
-- A new QUEUED run forked from :source at :from_seq, on the forking process's version
-- (:deployment: a fork tries a recorded run again, on the code deployed now), in the source's tenant, with the
-- source's concurrency key and priority (a fork competes for the same key's slots). With an
-- idempotency key that exists already in that tenant (a concurrent retry committed first)
-- nothing is inserted and no row is returned, as create_run.
INSERT INTO run (id, agent, input, model, max_steps, token_budget, cost_budget_usd,
                 deadline_at, dispatch_token, submitted_by, tenant, timeout_seconds,
                 forked_from_run, forked_from_seq, replay_model, idempotency_key,
                 request_hash, concurrency_key, priority, deployment)
SELECT :id, s.agent, CAST(:input AS jsonb), :model, s.max_steps, :token_budget,
       s.cost_budget_usd, now() + make_interval(secs => :timeout_seconds), :token,
       :submitted_by, s.tenant, :timeout_seconds, s.id, :from_seq, :replay_model,
       :idempotency_key, :request_hash, s.concurrency_key, s.priority,
       CAST(:deployment AS text)
FROM run s WHERE s.id = :source
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING *;

-- copy_steps_to_fork --
-- The source's steps before :from_seq, as the fork's own history: never executed again,
-- billing nothing (token and cost columns 0), what the source paid kept apart.
INSERT INTO run_step (run_id, seq, step_key, kind, status, tool_name, tool_use_id, model,
                      request, prompt_hash, response, stop_reason, latency_ms, request_id,
                      error, resolution, attempt, input_hash, compensation, worker,
                      lease_epoch, started_at, finished_at, origin, original_tokens,
                      original_cost_usd)
SELECT :fork, seq, step_key, kind, status, tool_name, tool_use_id, model, request,
       prompt_hash, response, stop_reason, latency_ms, request_id, error, resolution, attempt,
       input_hash, compensation, worker, lease_epoch, started_at, finished_at, 'copied',
       COALESCE(original_tokens, 0) + input_tokens + output_tokens
           + cache_creation_input_tokens + cache_read_input_tokens,
       COALESCE(original_cost_usd, 0) + cost_usd
FROM run_step WHERE run_id = :source AND seq < :from_seq
ORDER BY seq;

-- edit_fork_step --
-- A fork's edit: a copied step's result replaced.
UPDATE run_step
SET response = CAST(:response AS jsonb), status = :status, error = :error, origin = 'edited'
WHERE run_id = :fork AND seq = :seq AND origin IS NOT NULL;

-- copy_approvals_to_fork --
-- The decisions of the approvals whose results the fork replays, labelled with the run that
-- decided them (copied_from). A rejection is always copied (it authorises nothing). An
-- approval authorises its effects once, in one run: an approved one is copied only when the
-- fork reuses the decisions (:reuse, reuseApprovals: the forker holds approve and its role);
-- otherwise ask_copied_approvals_again makes the fork ask again. The approval of an action
-- that failed (its step ERROR: a resume would retry it) or of a step at or after fromSeq is
-- never copied as a decision.
INSERT INTO approval (id, run_id, step_key, role, status, payload, payload_hash,
                      timeout_policy, requested_at, expires_at, decided_by, decided_at, comment,
                      copied_from)
SELECT gen_random_uuid(), :fork, a.step_key, a.role, a.status, a.payload, a.payload_hash,
       a.timeout_policy, a.requested_at, a.expires_at, a.decided_by, a.decided_at, a.comment,
       a.run_id
FROM approval a
JOIN run_step s ON s.run_id = a.run_id AND s.step_key = a.step_key
WHERE a.run_id = :source AND s.seq < :from_seq
  AND ((a.status = 'APPROVED' AND s.status = 'DONE' AND :reuse)
       OR (a.status = 'REJECTED' AND s.status = 'REJECTED'))
RETURNING status;

-- ask_copied_approvals_again --
-- A fork without reuseApprovals: each approved action it copied is asked for again before
-- the fork runs anything after it. The copied row keeps its place (seq) but loses the hash
-- of what was approved, so the engine finds no decision about the payload it would run and
-- asks again (as for a payload the fork's edits changed); its nested rows are dropped then.
UPDATE run_step SET input_hash = NULL
WHERE run_id = :fork AND kind = 'APPROVAL' AND status = 'DONE' AND origin IS NOT NULL;

-- carry_approval_to_fork --
-- reuseApprovals: the approval at :from_seq, the first step the fork executes, keeps the
-- source's APPROVED decision (labelled copied_from) and its step row is APPROVED, so the fork
-- runs the approved action without asking again; the engine still asks again if what it
-- would approve differs (input hash). Only when the forker holds the approval's role and
-- asked for it explicitly (checked by the caller); nothing when the step is no such approval.
WITH src AS (
    SELECT s.step_key, s.kind, s.input_hash, s.lease_epoch, s.attempt, a.role, a.payload,
           a.payload_hash,
           a.timeout_policy, a.requested_at, a.expires_at, a.decided_by, a.decided_at,
           a.comment
    FROM run_step s JOIN approval a ON a.run_id = s.run_id AND a.step_key = s.step_key
    WHERE s.run_id = :source AND s.seq = :from_seq AND s.kind = 'APPROVAL'
      AND a.status = 'APPROVED'
), step AS (
    INSERT INTO run_step (run_id, seq, step_key, kind, status, input_hash, lease_epoch,
                          attempt, started_at, origin)
    SELECT :fork, :from_seq, step_key, kind, 'APPROVED', input_hash, lease_epoch, attempt,
           now(), 'copied'
    FROM src
)
INSERT INTO approval (id, run_id, step_key, role, status, payload, payload_hash,
                      timeout_policy, requested_at, expires_at, decided_by, decided_at, comment,
                      copied_from)
SELECT gen_random_uuid(), :fork, step_key, role, 'APPROVED', payload, payload_hash,
       timeout_policy, requested_at, expires_at, decided_by, decided_at, comment, :source
FROM src
RETURNING step_key;

-- get_step_by_key --
SELECT run_id, seq, step_key, kind, status, tool_name, tool_use_id, model, prompt_hash,
       response, stop_reason, input_tokens, output_tokens, cache_creation_input_tokens,
       cache_read_input_tokens, cost_usd, latency_ms, request_id, error, resolution, attempt,
       input_hash, compensation, worker, lease_epoch, started_at, finished_at,
       origin, original_tokens, original_cost_usd
FROM run_step WHERE run_id = :id AND step_key = :step_key;

-- mark_step_origin --
-- A row the fork recorded without executing it (a replayed model answer): say so, and what
-- the original paid for it.
UPDATE run_step
SET origin = :origin, original_tokens = :original_tokens,
    original_cost_usd = :original_cost_usd
WHERE run_id = :id AND step_key = :step_key
RETURNING *;

-- discard_copied_step --
-- A copied step the fork executes itself after all (an approval asked again because the
-- edits changed what it approves): the row becomes the fork's own, and the copied rows
-- nested in it, which belonged to the original's execution, are dropped.
WITH dropped AS (
    DELETE FROM run_step
    WHERE run_id = :id AND origin IS NOT NULL AND starts_with(step_key, :step_key || '/')
)
UPDATE run_step SET origin = NULL, original_tokens = NULL, original_cost_usd = NULL
WHERE run_id = :id AND step_key = :step_key;

-- list_runs --
-- Newest first, keyset-paginated on (created_at, id).
-- :tenant NULL lists every tenant's runs (admin).
-- :agent and an id prefix narrow it further. The prefix arrives as the range of ids that
-- start with it (:id_low .. :id_high, the prefix padded with 0s and fs): a range of the
-- primary key, not a LIKE over every id's text (uuids order as their hex digits do).
SELECT * FROM run
WHERE (CAST(:status AS text) IS NULL OR status = :status)
  AND (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:agent AS text) IS NULL OR agent = :agent)
  AND (CAST(:id_low AS uuid) IS NULL
       OR id BETWEEN CAST(:id_low AS uuid) AND CAST(:id_high AS uuid))
  AND (CAST(:before_created AS timestamptz) IS NULL
       OR (created_at, id) < (CAST(:before_created AS timestamptz), CAST(:before_id AS uuid)))
ORDER BY created_at DESC, id DESC
LIMIT :limit;

-- redispatch_due --
-- The reaper's sweep: runs that no worker holds and whose last message is presumed lost
-- (older than :redispatch_after seconds), whose lease lapsed since the last dispatch, or whose
-- timer came due since. Each gets a new dispatch token, which makes every older message stale.
-- Safe with two reapers: SKIP LOCKED, and the condition is false once dispatched_at moves.
-- A run still naming a holder lost it with its lease (a hand-over clears the holder): that
-- holder and when its lease lapsed are returned, for the run's recovery trail.
WITH due AS (
    SELECT id, locked_by, locked_until FROM run
    WHERE status IN ('QUEUED', 'RUNNING') AND run_at <= now()
      AND (locked_until IS NULL OR locked_until < now())
      AND dispatched_at < GREATEST(
            COALESCE(locked_until, '-infinity'::timestamptz),
            run_at,
            now() - make_interval(secs => :redispatch_after))
    ORDER BY run_at
    FOR UPDATE SKIP LOCKED
    LIMIT :limit
)
UPDATE run r SET dispatch_token = gen_random_uuid(), dispatched_at = now()
FROM due WHERE r.id = due.id
RETURNING r.id, r.dispatch_token, r.tenant, due.locked_by AS lost_by,
          due.locked_until AS lease_lapsed_at;

-- delete_finished_runs --
-- Retention: one bounded batch of finished runs older than the cut-off (their steps go with
-- them, ON DELETE CASCADE). Only terminal rows are selected, and SKIP LOCKED passes over any
-- row another transaction holds, so a sweep never waits on or locks a live run.
WITH doomed AS (
    SELECT id FROM run
    WHERE status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')
      AND finished_at < now() - make_interval(secs => :older_than_seconds)
    ORDER BY finished_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
DELETE FROM run r USING doomed WHERE r.id = doomed.id
RETURNING r.id;

-- make_due_now --
-- For test kits and operators: a parked run (a timer, or a message presumed lost) becomes
-- due now and its lapsed or absent lease claimable; the reaper's next sweep sends it.
UPDATE run
SET run_at = LEAST(run_at, now()), dispatched_at = 'epoch', wake_floor = NULL,
    locked_until = CASE WHEN locked_until IS NULL THEN NULL
                        ELSE LEAST(locked_until, now() - interval '1 millisecond') END
WHERE id = :id AND status IN ('QUEUED', 'RUNNING');

-- wake_run --
-- What a parked run waits for has come (a signal, a message, its child's end, a key slot): it
-- goes now instead of at its fallback timer. Only a run still parked (no lease, timer in the
-- future) and not on a floor (wake_floor: a server's retry-after, a backoff, a sleep) is
-- woken; a new dispatch token makes its timer's message stale. With :send false the reaper's
-- next sweep sends it (the waker cannot send: it is unwinding from an error).
UPDATE run
SET run_at = now(), dispatch_token = gen_random_uuid(),
    dispatched_at = CASE WHEN :send THEN now() ELSE 'epoch' END
WHERE id = :id AND status IN ('QUEUED', 'RUNNING') AND locked_by IS NULL AND run_at > now()
  AND (wake_floor IS NULL OR wake_floor <= now())
RETURNING id, dispatch_token;

-- count_key_waiters_by_tenant --
-- The "runs waiting for a concurrency key" gauge: the :top tenants with the most runs
-- parked for a key slot, and the total (so the rest can be summed, not labelled). By tenant,
-- never by key: a key's name is its tenant's business.
WITH w AS (
    SELECT tenant AS key, count(*) AS n FROM run
    WHERE concurrency_key IS NOT NULL AND status IN ('QUEUED', 'RUNNING')
      AND locked_by IS NULL AND wait_reason LIKE 'concurrency key %'
    GROUP BY tenant
)
SELECT key, n, sum(n) OVER () AS total FROM w ORDER BY n DESC, key LIMIT :top;

-- mark_undispatched --
-- The message for this token could not be sent (broker down): let the next sweep send it.
UPDATE run SET dispatched_at = 'epoch'
WHERE id = :id AND dispatch_token = :token;

-- insert_audit_event --
-- Who did what to a run through the API, in the transaction of the action itself.
-- audit_event is append-only: a trigger refuses UPDATE and DELETE.
INSERT INTO audit_event (run_id, schedule_id, approval_id, tenant, actor, action, detail)
VALUES (:run_id, :schedule_id, :approval_id, :tenant, :actor, :action,
        CAST(:detail AS jsonb));

-- list_schedule_audit_events --
SELECT * FROM audit_event WHERE schedule_id = :schedule_id ORDER BY at, id;

-- list_audit_events --
SELECT * FROM audit_event WHERE run_id = :run_id ORDER BY at, id;

-- count_runs_by_status --
SELECT status, count(*) AS n FROM run GROUP BY status;

-- count_runs_for_console --
-- The console's counts by status, for one tenant (NULL: every tenant) and agent (NULL: all).
SELECT status, count(*) AS n FROM run
WHERE (CAST(:tenant AS text) IS NULL OR tenant = :tenant)
  AND (CAST(:agent AS text) IS NULL OR agent = :agent)
GROUP BY status;

-- count_steps_of_runs --
-- Step rows per run, for a page of runs (on the primary key's run_id prefix).
SELECT run_id, count(*) AS n FROM run_step
WHERE run_id = ANY(CAST(:ids AS uuid[]))
GROUP BY run_id;

-- stats_runs_finished --
-- Runs that ended in the window, per UTC hour and final status. The window's hours that the
-- roll-up holds (stats_rollup, migration 0023) are read from it (:hours); the rest of the
-- window, the ranges :gap_lo[i] .. :gap_hi[i] (NULL: no end), from the run table. With no
-- roll-up, one range: the whole window.
SELECT bucket, key, n FROM (
    SELECT date_trunc('hour', r.finished_at, 'UTC') AS bucket, r.status AS key, count(*) AS n
    FROM unnest(CAST(:gap_lo AS timestamptz[]), CAST(:gap_hi AS timestamptz[])) AS g(lo, hi)
    JOIN run r ON r.finished_at >= g.lo AND r.finished_at < COALESCE(g.hi, 'infinity')
    WHERE r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')
      AND (CAST(:tenant AS text) IS NULL OR r.tenant = :tenant)
    GROUP BY 1, 2
    UNION ALL
    SELECT bucket, key, n FROM stats_rollup
    WHERE every_tenant = (CAST(:tenant AS text) IS NULL) AND tenant = COALESCE(:tenant, '')
      AND section = 'finished' AND bucket = ANY(CAST(:hours AS timestamptz[]))
) x
ORDER BY 1, 2;

-- stats_cost_by_model --
-- Recorded cost of the steps that finished in the window, per UTC hour and model: the
-- roll-up's hours and the raw ranges as stats_runs_finished. (Usage that could not be
-- checkpointed is in the run's counters only: see run.unrecorded_cost_usd.)
-- On run_step_finished_idx, which carries the columns read: with no tenant the run table is
-- not touched (the EXISTS is evaluated only for a tenant; a step without its model, rare,
-- takes its run's).
SELECT bucket, key, usd FROM (
    SELECT date_trunc('hour', s.finished_at, 'UTC') AS bucket,
           COALESCE(s.model, (SELECT r.model FROM run r WHERE r.id = s.run_id)) AS key,
           sum(s.cost_usd) AS usd
    FROM unnest(CAST(:gap_lo AS timestamptz[]), CAST(:gap_hi AS timestamptz[])) AS g(lo, hi)
    JOIN run_step s ON s.finished_at >= g.lo AND s.finished_at < COALESCE(g.hi, 'infinity')
    WHERE s.cost_usd > 0
      AND (CAST(:tenant AS text) IS NULL
           OR EXISTS (SELECT 1 FROM run r WHERE r.id = s.run_id AND r.tenant = :tenant))
    GROUP BY 1, 2
    UNION ALL
    SELECT bucket, key, usd FROM stats_rollup
    WHERE every_tenant = (CAST(:tenant AS text) IS NULL) AND tenant = COALESCE(:tenant, '')
      AND section = 'cost' AND bucket = ANY(CAST(:hours AS timestamptz[]))
) x
ORDER BY 1, 2;

-- stats_step_latency --
-- p50 and p95 of the duration of the steps that finished in the window, per UTC hour and
-- kind: the measured latency when there is one (model calls), else finished - started. The
-- roll-up's hours and the raw ranges as stats_runs_finished (a percentile of an hour is
-- kept, not recomputed from parts: the roll-up holds it per tenant and for every tenant).
SELECT bucket, key, p50, p95, n FROM (
    SELECT date_trunc('hour', s.finished_at, 'UTC') AS bucket, s.kind AS key,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY d.ms) AS p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY d.ms) AS p95,
           count(*) AS n
    FROM unnest(CAST(:gap_lo AS timestamptz[]), CAST(:gap_hi AS timestamptz[])) AS g(lo, hi)
    JOIN run_step s ON s.finished_at >= g.lo AND s.finished_at < COALESCE(g.hi, 'infinity')
    CROSS JOIN LATERAL (
        SELECT COALESCE(s.latency_ms,
                        EXTRACT(EPOCH FROM (s.finished_at - s.started_at)) * 1000) AS ms
    ) d
    WHERE (CAST(:tenant AS text) IS NULL
           OR EXISTS (SELECT 1 FROM run r WHERE r.id = s.run_id AND r.tenant = :tenant))
    GROUP BY 1, 2
    UNION ALL
    SELECT bucket, key, p50, p95, n FROM stats_rollup
    WHERE every_tenant = (CAST(:tenant AS text) IS NULL) AND tenant = COALESCE(:tenant, '')
      AND section = 'latency' AND bucket = ANY(CAST(:hours AS timestamptz[]))
) x
ORDER BY 1, 2;

-- stats_no_jit --
-- The stats' statements read a few thousand rows at most, but their estimates (an unnest of
-- ranges, a subplan per row) pass jit_above_cost: compiling them took 50-170 ms, several
-- times the query itself. For this transaction only (safe under PgBouncer's transaction mode).
SET LOCAL jit = off;

-- stats_window --
-- The stats' one snapshot, in one round trip: the database's now, the window's start, and the
-- whole hours of the window the roll-up holds that no late write touched since (:rolled
-- false: none). JIT off for the rest of the transaction (stats_no_jit).
SELECT set_config('jit', 'off', true) AS jit, w.db_now, w.since,
       ARRAY(SELECT h.bucket FROM stats_hour h
             WHERE :rolled AND h.bucket >= w.since
               AND h.bucket < date_trunc('hour', w.db_now, 'UTC')
               AND NOT EXISTS (SELECT 1 FROM stats_hour_dirty d WHERE d.bucket = h.bucket)
             ORDER BY h.bucket) AS hours
FROM (SELECT now() AS db_now, now() - make_interval(secs => :window_seconds) AS since) w;

-- stats_hours_to_roll --
-- Hours that ended at least :grace_seconds ago, within :horizon_seconds, that the roll-up
-- does not hold or that a late write touched: newest first.
SELECT b.bucket
FROM generate_series(
        date_trunc('hour', now() - make_interval(secs => :horizon_seconds), 'UTC'),
        date_trunc('hour', now() - make_interval(secs => :grace_seconds), 'UTC')
            - interval '1 hour',
        interval '1 hour') AS b(bucket)
WHERE NOT EXISTS (SELECT 1 FROM stats_hour h WHERE h.bucket = b.bucket)
   OR EXISTS (SELECT 1 FROM stats_hour_dirty d WHERE d.bucket = b.bucket)
ORDER BY b.bucket DESC
LIMIT :limit;

-- stats_rollup_lock --
-- One roller at a time (two beats): a transaction-level lock, held by each hour's
-- transaction (session locks do not survive PgBouncer's transaction mode).
SELECT pg_try_advisory_xact_lock(7163942027);

-- stats_hour_needs_roll --
SELECT NOT EXISTS (SELECT 1 FROM stats_hour WHERE bucket = :bucket)
       OR EXISTS (SELECT 1 FROM stats_hour_dirty WHERE bucket = :bucket);

-- stats_hour_clean --
-- Before the hour is read: a late write committed from here on leaves its own mark.
WITH d AS (DELETE FROM stats_hour_dirty WHERE bucket = :bucket)
DELETE FROM stats_rollup WHERE bucket = :bucket;

-- stats_rollup_finished --
-- One hour's runs that ended, by status: per tenant and for every tenant.
INSERT INTO stats_rollup (every_tenant, tenant, bucket, section, key, n)
SELECT GROUPING(tenant) = 1, CASE WHEN GROUPING(tenant) = 1 THEN '' ELSE tenant END,
       CAST(:bucket AS timestamptz), 'finished', status, count(*)
FROM run
WHERE finished_at >= :bucket AND finished_at < CAST(:bucket AS timestamptz) + interval '1 hour'
  AND status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')
GROUP BY GROUPING SETS ((status, tenant), (status));

-- stats_rollup_cost --
-- One hour's recorded cost by model: per tenant and for every tenant.
INSERT INTO stats_rollup (every_tenant, tenant, bucket, section, key, usd)
SELECT GROUPING(r.tenant) = 1, CASE WHEN GROUPING(r.tenant) = 1 THEN '' ELSE r.tenant END,
       CAST(:bucket AS timestamptz), 'cost', COALESCE(s.model, r.model), sum(s.cost_usd)
FROM run_step s JOIN run r ON r.id = s.run_id
WHERE s.finished_at >= :bucket
  AND s.finished_at < CAST(:bucket AS timestamptz) + interval '1 hour'
  AND s.cost_usd > 0
GROUP BY GROUPING SETS ((COALESCE(s.model, r.model), r.tenant), (COALESCE(s.model, r.model)));

-- stats_rollup_latency --
-- One hour's step durations by kind (p50, p95, count): per tenant and for every tenant.
INSERT INTO stats_rollup (every_tenant, tenant, bucket, section, key, p50, p95, n)
SELECT GROUPING(r.tenant) = 1, CASE WHEN GROUPING(r.tenant) = 1 THEN '' ELSE r.tenant END,
       CAST(:bucket AS timestamptz), 'latency', s.kind,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY d.ms),
       percentile_cont(0.95) WITHIN GROUP (ORDER BY d.ms),
       count(*)
FROM run_step s JOIN run r ON r.id = s.run_id
CROSS JOIN LATERAL (
    SELECT COALESCE(s.latency_ms,
                    EXTRACT(EPOCH FROM (s.finished_at - s.started_at)) * 1000) AS ms
) d
WHERE s.finished_at >= :bucket
  AND s.finished_at < CAST(:bucket AS timestamptz) + interval '1 hour'
GROUP BY GROUPING SETS ((s.kind, r.tenant), (s.kind));

-- stats_hour_rolled --
INSERT INTO stats_hour (bucket) VALUES (:bucket)
ON CONFLICT (bucket) DO UPDATE SET rolled_at = now();

-- stats_rollup_prune --
-- Hours older than the roll-up keeps (no window reaches them).
WITH edge AS (
    SELECT date_trunc('hour', now() - make_interval(secs => :horizon_seconds), 'UTC') AS at
), h AS (
    DELETE FROM stats_hour WHERE bucket < (SELECT at FROM edge)
), d AS (
    DELETE FROM stats_hour_dirty WHERE bucket < (SELECT at FROM edge)
)
DELETE FROM stats_rollup WHERE bucket < (SELECT at FROM edge);

-- count_stale_leases --
SELECT count(*) FROM run WHERE status = 'RUNNING' AND locked_until < now();

-- count_ready_runs --
-- The autoscaling signal, over live runs only (run_claim_idx): "ready" runs could be worked
-- on now but no worker holds them (a new run, a step handed on and not yet claimed, a timer
-- come due, a lapsed lease): a backlog that more workers would shrink. A run waiting for a
-- timer, a key slot or a model's rate limit has run_at in the future and is not ready (more
-- workers would not help it). A ready run has waited since the latest of: its run_at (a
-- timer), its last write (a hand-over, a submit) and its lapsed lease; the reaper's
-- re-dispatch of a lost message does not restart that clock. "in_step": runs inside a step
-- (a live lease).
SELECT count(*) FILTER (WHERE ready) AS ready,
       COALESCE(EXTRACT(EPOCH FROM now() - min(since) FILTER (WHERE ready)), 0)
           AS oldest_seconds,
       count(*) FILTER (WHERE locked_until >= now()) AS in_step
FROM (
    SELECT run_at <= now() AND (locked_until IS NULL OR locked_until < now()) AS ready,
           GREATEST(run_at, updated_at, COALESCE(locked_until, '-infinity')) AS since,
           locked_until
    FROM run WHERE status IN ('QUEUED', 'RUNNING')
) live;

-- current_migration --
SELECT version_num FROM dar_alembic_version;

-- run_events_after --
-- The live stream's durable events of one run after event number :after, with what each
-- event reports read from its step or approval row (run_event is written by the triggers of
-- migration 0010, numbered in commit order per run).
SELECT e.n, e.kind, e.status, e.at, e.step_seq,
       s.step_key, s.kind AS step_kind, s.tool_name, s.model, s.response, s.error,
       s.attempt, s.input_tokens, s.output_tokens, s.cache_creation_input_tokens,
       s.cache_read_input_tokens, s.cost_usd, s.latency_ms,
       a.id AS approval_id, a.step_key AS approval_step_key, a.role, a.decided_by, a.comment,
       a.copied_from,
       r.error AS run_error, r.result AS run_result,
       ae.action AS recovery_action, ae.actor AS recovery_actor, ae.detail AS recovery_detail
FROM run_event e
LEFT JOIN run_step s ON s.run_id = e.run_id AND s.seq = e.step_seq
LEFT JOIN approval a ON a.id = e.approval_id
LEFT JOIN audit_event ae ON ae.id = e.audit_id
JOIN run r ON r.id = e.run_id
WHERE e.run_id = :id AND e.n > :after
ORDER BY e.n
LIMIT :limit;

-- run_event_seq --
-- The number of the run's last durable event (NULL: no such run).
SELECT event_seq FROM run WHERE id = :id;

-- run_event_seqs --
-- The last durable event number of each of these runs (the web process's event hub asks
-- once per tick for every run an open stream follows).
SELECT id, event_seq FROM run WHERE id = ANY(:ids);

-- lock_submitter --
-- Serialises one submitter's quota check and the write it admits (a transaction-level
-- advisory lock, released at commit): 30 concurrent submits cannot all see room for one.
SELECT pg_advisory_xact_lock(hashtextextended('dar-submit:' || :submitted_by, 0));

-- submitter_usage --
-- One submitter's quota usage: runs it submitted or resumed in the last :window_seconds (and
-- the age of the oldest of those), and its runs in flight (QUEUED or RUNNING): those it
-- submitted and those it resumed, whoever submitted them (resuming another token's runs
-- would otherwise put any number in flight).
WITH recent AS (
    SELECT created_at AS at FROM run
    WHERE submitted_by = :submitted_by
      AND created_at > now() - make_interval(secs => :window_seconds)
    UNION ALL
    SELECT at FROM audit_event
    WHERE actor = :submitted_by AND action = 'resume'
      AND at > now() - make_interval(secs => :window_seconds)
)
SELECT (SELECT count(*) FROM recent) AS n,
       (SELECT EXTRACT(EPOCH FROM (now() - min(at))) FROM recent) AS oldest_age,
       (SELECT count(*) FROM run r
        WHERE r.status IN ('QUEUED', 'RUNNING')
          AND (r.submitted_by = :submitted_by
               OR EXISTS (SELECT 1 FROM audit_event a
                          WHERE a.run_id = r.id AND a.actor = :submitted_by
                            AND a.action = 'resume'))) AS active;

-- insert_schedule --
INSERT INTO schedule (id, tenant, agent, input, model, max_steps, token_budget,
                      timeout_seconds, cost_budget_usd, priority, cron, timezone, overlap,
                      catch_up, next_tick_at, created_by)
VALUES (:id, :tenant, :agent, CAST(:input AS jsonb), :model, :max_steps, :token_budget,
        :timeout_seconds, :cost_budget_usd, :priority, :cron, :timezone, :overlap, :catch_up,
        :next_tick_at, :created_by)
RETURNING *;

-- get_schedule --
SELECT * FROM schedule WHERE id = :id;

-- list_schedules --
-- A tenant's schedules (every tenant's when :tenant is null), oldest first.
SELECT * FROM schedule
WHERE CAST(:tenant AS text) IS NULL OR tenant = :tenant
ORDER BY created_at, id
LIMIT :limit;

-- delete_schedule --
-- Its ticks go with it (ON DELETE CASCADE); the runs it started stay.
DELETE FROM schedule WHERE id = :id RETURNING id;

-- count_schedules_of --
-- The schedules one token created (DAR_TOKEN_MAX_SCHEDULES).
SELECT count(*) FROM schedule WHERE created_by = :created_by;

-- delete_old_schedule_ticks --
-- Retention: one bounded batch of tick rows older than the cut-off (as delete_finished_runs
-- for runs). A QUEUED tick still waits for its schedule's run, and stays.
WITH doomed AS (
    SELECT schedule_id, tick_at FROM schedule_tick
    WHERE created_at < now() - make_interval(secs => :older_than_seconds)
      AND status <> 'QUEUED'
    ORDER BY created_at
    LIMIT :batch
    FOR UPDATE SKIP LOCKED
)
DELETE FROM schedule_tick t USING doomed
WHERE t.schedule_id = doomed.schedule_id AND t.tick_at = doomed.tick_at
RETURNING t.tick_at;

-- list_schedule_ticks --
SELECT * FROM schedule_tick WHERE schedule_id = :schedule_id
ORDER BY tick_at DESC LIMIT :limit;

-- due_schedules --
-- Schedules with a tick due, or a queued tick waiting for the schedule's live run to end.
-- No lock here: each is then locked on its own (lock_due_schedule), so one slow schedule
-- does not hold the others. Fair across tenants: each tenant's most overdue schedule first,
-- then each tenant's second, and so on, so one tenant's thousand due schedules fill a pass
-- only after every other tenant's first ones (a pass takes :limit).
SELECT id FROM (
    SELECT s.id, s.next_tick_at,
           row_number() OVER (PARTITION BY s.tenant ORDER BY s.next_tick_at, s.id) AS turn
    FROM schedule s
    WHERE s.next_tick_at <= now()
       OR EXISTS (SELECT 1 FROM schedule_tick t
                  WHERE t.schedule_id = s.id AND t.status = 'QUEUED')
) due
ORDER BY turn, next_tick_at, id
LIMIT :limit;

-- lock_due_schedule --
-- One due schedule, locked for this pass. Another beat working on it meanwhile: no row (SKIP
-- LOCKED), it is that beat's. The unique tick row is what guarantees one run per tick; the
-- lock only spares the duplicate work and serialises the overlap check.
SELECT s.*, now() AS db_now FROM schedule s
WHERE s.id = :id
  AND (s.next_tick_at <= now()
       OR EXISTS (SELECT 1 FROM schedule_tick t
                  WHERE t.schedule_id = s.id AND t.status = 'QUEUED'))
FOR UPDATE SKIP LOCKED;

-- schedule_live_run --
-- Whether a run the schedule started has not ended (the overlap policy's question).
SELECT EXISTS (
    SELECT 1 FROM run
    WHERE schedule_id = :schedule_id
      AND status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')
) AS live;

-- insert_schedule_tick --
-- Claim one tick. A tick claimed before (by another beat, or before a restart) is not
-- inserted again and no row is returned: its run, if any, exists already. :reason says why a
-- SKIPPED tick started nothing when its overlap policy would have.
INSERT INTO schedule_tick (schedule_id, tick_at, status, run_id, reason)
VALUES (:schedule_id, :tick_at, :status, :run_id, :reason)
ON CONFLICT (schedule_id, tick_at) DO NOTHING
RETURNING tick_at;

-- oldest_queued_tick --
SELECT tick_at FROM schedule_tick
WHERE schedule_id = :schedule_id AND status = 'QUEUED'
ORDER BY tick_at LIMIT 1;

-- start_queued_tick --
UPDATE schedule_tick SET status = 'STARTED', run_id = :run_id
WHERE schedule_id = :schedule_id AND tick_at = :tick_at AND status = 'QUEUED'
RETURNING tick_at;

-- advance_schedule --
UPDATE schedule SET next_tick_at = :next_tick_at WHERE id = :id;

-- lock_run_row --
-- Serialises a wait for a signal with the signal's delivery: the waiter checks for the
-- signal under this lock and parks the run in the same transaction; a signal committed
-- after the lock wakes the parked run (wake_run waits for the lock, then sees it parked).
SELECT id, tenant, status FROM run WHERE id = :id FOR UPDATE;

-- lock_runs_in_order --
-- Two runs' rows locked in one order (by id), for a transaction that writes both (a signal
-- sent and its target woken): two such transactions queue, they never deadlock.
SELECT id FROM run WHERE id = ANY(:ids) ORDER BY id FOR UPDATE;

-- pending_signal --
-- The oldest signal of this name the run has not consumed yet.
SELECT id, payload FROM run_signal
WHERE run_id = :run_id AND name = :name AND consumed_by IS NULL
ORDER BY id LIMIT 1
FOR UPDATE;

-- consume_signal --
UPDATE run_signal SET consumed_by = :step_key, consumed_at = now() WHERE id = :id;

-- insert_signal --
-- One signal; with an idempotency key seen before for this run, nothing (the first stands).
INSERT INTO run_signal (run_id, name, payload, idempotency_key, sent_by)
VALUES (:run_id, :name, CAST(:payload AS jsonb), :idempotency_key, :sent_by)
ON CONFLICT (run_id, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id;

-- get_signal_by_key --
-- The signal (or message) a key made before, and whether it is the same one again (same name,
-- same payload): a retry; otherwise the key was reused for another request.
SELECT id, name = :name AND payload = CAST(:payload AS jsonb) AS same
FROM run_signal WHERE run_id = :run_id AND idempotency_key = :idempotency_key;

-- count_pending_signals --
-- What a run holds undelivered: its messages and signals no step has consumed yet
-- (DAR_MAX_PENDING_PER_RUN).
SELECT count(*) FROM run_signal WHERE run_id = :run_id AND consumed_by IS NULL;

-- lock_sender --
-- Serialises one token's message and signal rate check and the send it admits (released at
-- commit), as lock_submitter does for submits.
SELECT pg_advisory_xact_lock(hashtextextended('dar-send:' || :actor, 0));

-- sender_usage --
-- One token's messages and signals in the last :window_seconds, and the age of the oldest.
SELECT count(*) AS n, EXTRACT(EPOCH FROM (now() - min(at))) AS oldest_age
FROM audit_event
WHERE actor = :actor AND action IN ('message', 'signal')
  AND at > now() - make_interval(secs => :window_seconds);

-- live_children --
-- A parent's children that have not ended (the cancel cascade).
SELECT id FROM run
WHERE parent_run_id = :id AND status NOT IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT');

-- release_cancelled_child_steps --
-- A parent that ends early cancels the children it waits for (issue 35 U9); no step of it
-- may then be read, on a resume, as the result of a child it cancelled itself. A durable
-- function's steps.child still PENDING for a child cancelled now becomes RETRYING (a resume
-- starts that child again); a sub-agent's (a tool call of the agent loop) becomes the tool's
-- ERROR result, saying so (a resume hands it to the model, which may call it again).
UPDATE run_step
SET status = CASE WHEN tool_use_id IS NULL THEN 'RETRYING' ELSE 'ERROR' END,
    error = 'child run ' || (response->>'runId') || ' was cancelled when this run ended',
    response = CASE WHEN tool_use_id IS NULL THEN response
               ELSE to_jsonb(format('error: sub-agent %L (run %s) was cancelled when this '
                                    'run ended early; call it again if its answer is still '
                                    'needed', tool_name, response->>'runId')) END,
    finished_at = CASE WHEN tool_use_id IS NULL THEN finished_at ELSE now() END
WHERE run_id = :id AND kind = 'CHILD' AND status = 'PENDING'
  AND response->>'runId' = ANY(CAST(:cancelled AS text[]));

-- list_children --
SELECT id, agent, status, tokens_used, cost_usd, created_at, finished_at, idempotency_key FROM run
WHERE parent_run_id = :id ORDER BY created_at, id;

-- run_tree_plan --
-- Before run_tree, in its transaction: walk by index only. The walk reads a run's children in
-- run_parent_created_idx's order and stops at its LIMIT; from statistics that make a run's
-- children look few (or, as measured, 2,000 children of one run among 3,000) the planner
-- picks a bitmap scan, which reads every child of a run and sorts them (5,016 rows read
-- against 402 for a root with 2,000 children).
SELECT set_config('enable_seqscan', 'off', true), set_config('enable_bitmapscan', 'off', true);

-- run_tree --
-- The tree a run belongs to (GET /api/runs/{id}/tree), in one bounded statement: up from the
-- run to its root (at most :max_depth parents), then down from that root breadth-first, each
-- run's children oldest first, at most :max_depth levels. PostgreSQL evaluates a recursive
-- WITH query level by level and only as far as its reader reads, so the LIMIT on `walked`
-- stops the walk after the first :max_nodes + 1 runs, and run_parent_created_idx hands each
-- run's children over in order, read only as far as the walk goes (index scans only:
-- run_tree_plan): a tree of a million runs costs what one of 200 does. The run and its
-- ancestors (`up`, `on_path`) are returned whatever the cap. `n`: the place in the walk
-- (NULL: not walked); `child_count`: the run's children, counted up to :max_nodes + 1 (at
-- most ~217 x 201 index entries in all).
-- Only the asked run's tenant is checked: a child run is its parent's tenant's.
WITH RECURSIVE up AS (
    SELECT id, parent_run_id, agent, status, tokens_used, cost_usd, created_at, 0 AS height
    FROM run WHERE id = :id AND tenant = :tenant
    UNION ALL
    SELECT r.id, r.parent_run_id, r.agent, r.status, r.tokens_used, r.cost_usd, r.created_at, up.height + 1
    FROM up JOIN run r ON r.id = up.parent_run_id
    WHERE up.height < :max_depth
),
top AS (SELECT * FROM up ORDER BY height DESC LIMIT 1),
down AS (
    SELECT id, parent_run_id, agent, status, tokens_used, cost_usd, created_at, 0 AS depth FROM top
    UNION ALL
    SELECT c.id, c.parent_run_id, c.agent, c.status, c.tokens_used, c.cost_usd, c.created_at, down.depth + 1
    FROM down CROSS JOIN LATERAL (
        SELECT id, parent_run_id, agent, status, tokens_used, cost_usd, created_at FROM run
        WHERE parent_run_id = down.id
        ORDER BY created_at, id
        LIMIT :max_nodes + 1
    ) c
    WHERE down.depth < :max_depth
),
walked AS (
    SELECT d.*, row_number() OVER () AS n FROM (SELECT * FROM down LIMIT :max_nodes + 1) d
),
picked AS (
    SELECT id, parent_run_id, agent, status, tokens_used, cost_usd, created_at, n, false AS on_path FROM walked WHERE id NOT IN (SELECT id FROM up)
    UNION ALL
    SELECT up.id, up.parent_run_id, up.agent, up.status, up.tokens_used, up.cost_usd, up.created_at, walked.n, true
    FROM up LEFT JOIN walked ON walked.id = up.id
)
SELECT picked.*, picked.id = (SELECT id FROM top) AS is_top,
       (SELECT count(*) FROM (
            SELECT 1 FROM run k WHERE k.parent_run_id = picked.id
            ORDER BY k.created_at, k.id  -- the index's order: no scan past the limit
            LIMIT :max_nodes + 1
        ) k) AS child_count
FROM picked;

-- message_arrived --
-- A message posted to an agent-loop run: counted (the claim reads the count with the run).
-- A SUCCEEDED run is queued again, as the next turn of its conversation: a new dispatch
-- token, due now, its deadline renewed from now (a deadline is per turn; budgets and the step
-- cap count the whole run), and no claims without progress (the claim that ended it counted
-- one: its next claim would be taken for a recovery, `recovery.resumed` on the timeline).
UPDATE run
SET messages_pending = messages_pending + 1,
    status = CASE WHEN status = 'SUCCEEDED' THEN 'QUEUED' ELSE status END,
    claims_without_progress = CASE WHEN status = 'SUCCEEDED' THEN 0
                                   ELSE claims_without_progress END,
    result = CASE WHEN status = 'SUCCEEDED' THEN NULL ELSE result END,
    finished_at = CASE WHEN status = 'SUCCEEDED' THEN NULL ELSE finished_at END,
    deadline_at = CASE WHEN status = 'SUCCEEDED'
                       THEN now() + make_interval(secs => COALESCE(timeout_seconds, 600))
                       ELSE deadline_at END,
    run_at = CASE WHEN status = 'SUCCEEDED' THEN now() ELSE run_at END,
    dispatch_token = CASE WHEN status = 'SUCCEEDED' THEN gen_random_uuid()
                          ELSE dispatch_token END,
    dispatched_at = CASE WHEN status = 'SUCCEEDED' THEN now() ELSE dispatched_at END,
    updated_at = now()
WHERE id = :id
RETURNING id, status, dispatch_token;

-- message_delivered --
UPDATE run SET messages_pending = messages_pending - 1
WHERE id = :id AND messages_pending > 0;

-- tree_root --
-- The root of a child run's tree: its topmost ancestor still stored (a tree is at most a
-- few levels deep; the walk stops at 64 against a cycle).
WITH RECURSIVE up AS (
    SELECT id, parent_run_id, 0 AS depth FROM run WHERE id = :id
    UNION ALL
    SELECT r.id, r.parent_run_id, up.depth + 1
    FROM run r JOIN up ON r.id = up.parent_run_id
    WHERE up.depth < 64
)
SELECT id FROM up ORDER BY depth DESC LIMIT 1;

-- lock_tree_budget --
-- Serialises the admissions of one tree's model calls (held to the transaction's end).
SELECT pg_advisory_xact_lock(hashtextextended('budget_hold/' || CAST(:root AS text), 0));

-- sweep_tree_holds --
-- Holds whose calls are over: of runs that have ended (counted, or lost with a run that
-- will never count them), and of calls recorded (their row written under the hold's lease:
-- counted on the run) whose worker died before it released the hold.
DELETE FROM budget_hold h USING run r
WHERE h.root_run_id = :root AND r.id = h.run_id
  AND (r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')
       OR EXISTS (SELECT 1 FROM run_step s
                  WHERE s.run_id = h.run_id AND s.step_key = h.step_key
                    AND s.lease_epoch = h.lease_epoch AND s.origin IS NULL));

-- tree_spend --
-- What a run tree has spent: the root's counters (its children's tokens are added to them
-- with their results) and those of each descendant whose parent has not recorded its result
-- yet (its step in the parent still PENDING); of a descendant whose result was recorded and
-- that went on since (a message continued it), what it spent beyond the recorded step (its
-- tokens unrecorded by then counted twice: never less than the truth). The holds of the
-- other live runs' calls in flight, and the holds of this run's earlier leases (calls lost
-- with their worker: spent). A hold of another run is a call in flight (`in_flight`: the
-- rule that a call may start alone waits for it) only while that run runs under the hold's
-- lease: once the run is taken again (or parked), its call was lost, held (counted) until
-- that run's next call, never waited for (two children whose calls were lost together
-- would each wait for the other's, which only the other's next call releases).
WITH RECURSIVE tree AS (
    SELECT id, parent_run_id, idempotency_key, tokens_used + unrecorded_tokens AS spent,
           cost_usd + unrecorded_cost_usd AS cost, 0 AS depth
    FROM run WHERE id = :root
    UNION ALL
    SELECT c.id, c.parent_run_id, c.idempotency_key, c.tokens_used + c.unrecorded_tokens,
           c.cost_usd + c.unrecorded_cost_usd, t.depth + 1
    FROM run c JOIN tree t ON c.parent_run_id = t.id
    WHERE t.depth < 64
), counted AS (
    -- each descendant's step in its parent read once, by its key (run_step_key_uk: the
    -- child's idempotency key is 'child:<parent>/<step key>'); LATERAL keeps it a lookup
    -- per run, never a scan of every step (this runs under the tree's lock, per call)
    SELECT CASE WHEN t.id = :root THEN t.spent
                WHEN s.status = 'PENDING' AND s.response ->> 'runId' = CAST(t.id AS text)
                  THEN t.spent
                WHEN s.status IN ('DONE', 'ERROR')
                  THEN GREATEST(t.spent - (s.input_tokens + s.output_tokens
                                           + s.cache_creation_input_tokens
                                           + s.cache_read_input_tokens), 0)
                ELSE 0 END AS spent,
           CASE WHEN t.id = :root THEN t.cost
                WHEN s.status = 'PENDING' AND s.response ->> 'runId' = CAST(t.id AS text)
                  THEN t.cost
                WHEN s.status IN ('DONE', 'ERROR') THEN GREATEST(t.cost - s.cost_usd, 0)
                ELSE 0 END AS cost
    FROM tree t LEFT JOIN LATERAL (
        SELECT s.status, s.response, s.input_tokens, s.output_tokens,
               s.cache_creation_input_tokens, s.cache_read_input_tokens, s.cost_usd
        FROM run_step s
        WHERE s.run_id = t.parent_run_id
          AND s.step_key = substr(t.idempotency_key,
                                  length('child:' || CAST(t.parent_run_id AS text) || '/') + 1)
        LIMIT 1  -- unique; and the subquery is not flattened (into a join that scans all)
    ) s ON true
), held AS (
    SELECT h.run_id, h.lease_epoch, h.tokens, h.cost_usd,
           r.status = 'RUNNING' AND r.lease_epoch = h.lease_epoch AS live
    FROM budget_hold h JOIN run r ON r.id = h.run_id
    WHERE h.root_run_id = :root
)
SELECT root.token_budget, root.cost_budget_usd,
       (SELECT COALESCE(SUM(spent), 0) FROM counted)
         + (SELECT COALESCE(SUM(tokens), 0) FROM held
            WHERE run_id = :id AND lease_epoch < :epoch) AS spent,
       (SELECT COALESCE(SUM(cost), 0) FROM counted)
         + (SELECT COALESCE(SUM(cost_usd), 0) FROM held
            WHERE run_id = :id AND lease_epoch < :epoch) AS cost,
       (SELECT COALESCE(SUM(tokens), 0) FROM held WHERE run_id <> :id) AS held,
       (SELECT COALESCE(SUM(cost_usd), 0) FROM held WHERE run_id <> :id) AS held_cost,
       (SELECT COUNT(*) FROM held WHERE run_id <> :id AND live) AS in_flight
FROM run root WHERE root.id = :root;

-- hold_tree_budget --
INSERT INTO budget_hold (run_id, lease_epoch, root_run_id, step_key, tokens, cost_usd)
VALUES (:id, :epoch, :root, :step_key, :tokens, :cost_usd)
ON CONFLICT (run_id, lease_epoch) DO UPDATE
SET step_key = EXCLUDED.step_key, tokens = EXCLUDED.tokens, cost_usd = EXCLUDED.cost_usd,
    created_at = now();

-- release_tree_budget --
-- The call's tokens are counted on its run: its hold goes, with those of the run's earlier
-- leases (calls lost with their worker, counted by now as the run's unrecorded estimate).
DELETE FROM budget_hold WHERE run_id = :id AND lease_epoch <= :epoch;

-- deployments ------------------------------------------------------------------------------
-- A run's version (runtime.engine.deployment); worker processes' heartbeat of the version
-- they serve; upgrades of runs to another version.

-- get_run_deployment --
-- Where a run's drive_run message goes (tasks.dispatch): its version's queue.
SELECT deployment FROM run WHERE id = :id;

-- worker_seen --
-- A worker process serving :deployment is alive (every heartbeat).
INSERT INTO deployment_worker (worker, deployment) VALUES (:worker, :deployment)
ON CONFLICT (worker, deployment) DO UPDATE SET last_seen = now();

-- worker_gone --
-- A worker process stopped cleanly: it serves nothing any more.
DELETE FROM deployment_worker WHERE worker = :worker AND deployment = :deployment;

-- forget_old_workers --
-- Rows of workers not seen for a day: only the recent past is worth showing.
DELETE FROM deployment_worker WHERE last_seen < now() - interval '1 day';

-- deployment_workers --
-- Every worker row, with whether it is live (seen within :live_seconds).
SELECT worker, deployment, started_at, last_seen,
       last_seen >= now() - make_interval(secs => :live_seconds) AS live
FROM deployment_worker
ORDER BY deployment, worker;

-- deployment_runs --
-- Runs in flight (not ended) by version and status: on run_deployment_live_idx.
SELECT deployment, status, count(*) AS n
FROM run
WHERE status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')
GROUP BY deployment, status;

-- count_unserved_runs --
-- Runs in flight of a version that no live worker serves (a run with no version is served
-- by any worker, so it counts only when no worker at all is live).
SELECT count(*) AS n
FROM run r
WHERE r.status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION')
  AND NOT EXISTS (
      SELECT 1 FROM deployment_worker w
      WHERE (r.deployment IS NULL OR w.deployment = r.deployment)
        AND w.last_seen >= now() - make_interval(secs => :live_seconds));

-- runs_of_deployment --
-- The runs in flight of a version (IS NOT DISTINCT FROM: NULL names the runs with none),
-- and failed ones (a run resumed keeps its version): what an upgrade considers.
SELECT * FROM run
WHERE deployment IS NOT DISTINCT FROM CAST(:deployment AS text)
  AND status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION', 'FAILED')
ORDER BY created_at
LIMIT :limit;

-- upgrade_run --
-- Move a run to version :to_deployment, if it is still of version :from_deployment and no
-- worker holds it (its lease lapsed or none). A run a worker may take (QUEUED, RUNNING) gets a new dispatch
-- token: the message sitting in the old version's queue is stale, the caller sends one to
-- the new version's queue. A run parked on a timer keeps its time (run_at).
UPDATE run
SET deployment = CAST(:to_deployment AS text),
    dispatch_token = CASE WHEN status IN ('QUEUED', 'RUNNING') THEN CAST(:token AS uuid)
                          ELSE dispatch_token END,
    updated_at = now()
WHERE id = :id
  AND deployment IS NOT DISTINCT FROM CAST(:from_deployment AS text)
  AND status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION', 'FAILED')
  AND (locked_until IS NULL OR locked_until < now())
RETURNING id, status, dispatch_token,
          GREATEST(0, EXTRACT(EPOCH FROM run_at - now()))::float8 AS delay_seconds;

-- record_agent_definition --
-- An agent's definition in a version (runtime.engine.deployment.agent_definition), recorded
-- by the first process of the version; the same name recorded again keeps the first.
INSERT INTO deployment_agent (deployment, agent, definition)
VALUES (:deployment, :agent, CAST(:definition AS jsonb))
ON CONFLICT (deployment, agent) DO NOTHING;

-- agent_definitions --
-- A version's recorded agent definitions.
SELECT agent, definition FROM deployment_agent WHERE deployment = :deployment;

-- sample_runs --
-- Recorded runs for an offline replay check (dar replay-check), newest first: of a version
-- (or any), of an agent (or any), in flight only or of any status.
SELECT * FROM run
WHERE (CAST(:deployment AS text) IS NULL OR deployment = CAST(:deployment AS text))
  AND (CAST(:agent AS text) IS NULL OR agent = CAST(:agent AS text))
  AND (NOT :in_flight OR status IN ('QUEUED', 'RUNNING', 'WAITING', 'NEEDS_ATTENTION'))
ORDER BY created_at DESC
LIMIT :limit;

-- newest_live_deployment --
-- Of the versions some live worker serves, the one that appeared last (its agents' definitions
-- were first recorded latest): the version an upgrade policy moves unserved runs to.
SELECT a.deployment
FROM deployment_agent a
WHERE a.deployment IN (
    SELECT deployment FROM deployment_worker
    WHERE last_seen >= now() - make_interval(secs => :live_seconds))
GROUP BY a.deployment
ORDER BY min(a.recorded_at) DESC, a.deployment DESC
LIMIT 1;

-- live_deployments --
-- The versions some live worker serves (seen within :live_seconds).
SELECT DISTINCT deployment FROM deployment_worker
WHERE last_seen >= now() - make_interval(secs => :live_seconds);
