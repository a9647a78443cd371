"""Telling people that a durable function waits for their approval (after the commit)."""

from __future__ import annotations

import json
import logging
import urllib.request
import uuid
from typing import TYPE_CHECKING, Any

from runtime.durable.api import ApprovalBuilder, ApprovalRequest, DurableAgent

if TYPE_CHECKING:
    from runtime.pipeline.checkpoint import Task

log = logging.getLogger(__name__)


def notify_approval(
    task: Task,
    agent: DurableAgent,
    approval_id: uuid.UUID,
    key: str,
    builder: ApprovalBuilder,
    payload: Any,
    digest: str,
) -> None:
    """The agent's ``on_approval`` hook and the DAR_APPROVAL_WEBHOOK_URL; a failure of
    either is logged, never the run's."""
    request = ApprovalRequest(
        approval_id=approval_id,
        run_id=task.run_id,
        agent=agent.name,
        step_key=key,
        role=builder.role,
        payload=payload,
        payload_hash=digest,
        timeout_seconds=builder.timeout_seconds,
        timeout_policy=builder.policy,
    )
    if agent.on_approval is not None:
        try:
            agent.on_approval(request)
        except Exception:
            log.exception("approval hook of %s failed", agent.name)
    url = task.settings.approval_webhook_url
    if not url:
        return
    body = json.dumps(
        {
            "approvalId": str(request.approval_id),
            "runId": str(request.run_id),
            "agent": request.agent,
            "stepKey": request.step_key,
            "role": request.role,
            "payloadHash": request.payload_hash,
            "timeoutPolicy": request.timeout_policy,
        }
    ).encode()
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        urllib.request.urlopen(req, timeout=5).close()
    except Exception as e:
        log.warning("approval webhook failed: %s", e)
