"""``GET /api/runs/{id}/events``: a run as Server-Sent Events, resumable by ``Last-Event-ID``.

Two sources, one order:

- durable events (``run.status``, ``step.started``, ``step.finished``, ``approval.requested``,
  ``approval.decided``, ``run.finished``) are rows of ``run_event`` in PostgreSQL, numbered
  per run in commit order (migration 0010). Their id is ``<run tag>.<n>``;
- live events (``text.delta``, ``text.retract``, and those code publishes with
  ``steps.live_event``: a framework agent's tool calls, outputs, handoffs) ride a Redis stream
  (:mod:`runtime.observe.live_channel`). Their id is ``<run tag>.<base>.<redis id>``, ``base``
  being the last durable event when the model attempt began, so a delta sorts after that event and
  before the next.

Ids compare as ``(n or base, redis ms, redis seq)``; a client resuming after an id gets every
event above it, in that order, from PostgreSQL and from what Redis still holds: no gap, no
duplicate. Losing Redis loses only deltas (the step's full text is in its ``step.finished``).
A delta that arrives after a later durable event was sent (a zombie attempt) is dropped.

The run tag is the first 8 hex digits of the run id: an id of another run is refused (400).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import redis
from flask import Blueprint, Response, current_app, request
from sqlalchemy import RowMapping

from api.auth import current_principal, requires
from api.errors import ApiError
from api.eventhub import EventHub, Waiter
from api.runs import load_run, parse_run_id
from api.state import state
from db import jsontext
from db.records import RunStatus, StepKind
from db.store import RunStore
from runtime.config import Settings
from runtime.observe.live_channel import LiveChannel, LiveEntry

log = logging.getLogger(__name__)

bp = Blueprint("events", __name__)

EVENT_ID = re.compile(r"([0-9a-f]{8})\.(\d{1,18})(?:\.(\d{1,18})-(\d{1,18}))?")
Order = tuple[int, int, int]


def run_tag(run_id: uuid.UUID) -> str:
    return run_id.hex[:8]


@dataclass(frozen=True, slots=True)
class Cursor:
    order: Order

    @property
    def durable(self) -> int:
        return self.order[0]


def parse_event_id(raw: str, run_id: uuid.UUID, last_event: int) -> Cursor:
    """The position after which to resume; 400 when ``raw`` is not an id of this run."""
    m = EVENT_ID.fullmatch(raw.strip())
    if m is None:
        raise ApiError(
            400,
            f"Last-Event-ID {raw[:80]!r} is not an event id of this API "
            "(<run tag>.<n> or <run tag>.<n>.<ms>-<seq>)",
            code="invalid_event_id",
            field="Last-Event-ID",
        )
    tag, n, ms, seq = m.groups()
    if tag != run_tag(run_id) or int(n) > last_event:
        raise ApiError(
            400,
            f"Last-Event-ID {raw!r} is not an event of run {run_id}",
            code="invalid_event_id",
            field="Last-Event-ID",
        )
    return Cursor((int(n), int(ms or 0), int(seq or 0)))


def _text(response: Any) -> str | None:
    blocks = response.get("content") if isinstance(response, dict) else response
    if not isinstance(blocks, list):
        return None
    parts = [b.get("text", "") for b in blocks if isinstance(b, dict) and b.get("type") == "text"]
    return "".join(str(p) for p in parts)


def durable_event(row: RowMapping) -> tuple[str, dict[str, Any]]:
    kind = row["kind"]
    if kind == "run.status":
        status = RunStatus(row["status"])
        if status.terminal:
            return "run.finished", {
                "status": str(status),
                "error": row["run_error"],
                "result": row["run_result"],
            }
        return "run.status", {"status": str(status)}
    if kind == "step.finished" and row["step_kind"] == StepKind.MESSAGE:
        # A message posted to the run, delivered at a step boundary (its MESSAGE step).
        return "message.received", {
            "seq": row["step_seq"],
            "key": row["step_key"],
            "content": jsontext.loads(row["response"]),
        }
    if kind in ("step.started", "step.finished"):
        data: dict[str, Any] = {
            "seq": row["step_seq"],
            "key": row["step_key"],
            "kind": row["step_kind"],
            "attempt": row["attempt"],
        }
        if row["tool_name"]:
            data["tool"] = row["tool_name"]
        if kind == "step.finished":
            data.update(
                status=row["status"],
                tokens={
                    "input": row["input_tokens"] or 0,
                    "output": row["output_tokens"] or 0,
                    "cacheCreationInput": row["cache_creation_input_tokens"] or 0,
                    "cacheReadInput": row["cache_read_input_tokens"] or 0,
                },
                costUsd=str(row["cost_usd"] or 0),
                latencyMs=row["latency_ms"],
                error=row["error"],
            )
            if row["step_kind"] in (StepKind.MODEL, StepKind.LLM):
                data["model"] = row["model"]
                data["text"] = _text(jsontext.loads(row["response"]))
        return kind, data
    if kind == "run.recovery":  # the reaper re-dispatched it, or a worker resumed it
        return kind, {
            "action": row["recovery_action"],
            "by": row["recovery_actor"],
            "detail": row["recovery_detail"],
            "at": row["at"].isoformat() if row["at"] else None,
        }
    return kind, {
        "approvalId": str(row["approval_id"]) if row["approval_id"] else None,
        "key": row["approval_step_key"],
        "role": row["role"],
        "status": row["status"],
        "decidedBy": row["decided_by"],
        "comment": row["comment"],
        # A decision copied by a fork from the run that made it, not made for this run.
        "copiedFrom": str(row["copied_from"]) if row["copied_from"] else None,
    }


def live_event(entry: LiveEntry) -> tuple[str, dict[str, Any]]:
    if entry.type not in ("text.delta", "text.retract"):  # steps.live_event: its JSON data
        try:
            payload = json.loads(entry.text)
        except ValueError:
            payload = None
        return entry.type, payload if isinstance(payload, dict) else {"value": payload}
    data: dict[str, Any] = {"key": entry.key, "attempt": entry.attempt}
    if entry.type == "text.delta":
        data["text"] = entry.text
    return entry.type, data


def _sse(event_id: str, name: str, data: dict[str, Any]) -> str:
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False, default=str)
    return f"id: {event_id}\nevent: {name}\ndata: {payload}\n\n"


class EventStream:
    """One client's stream: a generator of SSE text."""

    def __init__(
        self,
        store: RunStore,
        live: LiveChannel | None,
        run_id: uuid.UUID,
        after: Cursor,
        settings: Settings,
        *,
        hub: EventHub,
        finished: bool = False,
    ) -> None:
        self.hub = hub
        self.store = store
        self.live = live
        self.run_id = run_id
        self.tag = run_tag(run_id)
        self.last: Order = after.order
        self.durable = after.durable
        self.settings = settings
        self.live_after = "0-0"
        self.pending: list[LiveEntry] = []
        self.finished = finished
        """The run has ended: close once every durable event has been sent."""

    def _read_live(self) -> None:
        if self.live is None:
            return
        try:
            found = self.live.entries(self.run_id, self.live_after)
        except redis.RedisError as e:
            log.debug("live stream of run %s: Redis unavailable (%s)", self.run_id, e)
            return
        if found:
            self.live_after = found[-1].rid
            self.pending += found

    def _batch(self, read_durable: bool) -> list[tuple[Order, str, str, dict[str, Any]]]:
        out: list[tuple[Order, str, str, dict[str, Any]]] = []
        if read_durable or any(e.base > self.durable for e in self.pending):
            rows = self.store.run_events_after(self.run_id, self.durable)
            # Redis after PostgreSQL: a worker publishes a step's last delta before it commits
            # the step, so every delta ordered before the events just read is in Redis now.
            # Read the other way round (or not at all, when only PostgreSQL changed), the last
            # delta could arrive after its step's events were sent, and be dropped as
            # superseded.
            self._read_live()
            for row in rows:
                name, data = durable_event(row)
                out.append(((row["n"], 0, 0), f"{self.tag}.{row['n']}", name, data))
        limit = max([self.durable, *(o[0] for o, *_ in out)])
        keep: list[LiveEntry] = []
        for entry in self.pending:
            if entry.base > limit:
                keep.append(entry)  # its durable event is not visible yet: wait for it
                continue
            name, data = live_event(entry)
            out.append((entry.order, f"{self.tag}.{entry.base}.{entry.rid}", name, data))
        self.pending = keep
        out.sort(key=lambda e: e[0])
        return out

    def __iter__(self) -> Iterator[str]:
        s = self.settings
        started = last_event = last_write = time.monotonic()
        yield f"retry: {int(s.events_poll_seconds * 1000)}\n\n"
        waiter = Waiter(self.run_id, self.durable)
        self.hub.subscribe(waiter)
        try:
            while True:
                # Flags first, reads after: a change the hub sees meanwhile wakes us again.
                waiter.wake.clear()
                read_durable, waiter.durable_changed = waiter.durable_changed, False
                read_live, waiter.live_changed = waiter.live_changed, False
                if read_live:
                    self._read_live()
                for order, event_id, name, data in self._batch(read_durable):
                    if order <= self.last:
                        continue  # a delta of an attempt a later durable event superseded
                    self.last = order
                    if order[1] == 0:
                        self.durable = order[0]
                    yield _sse(event_id, name, data)
                    last_event = last_write = time.monotonic()
                    self.finished = self.finished or name == "run.finished"
                waiter.durable, waiter.live_after = self.durable, self.live_after
                if read_durable and self.finished:
                    return  # this batch read everything PostgreSQL holds after the end
                if self.hub.draining:
                    return  # the process is stopping: the client resumes elsewhere
                now = time.monotonic()
                if now - started >= s.events_max_seconds:
                    return
                if now - last_event >= s.events_idle_seconds:
                    return
                if now - last_write >= s.events_heartbeat_seconds:
                    yield ": keepalive\n\n"
                    last_write = now
                waiter.wake.wait(
                    min(
                        s.events_heartbeat_seconds - (now - last_write),
                        s.events_idle_seconds - (now - last_event),
                        s.events_max_seconds - (now - started),
                    )
                )
        finally:
            self.hub.unsubscribe(waiter)


