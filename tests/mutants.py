"""A hand-made mutation audit of the engine's guarantee code: ``python -m tests.mutants``.

Each mutant below is a realistic slip in the code that keeps a guarantee (the step-log copy,
fences, the checkpoint retry, hand-over, key slots, fork, reconcile, the lean publisher),
written as a text patch, with the tests that must notice it. For each one the script copies
the repository (the files git knows, plus those not yet committed) to a temporary
directory once, applies the patch there, runs the named tests against that copy, restores
the file, and reports ``killed`` (a test failed: the suite notices the slip) or
``survived``; then the score. The checkout itself is never modified.

Not run in CI: it runs each mutant's tests once more against real PostgreSQL and Redis
(``DATABASE_URL``/``REDIS_URL`` as for the tests), a few minutes in all. Options::

    python -m tests.mutants                 # every mutant
    python -m tests.mutants steplog keys    # only the mutants whose name contains a word
    python -m tests.mutants --list          # the mutants and their tests

A patch that no longer applies (its text changed) is reported ``stale``: update the mutant
with the code. Exit status 1 when a mutant survived or is stale.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    why: str


T = "tests/integration/"

MUTANTS = (
    Mutant(
        "steplog-wrote-without-epoch-check",
        "db/steplog.py",
        "            if log is None or log.epoch != epoch:\n                self._logs.pop",
        "            if log is None:\n                self._logs.pop",
        (
            T + "test_one_executor.py::test_an_old_copy_does_not_take_the_token_of_a_run_parked"
            "_for_its_key",
            "tests/unit/test_steplog.py::test_a_write_of_another_lease_drops_the_copy_and_takes"
            "_no_token",
        ),
        "an old copy takes the token of a run parked for its key before its log was read",
    ),
    Mutant(
        "steplog-hit-keeps-the-token",
        "db/steplog.py",
        "log.epoch, log.token, log.status_changes = epoch, None, status_changes",
        "log.epoch, log.status_changes = epoch, status_changes",
        ("tests/unit/test_steplog.py::test_a_hand_over_serves_the_claim_right_after_it_once",),
        "a cache hit does not consume the hand-on dispatch token",
    ),
    Mutant(
        "steplog-token-alone",
        "db/steplog.py",
        "                or epoch != log.handed_epoch + 1\n",
        "",
        (
            T + "test_one_executor.py::test_a_duplicated_message_after_another_process_wrote"
            "_reads_the_log",
        ),
        "issue 23 defect 1: a duplicated message served the copy of the process that handed on",
    ),
    Mutant(
        "checkpoint-retry-keeps-the-log-copy",
        "runtime/pipeline/checkpoint.py",
        "                        self.store.step_logs.forget(self.run_id)  # it missed the lost"
        " write\n",
        "",
        (
            T + "test_checkpoint_retry.py::test_a_commit_found_after_a_blink_drops_the_processs"
            "_copy_of_the_log",
        ),
        "the step-log copy kept after finding that an earlier try committed",
    ),
    Mutant(
        "checkpoint-retry-by-key-alone",
        "runtime/pipeline/checkpoint.py",
        "            or found.lease_epoch != self.claim.epoch\n",
        "",
        (
            T + "test_checkpoint_retry.py::test_an_earlier_attempts_row_is_not_taken_for_this"
            "_tries_commit",
        ),
        '"an earlier try committed" decided by the step key alone, ignoring the epoch',
    ),
    Mutant(
        "checkpoint-retry-takes-a-copied-row",
        "runtime/pipeline/checkpoint.py",
        "            or found.origin is not None\n",
        "",
        (
            T + "test_checkpoint_retry.py::test_a_resumed_forks_model_call_is_not_taken_for_its"
            "_copied_row",
        ),
        "issue 23 defect 6: a fork's copied row taken for the checkpoint's own commit",
    ),
    Mutant(
        "checkpoint-retry-on-any-exception",
        "runtime/pipeline/checkpoint.py",
        "if not isinstance(e, DatabaseUnavailable) or left <= 0:",
        "if left <= 0:",
        (T + "test_checkpoint_blip.py::test_an_error_that_is_not_a_blip_is_not_retried",),
        "a checkpoint retried for the whole lease on any exception, not only a database blip",
    ),
    Mutant(
        "fork-copies-a-retrying-step",
        "runtime/engine/fork.py",
        "COPYABLE = frozenset({StepStatus.DONE,",
        "COPYABLE = frozenset({StepStatus.RETRYING, StepStatus.DONE,",
        (T + "test_checkpoint_retry.py::test_a_fork_after_a_step_being_retried_is_refused",),
        "a fork copies a RETRYING step and keeps it marked copied (never compensated, unbilled)",
    ),
    Mutant(
        "reconcile-hang-read-as-not-happened",
        "runtime/pipeline/effects.py",
        "if isinstance(answer, Raised | StillRunning):",
        "if isinstance(answer, Raised):",
        (
            T + "test_reconcile.py::test_a_reconcile_hook_that_hangs_past_its_grace_is_not_read"
            "_as_not_happened",
        ),
        "a reconcile hook still running past its timeout and grace read as 'not happened'",
    ),
    Mutant(
        "reconcile-error-read-as-not-happened",
        "runtime/pipeline/effects.py",
        "if isinstance(answer, Raised | StillRunning):",
        "if isinstance(answer, StillRunning):",
        (T + "test_reconcile.py::test_a_reconcile_hook_that_raises_is_not_read_as_not_happened",),
        "a reconcile hook that raises read as 'not happened'",
    ),
    Mutant(
        "reconcile-asked-once",
        "runtime/pipeline/effects.py",
        "    if not (isinstance(again, Raised) and isinstance(again.error, OutcomeUnknown)):",
        "    if True:",
        (T + "test_reconcile.py::test_an_answer_lost_again_after_reconcile_is_reconciled_again",),
        "issue 23 defect 3: a re-run whose answer is lost again recorded as a plain failure",
    ),
    Mutant(
        "database-away-recorded-as-the-tools-error",
        "runtime/pipeline/effects.py",
        "        verdict = _away(effect, _run(task, effect, context, deferred))\n",
        "        verdict = _run(task, effect, context, deferred)\n",
        (
            T + "test_tools_database_away.py::test_a_tool_that_finds_the_database_away_is_taken"
            "_up_again_not_answered",
        ),
        "the chaos campaign's seed 991233: a PostgreSQL restart handed to the model as the "
        "tool's error, the comment it asked for never added",
    ),
    Mutant(
        "pool-connection-left-in-autocommit",
        "db/fastpath.py",
        "                try:\n                    conn.autocommit = False\n",
        "                try:\n                    pass\n",
        (
            T + "test_awkward_text.py::test_a_statement_error_returns_its_connection_to_the_pool"
            "_out_of_autocommit",
        ),
        "after a statement error that is not a disconnect, the connection pooled in autocommit",
    ),
    Mutant(
        "key-renew-re-adds-a-released-slot",
        "runtime/admission/concurrency_keys.py",
        "redis.call('ZADD', k, 'XX', now",
        "redis.call('ZADD', k, now",
        (T + "test_concurrency_keys.py::test_a_lapsed_slot_taken_by_another_is_not_renewed_back",),
        "the key-slot renew re-adding a slot released (lapsed, taken) meanwhile",
    ),
    Mutant(
        "key-wake-goes-to-a-cancelled-waiter",
        "runtime/engine/driver.py",
        "            woken = self.keys.skip(slot, woken, continuing=continuing)\n",
        "            return ()\n",
        (
            T + "test_concurrency_keys.py::test_a_waiter_cancelled_while_parked_does_not_swallow"
            "_the_wake",
        ),
        "issue 23 defect 7: a waiter cancelled while parked swallows the freed slot's wake",
    ),
    Mutant(
        "key-holder-loses-its-place",
        "runtime/admission/concurrency_keys.py",
        "  me = ARGV[5]\n  redis.call('ZADD', KEYS[2]",
        "  me = ARGV[5]\n  if true then return next_waiter(now, tonumber(ARGV[4]), me) end\n"
        "  redis.call('ZADD', KEYS[2]",
        (
            T + "test_concurrency_keys.py::test_a_holder_continuing_keeps_its_place_and_a_newcomer"
            "_cannot_overtake",
        ),
        "issue 23 defect 7: a newcomer overtakes a holder between its steps and older waiters",
    ),
    Mutant(
        "lean-publisher-pushes-to-the-wrong-end",
        "tasks/publish.py",
        "self._client.lpush(queue or self.queue",
        "self._client.rpush(queue or self.queue",
        (T + "test_publish.py::test_queued_runs_are_served_oldest_first",),
        "the lean publisher pushes to the other end: queued runs served newest first",
    ),
    Mutant(
        "stop-claims-without-compensation",
        "runtime/engine/driver.py",
        "            task.begin_stop(reason)  # its compensations run",
        "            return task.finish(RunStatus.FAILED, error=reason)  #",
        (T + "test_early_stops.py::test_claims_without_progress_run_the_compensations_once",),
        "issue 23 defect 4: a run that kills its worker ends FAILED, its steps never undone",
    ),
    Mutant(
        "stop-divergence-without-compensation",
        "runtime/durable/execution.py",
        "            except NonDeterministicReplay as e:\n                self.stop(",
        "            except NonDeterministicReplay as e:\n                return self.task.finish(",
        (T + "test_early_stops.py::test_a_replay_that_diverges_runs_the_compensations_once",),
        "issue 23 defect 4: a replay divergence ends the run without its compensations",
    ),
    Mutant(
        "stop-unknown-agent-without-compensation",
        "runtime/engine/driver.py",
        "return unwind_recorded(task, RunStatus.FAILED, task.stopping or str(e))",
        "return task.finish(RunStatus.FAILED, error=str(e))",
        (
            T + "test_early_stops.py::test_an_unknown_agent_runs_the_compensations_its_rows"
            "_name_once",
        ),
        "an agent no longer deployed ends its runs without undoing their completed steps",
    ),
    Mutant(
        "stop-refused-value-without-compensation",
        "runtime/engine/driver.py",
        "            if isinstance(agent, DurableAgent) and task.stopping is None:\n",
        "            if False:\n",
        (T + "test_early_stops.py::test_a_value_the_database_refuses_runs_the_compensations_once",),
        "a step value jsonb refuses (NaN) ends the run without undoing its completed steps",
    ),
    Mutant(
        "key-is-the-bare-step-key",
        "runtime/tools.py",
        '    return f"{run_id}/{step_key}"',
        "    return step_key",
        ("tests/integration/test_idempotency_keys.py",),
        "issue 23 defect 2: every run of a function (and every fork) hands down the same key",
    ),
    Mutant(
        "mcp-meta-key-is-the-bare-step-key",
        "runtime/pipeline/mcpcall.py",
        "                key=ctx.idempotency_key,\n",
        "                key=ctx.key,\n",
        (
            T + "test_mcp_agent.py::test_mcp_tools_are_offered_next_to_python_tools_and_called"
            "_as_tool_steps",
        ),
        "issue 23 defect 2: the MCP _meta idempotency key is the bare tool_use id",
    ),
    Mutant(
        "stop-output-encoded-at-the-end",
        "runtime/durable/execution.py",
        "                result = encode(output)\n",
        "                result = output\n",
        (
            T + "test_early_stops.py::test_an_output_that_cannot_be_recorded_runs_the"
            "_compensations_once",
        ),
        "issue 23 defect 4: an output that cannot be encoded ends the run without compensating",
    ),
    Mutant(
        "jsontext-nul-passes-through",
        "db/jsontext.py",
        'not wrapper and "\\\\u0000" not in text and ',
        "not wrapper and ",
        (
            "tests/unit/test_jsontext.py::test_nul_without_a_surrogate_is_escaped_too",
            T + "test_awkward_text.py::test_nul_without_a_surrogate_is_recorded",
        ),
        "issue 23 defect 5: a value holding NUL but no surrogate goes to jsonb unescaped",
    ),
    Mutant(
        "jsontext-response-read-back-wrapped",
        "db/store/base.py",
        'response=jsontext.loads(row["response"]),',
        'response=row["response"],',
        (
            T + "test_awkward_text.py::test_a_model_answer_and_a_tool_output_with_nul_and"
            "_surrogates_round_trip",
        ),
        "issue 23 defect 5: a step's escaped answer read back as its wrapper, not its value",
    ),
    Mutant(
        "refused-value-leaves-the-run-running",
        "runtime/engine/driver.py",
        "            refused = _refused_value(e)\n",
        "            refused = None\n",
        (
            T + "test_awkward_text.py::test_a_value_the_database_refuses_ends_the_run_instead"
            "_of_leaving_it_running",
        ),
        "issue 23 defect 5: a value jsonb refuses leaves the run RUNNING, claimed again forever",
    ),
    Mutant(
        "time-limit-meter-looked-up-too-late",
        "runtime/llm/retry.py",
        "_bill_when_done(request.model, current_meter())",
        "_bill_when_done(request.model, None)",
        (
            T + "test_lost_attempts.py::test_an_attempt_abandoned_at_its_time_limit_is_reported"
            "_when_it_completes",
        ),
        "issue 23 defect 8: an abandoned attempt's usage looked for in the pool thread: lost",
    ),
    Mutant(
        "cut-stream-not-billed",
        "runtime/llm/anthropic.py",
        '            bill_lost(assembler.usage(), request.model, "stream cut mid-way")\n',
        "",
        (T + "test_lost_attempts.py::test_a_cut_stream_reports_what_message_start_billed",),
        "issue 23 defect 8: a stream cut mid-way loses the input tokens message_start reported",
    ),
    Mutant(
        "pipeline-policy-not-read",
        "runtime/pipeline/kinds.py",
        "        return self.after_crash is AfterCrash.RUN_AGAIN",
        "        return False",
        (T + "test_step_kinds.py",),
        "the executor ignores a kind's rule: an interrupted steps.llm body stops for a person",
    ),
    Mutant(
        "tree-budget-each-run-alone",
        "runtime/pipeline/modelcall.py",
        "return not exhausted(t) and (fits(t) or (t.in_flight == 0 and not strict))",
        "return not exhausted(t)",
        (
            T + "test_subagents.py::test_children_side_by_side_share_the_budget_and_pass_it_by"
            "_one_step_at_most",
            T + "test_subagents.py::test_durable_sub_agents_side_by_side_share_the_budget",
        ),
        "issue 25.3: a child's call starts whenever its tree is under budget, whatever is in "
        "flight (one step over per child at work)",
    ),
    Mutant(
        "tree-hold-released-by-a-dying-worker",
        "runtime/pipeline/modelcall.py",
        "    except Exception:\n        release_tree_budget(task)\n        raise\n    # (a",
        "    except BaseException:\n        release_tree_budget(task)\n        raise\n    # (a",
        (T + "test_subagents.py::test_a_call_lost_with_its_worker_does_not_wedge_the_tree",),
        "a call lost with its worker released from the tree's budget as if it cost nothing",
    ),
    Mutant(
        "tree-hold-of-a-recorded-call-kept",
        "db/queries.sql",
        "       OR EXISTS (SELECT 1 FROM run_step s\n",
        "       OR false AND EXISTS (SELECT 1 FROM run_step s\n",
        (
            T + "test_subagents.py::test_a_hold_left_by_a_worker_that_died_after_recording_its"
            "_call_is_swept",
        ),
        "a recorded call's hold, its worker dead before the release, counted beside its tokens",
    ),
    Mutant(
        "tree-lost-call-waited-for",
        "db/queries.sql",
        "(SELECT COUNT(*) FROM held WHERE run_id <> :id AND live) AS in_flight",
        "(SELECT COUNT(*) FROM held WHERE run_id <> :id) AS in_flight",
        (T + "test_subagents.py::test_two_calls_lost_together_do_not_wedge_each_other",),
        "a sibling's lost call counted as in flight: two children lost together wait for each "
        "other until their deadline",
    ),
    Mutant(
        "tree-spend-scans-steps",
        "db/queries.sql",
        "        LIMIT 1  -- unique; and the subquery is not flattened",
        "        -- unique; and the subquery is not flattened",
        (T + "test_subagents.py::test_the_trees_spend_reads_each_childs_step_once",),
        "every child model call's admission scans every step row under its tree's lock",
    ),
    Mutant(
        "run-tree-walk-not-cut",
        "db/queries.sql",
        "FROM (SELECT * FROM down LIMIT :max_nodes + 1) d",
        "FROM (SELECT * FROM down) d",
        (T + "test_run_tree.py::test_the_statement_reads_a_bounded_number_of_rows",),
        "issue 25.3: GET /api/runs/{id}/tree walks the whole tree before cutting it at 200",
    ),
    Mutant(
        "run-tree-plan-left-to-statistics",
        "db/queries.sql",
        "set_config('enable_bitmapscan', 'off', true)",
        "set_config('enable_bitmapscan', 'on', true)",
        (T + "test_run_tree.py::test_the_statement_reads_a_bounded_number_of_rows",),
        "the tree's walk reads and sorts every child of a run when the planner picks a bitmap",
    ),
    Mutant(
        "run-tree-path-left-out",
        "db/queries.sql",
        "    FROM up LEFT JOIN walked ON walked.id = up.id\n",
        "    FROM up LEFT JOIN walked ON walked.id = up.id WHERE walked.n IS NOT NULL\n",
        (T + "test_run_tree.py::test_a_huge_tree_is_cut_breadth_first_and_keeps_the_asked_run",),
        "a run past the tree's cap is missing from its own tree (the console marks nothing)",
    ),
    Mutant(
        "run-tree-children-unordered",
        "db/queries.sql",
        "        WHERE parent_run_id = down.id\n        ORDER BY created_at, id\n",
        "        WHERE parent_run_id = down.id\n        ORDER BY id\n",
        (T + "test_run_tree.py::test_the_statement_reads_a_bounded_number_of_rows",),
        "the tree's cut keeps children in id order, not the oldest first, sorting them all",
    ),
    # -- messages, signals and children (issue 35, "Tests that would notice") --
    Mutant(
        "message-retried-interrupt-aborts-again",
        "api/messages.py",
        'if policy == "interrupt" and created and live is not None',
        'if policy == "interrupt" and live is not None',
        (
            T + "test_message_interrupt.py::test_a_retried_interrupt_does_not_abort_the_call"
            "_that_carries_its_message",
        ),
        "a retried interrupt POST aborts the call that already carries its message (paid twice)",
    ),
    Mutant(
        "message-does-not-wake-a-parked-run",
        "db/store/api.py",
        "woken = None if reopened else _wake(conn, run_id, send=True)",
        "woken = None",
        (
            T + "test_messages.py::test_a_message_wakes_a_run_parked_on_a_timer_and_is"
            "_delivered_now",
        ),
        "a message to a run parked on a timer waits for the timer",
    ),
    Mutant(
        "message-continued-deadline-not-renewed",
        "db/queries.sql",
        "    deadline_at = CASE WHEN status = 'SUCCEEDED'\n"
        "                       THEN now() + make_interval(secs => COALESCE(timeout_seconds,"
        " 600))\n",
        "    deadline_at = CASE WHEN false\n"
        "                       THEN now() + make_interval(secs => COALESCE(timeout_seconds,"
        " 600))\n",
        (
            T + "test_messages.py::test_a_finished_run_past_its_deadline_continues_with_a"
            "_deadline_from_the_message",
        ),
        "a conversation continued past its first turn's timeout ends TIMED_OUT at once",
    ),
    Mutant(
        "signal-pending-newest-first",
        "db/queries.sql",
        "WHERE run_id = :run_id AND name = :name AND consumed_by IS NULL\nORDER BY id LIMIT 1",
        "WHERE run_id = :run_id AND name = :name AND consumed_by IS NULL\nORDER BY id DESC LIMIT 1",
        (
            T + "test_signals.py::test_signals_kept_for_a_run_are_read_oldest_first",
            T + "test_messages.py::test_messages_are_delivered_in_the_order_posted",
        ),
        "two pending signals (or messages) delivered newest first",
    ),
    Mutant(
        "signal-wait-without-the-run-lock",
        "db/store/worker.py",
        "            if signal is not None:\n"
        '                f.conn.execute(Q["lock_run_row"], {"id": claim.run_id})\n',
        "            if signal is not None:\n",
        (T + "test_signals.py::test_a_signal_sent_while_the_run_parks_for_it_wakes_it",),
        "a signal landing between a wait's look and its park is never woken (the run sleeps "
        "until its deadline)",
    ),
    Mutant(
        "send-keyed-without-the-sender-run",
        "runtime/durable/simple.py",
        'idempotency_key=f"{at.ex.run_id}/{at.key}",',
        "idempotency_key=at.key,",
        (T + "test_signals.py::test_two_runs_sending_one_name_to_a_run_both_arrive",),
        "two runs sending one name to a run: the second silently dropped",
    ),
    Mutant(
        "cancel-children-one-level",
        "db/store/base.py",
        '            conn.execute(Q["cancel_pending_approvals"], {"id": child})\n'
        "            _cancel_children(conn, child)\n",
        '            conn.execute(Q["cancel_pending_approvals"], {"id": child})\n',
        (T + "test_child_runs.py::test_cancelling_a_run_cancels_its_grandchildren_too",),
        "a cancel ends the children, and the grandchildren keep running and billing",
    ),
    Mutant(
        "stop-leaves-the-child-step-pending",
        "db/store/base.py",
        "    if cancelled:\n",
        "    if False:\n",
        (
            T + "test_child_runs.py::test_a_parent_resumed_after_timing_out_while_it_waited"
            "_starts_its_child_again",
        ),
        "issue 35 U9: a parent that timed out while it waited, resumed, reads the child it "
        "cancelled itself and fails on it for ever",
    ),
    Mutant(
        "stop-leaves-the-sub-agent-step-pending",
        "db/queries.sql",
        "WHERE run_id = :id AND kind = 'CHILD' AND status = 'PENDING'\n",
        "WHERE run_id = :id AND kind = 'CHILD' AND status = 'PENDING' AND tool_use_id IS NULL\n",
        (
            T + "test_subagents.py::test_a_lead_resumed_after_timing_out_is_told_its_sub_agents"
            "_were_cancelled_by_its_end",
        ),
        "issue 35 U9 (agent loop): a lead resumed after timing out reads 'cancelled by "
        "request' from the sub-agents it cancelled itself",
    ),
    Mutant(
        "replay-takes-a-usage-report-for-a-tool-result",
        "runtime/pipeline/replay.py",
        "        turn = turn_of(step)  # the kind says",
        "        turn = Turn.TOOL_RESULT if step.kind is StepKind.LLM else turn_of(step)  #",
        (
            T + "test_record_usage.py::test_a_tool_reporting_its_model_call_hands_the_model_one"
            "_result_per_tool_use",
        ),
        "issue 35 U1: a tool's usage report replayed as a tool_result with tool_use_id null",
    ),
    Mutant(
        "wake-crosses-the-floor",
        "db/queries.sql",
        "  AND (wake_floor IS NULL OR wake_floor <= now())\n",
        "",
        (T + "test_wake_floor.py",),
        "issue 35 U2: a signal or message cuts a server's retry-after or a backoff short",
    ),
    Mutant(
        "send-wakes-after-its-commit",
        "db/store/worker.py",
        "            woken = _wake(f.conn, target, send=True)\n",
        "            woken = None\n",
        (
            T + "test_records_durable.py::test_a_signal_wakes_its_parked_target_in_the_senders"
            "_transaction",
        ),
        "issue 35 U3: a sender that dies after its commit leaves the target asleep",
    ),
    Mutant(
        "cancel-undoes-steps-and-approvals-only",
        "db/store/base.py",
        "COMPENSABLE_KINDS = (StepKind.STEP, StepKind.LLM, StepKind.SIDE_EFFECT, "
        "StepKind.APPROVAL)",
        "COMPENSABLE_KINDS = (StepKind.STEP, StepKind.APPROVAL)",
        (
            T + "test_early_stops.py::test_a_parked_function_cancelled_compensates_every"
            "_compensable_kind",
        ),
        "issue 35 U4: a parked function's side_effect or llm compensation never runs on cancel",
    ),
    Mutant(
        "operator-fail-ends-in-place",
        "db/queries.sql",
        "SET status = CASE WHEN state.undo THEN 'RUNNING' ELSE 'FAILED' END,",
        "SET status = 'FAILED',",
        (T + "test_early_stops.py::test_an_operators_fail_is_the_engines_stop",),
        "issue 35 U5: an operator's fail compensates nothing",
    ),
    Mutant(
        "message-recorded-around-the-checkpoint",
        "runtime/agentloop/loop.py",
        "        dispatch = task.deliver_message(row)\n",
        "        dispatch = task.store.deliver_message(task.claim, lambda c: row)\n",
        ("tests/unit/test_one_pipeline.py::test_only_the_pipeline_writes_a_runs_steps_or_state",),
        "issue 35 U6: a program records its own step, around the checkpoint's blip retry",
    ),
    # issue 35.4: every billed call counted once
    Mutant(
        "collect-subagent-drops-unrecorded-cost",
        "runtime/agentloop/loop.py",
        "            cost = child.cost_usd + child.unrecorded_cost_usd\n",
        "            cost = child.cost_usd\n",
        (T + "test_subagents.py::test_a_grandchilds_unrecorded_tokens_and_cost_reach_the_root",),
        "a child's unrecorded cost is left out of its parent's: the cost budget under-counts",
    ),
    Mutant(
        "child-row-drops-the-trees-unrecorded-tokens",
        "runtime/agentloop/loop.py",
        "unrecorded_tokens=usage.unrecorded_in_tree(child),",
        "unrecorded_tokens=child.unrecorded_tokens,",
        (T + "test_subagents.py::test_a_grandchilds_unrecorded_tokens_and_cost_reach_the_root",),
        "issue 35 U8: a grandchild's unrecorded tokens reach the child only, never the root",
    ),
    Mutant(
        "sweep-tree-holds-keeps-ended-runs",
        "db/queries.sql",
        "  AND (r.status IN ('SUCCEEDED', 'FAILED', 'CANCELLED', 'TIMED_OUT')\n       OR EXISTS",
        "  AND (EXISTS",
        (T + "test_subagents.py::test_the_hold_of_a_call_lost_by_a_run_that_then_ended_is_swept",),
        "the hold of a call lost by a run that ended is never swept: the tree's budget shrinks",
    ),
    Mutant(
        "settle-erases-a-kept-call-record",
        "runtime/admission/flow_control.py",
        "  if ARGV[11] ~= '1' and cur and",
        "  if cur and",
        (
            T + "test_lost_attempts.py::test_an_answer_owed_by_its_worker_keeps_the_call_record"
            "_until_it_is_written",
        ),
        "the settle erases the record of a call whose usage is owed: lost with a dead worker",
    ),
    Mutant(
        "owed-usage-settle-skips-then",
        "db/owed.py",
        "                else:\n                    _after(params, then)\n",
        "",
        (
            T + "test_owed_usage.py::test_usage_written_when_the_database_returns_runs_what"
            "_follows_it",
        ),
        "a call answered during an outage is counted twice (its record outlives the count)",
    ),
    Mutant(
        "admit-lost-call-past-the-budget",
        "runtime/pipeline/modelcall.py",
        "        over = spent >= run.token_budget or (",
        "        over = spent > run.token_budget or (",
        (
            T + "test_lost_attempts.py::test_a_lost_call_that_brings_the_run_to_its_budget"
            "_exactly_ends_it_before_the_next",
        ),
        "one more call is made past a budget the lost call's estimate exhausted",
    ),
    Mutant(
        "stale-admission-takes-the-new-holders-call",
        "runtime/admission/flow_control.py",
        "  if theirs and ours and theirs > ours then",
        "  if false then",
        (
            T + "test_lost_attempts.py::test_a_worker_that_wakes_up_fenced_out_does_not_count_the"
            "_new_holders_call_as_lost",
        ),
        "issue 35's SIGSTOP over-count: a worker woken up fenced out counts the new holder's "
        "call in flight as lost, and the estimate stays beside its recorded count",
    ),
    Mutant(
        "lost-call-estimated-below-max-tokens",
        "runtime/pipeline/modelcall.py",
        "    return Usage(input_tokens=estimate_tokens(body), output_tokens=request.max_tokens)\n",
        "    return Usage(input_tokens=estimate_tokens(body), output_tokens=64)\n",
        (T + "test_lost_attempts.py::test_a_lost_calls_estimate_covers_it",),
        "a lost call's estimate is no longer an upper bound: budgets under-count it",
    ),
    Mutant(
        "approval-runs-what-was-not-approved",
        "runtime/durable/approval.py",
        "        return at.found.state is State.RECORDED or mismatch\n",
        "        return at.found.state is State.RECORDED\n",
        (T + "test_advance_kinds.py::test_an_approval_granted_for_other_arguments_never_runs",),
        "an approval granted for other arguments runs the code's new ones (issue 35 item 1: "
        "the approval's answer moved into its kind object)",
    ),
    Mutant(
        "framework-billed-failure-unrecorded",
        "runtime/durable/billed.py",
        "        if billed is not None:\n            return Record([row], write=_billed_failure(",
        "        if False:\n            return Record([row], write=_billed_failure(",
        (
            "tests/frameworks/test_openai_agents.py::test_a_response_that_ends_incomplete_is"
            "_counted_with_what_it_billed",
        ),
        "issue 35 U7: an incomplete response, billed, is recorded without its usage",
    ),
    Mutant(
        "framework-cancel-counts-nothing",
        "runtime/frameworks/bridge.py",
        "        cut = Usage(input_tokens=estimate_input(), output_tokens=out)\n",
        "        cut = Usage()\n",
        (
            "tests/frameworks/test_openai_agents.py::test_a_cancel_aborts_the_sdks_streamed_model"
            "_call_in_flight",
        ),
        "issue 35 U7: a cancelled framework call, billed, is recorded with zero usage",
    ),
    Mutant(
        "claim-unrenewed-until-read",
        "runtime/engine/driver.py",
        "        with self.heartbeat.claiming(run_id, token, self.worker):\n"
        "            try:\n"
        "                claim = self.store.claim(",
        "        with self.heartbeat.claiming(run_id, uuid.uuid4(), self.worker):\n"
        "            try:\n"
        "                claim = self.store.claim(",
        (T + "test_heartbeat_claims.py::test_drive_renews_its_claim_before_it_reads_the_answer",),
        "issue 36: a claim whose answer a starved greenlet reads late lapses, never renewed",
    ),
    Mutant(
        "claim-renewal-revives-a-lapsed-lease",
        "db/queries.sql",
        "  AND r.locked_by = :worker AND r.status = 'RUNNING' AND r.locked_until > now();\n",
        "  AND r.locked_by = :worker AND r.status = 'RUNNING';\n",
        (
            T + "test_heartbeat_claims.py::test_a_lapsed_lease_under_the_same_name_and_token_is"
            "_not_renewed",
        ),
        "issue 36: a claim keeps a dead namesake's lapsed lease alive and then drops its message",
    ),
)


def _copy_tree() -> Path:
    """The repository's files (committed or not, ignored ones left out) in a temporary
    directory."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    dest = Path(tempfile.mkdtemp(prefix="dar-mutants-"))
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src = ROOT / rel
        if not src.is_file():
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return dest


