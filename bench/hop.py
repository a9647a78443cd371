"""The floor of this design, measured on the same database and broker as the runtime:

- ``checkpoint``: one transaction with the same UPDATE of ``run`` and INSERT of ``run_step``
  as the store's model checkpoint (``advance_run`` + ``insert_model_step``), fenced on the
  dispatch token instead of the lease (there is no claim in the floor);
- ``bench.hop``: a bare Celery task (same broker options as the runtime: late acks, prefetch
  1, no results, JSON) that runs that checkpoint and re-enqueues itself.

The worker side is ``bench.hop_app`` (``celery -A bench.hop_app worker ...``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from celery import Celery
from sqlalchemy import Connection, text

HOP_TASK = "bench.hop"
HOP_TIMES = "dar-bench-hop-times"
"""The Redis list where hops without a database record their times."""

# advance_run's SET list, word for word; fenced on the dispatch token, not on a lease.
ADVANCE = text(
    """
UPDATE run
SET tokens_used = tokens_used + :total_tokens,
    input_tokens = input_tokens + :input_tokens,
    output_tokens = output_tokens + :output_tokens,
    cache_creation_input_tokens = cache_creation_input_tokens + :cache_creation_input_tokens,
    cache_read_input_tokens = cache_read_input_tokens + :cache_read_input_tokens,
    cost_usd = cost_usd + :cost_usd,
    claims_without_progress = 0,
    locked_by = NULL, locked_until = NULL,
    dispatch_token = :next_token, dispatched_at = now(),
    wait_reason = NULL,
    updated_at = now()
WHERE id = :id AND dispatch_token = :token
"""
)

# The model step row, as the store inserted it when this baseline was written (the store
# now does the advance and the insert in one statement; the baseline keeps its two).
INSERT_MODEL_STEP = text(
    """
INSERT INTO run_step (run_id, seq, step_key, kind, status, model, request, prompt_hash,
                      response, stop_reason, input_tokens, output_tokens,
                      cache_creation_input_tokens, cache_read_input_tokens, cost_usd,
                      latency_ms, request_id, worker, lease_epoch, started_at, finished_at)
VALUES (:id, :seq, :step_key, 'MODEL', 'DONE', :model, CAST(:request AS jsonb), :prompt_hash,
        CAST(:response AS jsonb), :stop_reason, :input_tokens, :output_tokens,
        :cache_creation_input_tokens, :cache_read_input_tokens, :cost_usd,
        :latency_ms, :request_id, :worker, :epoch,
        now() - make_interval(secs => :latency_ms / 1000.0), now())
"""
)

RESPONSE = json.dumps(
    [{"type": "tool_use", "id": "toolu_bench_00001", "name": "noop", "input": {"i": 1}}],
    separators=(",", ":"),
)


def checkpoint(
    conn: Connection, run_id: Any, token: Any, next_token: Any, seq: int, worker: str
) -> bool:
    """The UPDATE + INSERT of a model checkpoint; False when the token is stale."""
    usage = {
        "input_tokens": 10,
        "output_tokens": 5,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    owned = conn.execute(
        ADVANCE,
        {
            "id": run_id,
            "token": token,
            "next_token": next_token,
            "total_tokens": 15,
            "cost_usd": 0,
            **usage,
        },
    ).rowcount
    if owned == 0:
        return False
    conn.execute(
        INSERT_MODEL_STEP,
        {
            "id": run_id,
            "seq": seq,
            "step_key": f"model:{seq}",
            "model": "bench-model",
            "request": None,
            "prompt_hash": "0" * 64,
            "response": RESPONSE,
            "stop_reason": "tool_use",
            "cost_usd": 0,
            "latency_ms": 0,
            "request_id": None,
            "worker": worker,
            "epoch": 0,
            **usage,
        },
    )
    return True


def make_hop_app(redis_url: str, queue: str, *, events: bool = False) -> Celery:
    app = Celery("bench-hop", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        result_backend=None,
        task_serializer="json",
        accept_content=["json"],
        task_default_queue=queue,
        task_routes={HOP_TASK: {"queue": queue}},
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": 3600},
        worker_hijack_root_logger=False,
        worker_send_task_events=events,
        task_send_sent_event=events,
    )
    return app


def new_token() -> str:
    return str(uuid.uuid4())