class StreamSlots:
    """Open event streams in this process, counted per token, per tenant and in all: a stream
    past a limit is refused (429) instead of holding one more connection, so one token (or
    tenant) cannot take the connections ``/healthz`` and a submit need."""

    RETRY_AFTER = 5

    def __init__(self, per_token: int, per_tenant: int, total: int) -> None:
        self.limits = {"token": per_token, "tenant": per_tenant, "process": total}
        self.open: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def take(self, token: str | None, tenant: str | None) -> Callable[[], None]:
        """A slot for one stream (a function that gives it back), or a 429."""
        keys = [("process", "")]
        if token is not None:
            keys += [("token", token), ("tenant", tenant or "")]
        with self._lock:
            for key in keys:
                limit = self.limits[key[0]]
                if limit and self.open.get(key, 0) >= limit:
                    raise ApiError(
                        429,
                        _STREAM_LIMIT[key[0]].format(limit=limit),
                        code="too_many_streams",
                        headers={"Retry-After": str(self.RETRY_AFTER)},
                    )
            for key in keys:
                self.open[key] = self.open.get(key, 0) + 1
        given: list[bool] = []

        def give() -> None:
            with self._lock:
                if given:
                    return
                given.append(True)
                for key in keys:
                    self.open[key] -= 1
                    if not self.open[key]:
                        del self.open[key]

        return give