def _run_tests(tree: Path, tests: tuple[str, ...]) -> tuple[bool, str]:
    """``True`` when every test passed; the last line pytest printed."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    return proc.returncode == 0, (lines[-1] if lines else proc.stderr.strip()[-200:])


def main(argv: list[str]) -> int:
    if "--list" in argv:
        for m in MUTANTS:
            print(f"{m.name}  ({m.path}): {m.why}")
            for t in m.tests:
                print(f"    {t}")
        return 0
    words = [a for a in argv if not a.startswith("-")]
    chosen = [m for m in MUTANTS if not words or any(w in m.name for w in words)]
    tree = _copy_tree()
    results: dict[str, str] = {}
    try:
        for m in chosen:
            target = tree / m.path
            original = target.read_text()
            if original.count(m.old) != 1:
                results[m.name] = "stale"
                print(f"STALE     {m.name}: the patch's text is not in {m.path} exactly once")
                continue
            # The unmutated tests must pass first, or "killed" would mean nothing.
            passed, line = _run_tests(tree, m.tests)
            if not passed:
                results[m.name] = "stale"
                print(f"STALE     {m.name}: its tests fail without the mutant ({line})")
                continue
            started = time.monotonic()
            target.write_text(original.replace(m.old, m.new, 1))
            try:
                passed, line = _run_tests(tree, m.tests)
            finally:
                target.write_text(original)
            verdict = "survived" if passed else "killed"
            results[m.name] = verdict
            took = time.monotonic() - started
            print(f"{verdict.upper():9} {m.name} ({took:.0f}s): {m.why} [{line}]", flush=True)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    killed = sum(1 for v in results.values() if v == "killed")
    scored = sum(1 for v in results.values() if v in ("killed", "survived"))
    stale = sum(1 for v in results.values() if v == "stale")
    score = f"{100 * killed / scored:.0f}%" if scored else "n/a"
    print(f"\nmutation score: {killed} of {scored} killed ({score}); {stale} stale")
    return 0 if killed == scored and not stale else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