_STREAM_LIMIT = {
    "token": "this token holds {limit} open event streams, its limit "
    "(DAR_EVENTS_STREAMS_PER_TOKEN): close one, or retry later",
    "tenant": "this tenant's tokens hold {limit} open event streams, its limit "
    "(DAR_EVENTS_STREAMS_PER_TENANT): close one, or retry later",
    "process": "this server holds {limit} open event streams, its limit "
    "(DAR_EVENTS_STREAMS_MAX): retry later",
}


def stream_slots() -> StreamSlots:
    slots = current_app.extensions.get("dar_stream_slots")
    if slots is None:
        st = state().runtime.settings
        slots = StreamSlots(
            st.events_streams_per_token, st.events_streams_per_tenant, st.events_streams_max
        )
        current_app.extensions["dar_stream_slots"] = slots
    return cast(StreamSlots, slots)


EVENT_HUB = "dar_event_hub"
"""The app's extension that holds this process's hub, once a stream made it."""


def event_hub() -> EventHub:
    """This process's hub (made on first use)."""
    hub = current_app.extensions.get(EVENT_HUB)
    if hub is None:
        rt = state().runtime
        hub = EventHub(rt.store, rt.live, rt.settings.events_poll_seconds)
        current_app.extensions[EVENT_HUB] = hub
    return cast(EventHub, hub)


@bp.get("/runs/<run_id>/events")
@requires("read")
def events(run_id: str) -> Response:
    """The run's events as ``text/event-stream``; resume with ``Last-Event-ID`` (or
    ``?after=``)."""
    s = state()
    run = load_run(parse_run_id(run_id))
    raw = request.headers.get("Last-Event-ID") or request.args.get("after")
    last_event = s.runtime.store.run_event_seq(run.id) or 0
    after = parse_event_id(raw, run.id, last_event) if raw else Cursor((0, 0, 0))
    principal = current_principal()
    give_back = stream_slots().take(
        principal.name if principal else None, principal.tenant if principal else None
    )
    stream = EventStream(
        s.runtime.store,
        s.runtime.live,
        run.id,
        after,
        s.runtime.settings,
        hub=event_hub(),
        finished=run.status.terminal,
    )
    response = Response(
        iter(stream),
        mimetype="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    response.call_on_close(give_back)  # the server closes the response when the stream ends
    return response
