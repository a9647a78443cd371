"""A Python client of the REST API, standard library only (``urllib``), so scripts, tests and
the ``dar`` CLI (which is built on it) use it anywhere without loading the runtime:

    from runtime.client import Client

    client = Client("http://127.0.0.1:8080", token=None)  # or DAR_API_URL / DAR_API_TOKEN
    run = client.submit("Which acme tickets are overdue?", token_budget=50_000)
    for event in client.events(run.id):  # steps as they finish, the model's text as it streams
        print(event.name, event.data)
    done = client.wait(run.id)
    print(done.status, done.result)

Results are typed (:class:`Run`, :class:`Step`, :class:`Approval`, :class:`Accepted`; each
keeps the whole JSON object as ``raw``). An error answer raises the :class:`ApiError` subclass
of its status (:class:`NotFound`, :class:`Conflict`, :class:`RateLimited` ...) carrying the
API's ``code``, ``message`` and ``field``; an API that does not answer raises
:class:`ApiUnreachable`. ``follow(base_url, run_id)`` yields a run's events, reconnecting with
``Last-Event-ID`` until ``run.finished``.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from db.errors import DarError

DEFAULT_API_URL = "http://127.0.0.1:8080"
ENDED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED", "TIMED_OUT"})
"""The statuses a run does not leave by itself."""


class ClientError(DarError):
    """The API call failed."""


class ApiUnreachable(ClientError):
    """The API did not answer."""


class ApiError(ClientError):
    """The API answered with an error: ``status``, its ``code``, ``message`` and the request
    ``field`` it names (when one is at fault)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str = "",
        field: str | None = None,
        retry_after: float | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message
        self.code = code
        self.field = field
        self.retry_after = retry_after
        self.body = body


class BadRequest(ApiError):
    """400, 413, 415, 422: the request is wrong; the message names the fix."""


class Unauthorized(ApiError):
    """401: send a valid token."""


class Forbidden(ApiError):
    """403: the token lacks the role (or the tenant)."""


class NotFound(ApiError):
    """404: no such run or approval (in this token's tenant)."""


class Conflict(ApiError):
    """409: the run or approval is not in a state that allows this."""


class RateLimited(ApiError):
    """429: over a quota; ``retry_after`` says when to try again."""


class ServerError(ApiError):
    """5xx: the server failed (or its database is unavailable)."""


def _error_class(status: int) -> type[ApiError]:
    if status >= 500:
        return ServerError
    return {401: Unauthorized, 403: Forbidden, 404: NotFound, 409: Conflict, 429: RateLimited}.get(
        status, BadRequest
    )


def api_error(status: int, raw: bytes, headers: Any = None) -> ApiError:
    """The exception for an error answer (a JSON ``{"error": {...}}`` body, or any other)."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = raw.decode("utf-8", "replace")
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        message, code, fault = str(error.get("message", "")), str(error.get("code", "")), None
        fault = error.get("field")
    else:
        message, code, fault = (str(body).strip() or f"HTTP {status}"), "", None
    retry = headers.get("Retry-After") if headers is not None else None
    try:
        retry_after = float(retry) if retry else None
    except ValueError:
        retry_after = None
    return _error_class(status)(
        status, message, code=code, field=fault, retry_after=retry_after, body=body
    )


@dataclass(frozen=True, slots=True)
class Accepted:
    """What an action answers: the run's id and its status now (``created``: False when an
    ``Idempotency-Key`` returned an earlier submission)."""

    id: str
    status: str
    created: bool = True


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    status: str
    agent: str
    model: str | None
    tokens_used: int
    cost_usd: float
    result: Any
    error: str | None
    locked_by: str | None
    wait_reason: str | None
    created_at: str | None
    finished_at: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Run:
        return cls(
            id=d["id"],
            status=d["status"],
            agent=d.get("agent", ""),
            model=d.get("model"),
            tokens_used=int(d.get("tokensUsed") or 0),
            cost_usd=float(d.get("costUsd") or 0.0),
            result=d.get("result"),
            error=d.get("error"),
            locked_by=d.get("lockedBy"),
            wait_reason=d.get("waitReason"),
            created_at=d.get("createdAt"),
            finished_at=d.get("finishedAt"),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class RunPage:
    items: list[Run]
    next_cursor: str | None


@dataclass(frozen=True, slots=True)
class Step:
    """A timeline entry: a step (``seq`` set) or an audit entry (``kind`` ``AUDIT``, no seq)."""

    seq: int | None
    step_key: str
    kind: str
    status: str
    tool_name: str | None
    stop_reason: str | None
    input_tokens: int
    output_tokens: int
    cost_usd: float
    latency_ms: int | None
    worker: str | None
    error: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Step:
        return cls(
            seq=d.get("seq"),
            step_key=d["stepKey"],
            kind=d["kind"],
            status=d["status"],
            tool_name=d.get("toolName"),
            stop_reason=d.get("stopReason"),
            input_tokens=int(d.get("inputTokens") or 0),
            output_tokens=int(d.get("outputTokens") or 0),
            cost_usd=float(d.get("costUsd") or 0.0),
            latency_ms=d.get("latencyMs"),
            worker=d.get("worker"),
            error=d.get("error"),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class Approval:
    id: str
    run_id: str
    step_key: str
    role: str
    status: str
    payload: Any
    payload_hash: str
    decided_by: str | None
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Approval:
        return cls(
            id=d["id"],
            run_id=d["runId"],
            step_key=d["stepKey"],
            role=d["role"],
            status=d["status"],
            payload=d.get("payload"),
            payload_hash=d.get("payloadHash", ""),
            decided_by=d.get("decidedBy"),
            raw=d,
        )


@dataclass(frozen=True, slots=True)
class MessageSent:
    """A message accepted for a run: delivered at its next step boundary (``new``: False
    when an ``Idempotency-Key`` returned an earlier one)."""

    run_id: str
    message_id: Any
    new: bool
    status: str


_UNSET: Any = object()


class Client:
    """The REST API of one deployment. ``base_url`` defaults to ``DAR_API_URL`` (else
    http://127.0.0.1:8080), ``token`` to ``DAR_API_TOKEN``."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        token: str | None = None,
        timeout_seconds: float = 10.0,
    ) -> None:
        self.base_url = (base_url or os.environ.get("DAR_API_URL") or DEFAULT_API_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get("DAR_API_TOKEN")
        self.timeout_seconds = timeout_seconds
        self.last_status = 0
        """The HTTP status of the last answer (201 or 200 tells a new submission from a
        repeated one)."""

    # -- the wire -----------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One call; the decoded JSON answer, or the :class:`ApiError` of an error answer."""
        if query:
            pairs = {k: v for k, v in query.items() if v is not None}
            path += ("&" if "?" in path else "?") + urllib.parse.urlencode(pairs)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_seconds) as resp:
                self.last_status = resp.status
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            raise api_error(e.code, e.read(), e.headers) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ApiUnreachable(f"cannot reach the API at {self.base_url}: {reason}") from None

    # -- runs -----------------------------------------------------------------------------

    def submit(
        self,
        input: Any,
        *,
        agent: str | None = None,
        model: str | None = None,
        token_budget: int | None = None,
        cost_budget_usd: float | None = None,
        timeout_seconds: int | None = None,
        max_steps: int | None = None,
        concurrency_key: str | None = None,
        priority: int | None = None,
        idempotency_key: str | None = None,
    ) -> Accepted:
        """Start a run (``POST /api/runs``)."""
        body = {"input": input}
        for name, value in (
            ("agent", agent),
            ("model", model),
            ("tokenBudget", token_budget),
            ("costBudgetUsd", cost_budget_usd),
            ("timeoutSeconds", timeout_seconds),
            ("maxSteps", max_steps),
            ("concurrencyKey", concurrency_key),
            ("priority", priority),
        ):
            if value is not None:
                body[name] = value
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        d = self.request("POST", "/api/runs", body, headers=headers)
        return Accepted(d["id"], d["status"], created=self.last_status == 201)

    def get(self, run_id: str) -> Run:
        return Run.from_json(self.request("GET", f"/api/runs/{run_id}"))

    def runs(
        self, *, status: str | None = None, limit: int = 20, cursor: str | None = None
    ) -> RunPage:
        """Runs, newest first (``nextCursor`` pages on)."""
        d = self.request(
            "GET", "/api/runs", query={"limit": limit, "status": status, "cursor": cursor}
        )
        return RunPage([Run.from_json(r) for r in d["items"]], d.get("nextCursor"))

    def timeline(self, run_id: str) -> list[Step]:
        return [Step.from_json(s) for s in self.request("GET", f"/api/runs/{run_id}/timeline")]

    def wait(
        self,
        run_id: str,
        *,
        timeout_seconds: float = 300.0,
        poll_seconds: float = 0.5,
        until: Iterable[str] = ENDED,
    ) -> Run:
        """The run once its status is in ``until`` (by default: ended); ``TimeoutError``
        after ``timeout_seconds``."""
        wanted = frozenset(until)
        deadline = time.monotonic() + timeout_seconds
        while True:
            run = self.get(run_id)
            if run.status in wanted:
                return run
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} is still {run.status} after {timeout_seconds}s")
            time.sleep(poll_seconds)

    def events(self, run_id: str, *, last_event_id: str | None = None) -> Iterator[Event]:
        """The run's live events until ``run.finished`` (see :func:`follow`)."""
        try:
            yield from follow(self.base_url, run_id, token=self.token, last_event_id=last_event_id)
        except urllib.error.HTTPError as e:
            raise api_error(e.code, e.read(), e.headers) from None

    def cancel(self, run_id: str) -> Accepted:
        d = self.request("POST", f"/api/runs/{run_id}/cancel")
        return Accepted(d["id"], d["status"])

    def resume(
        self,
        run_id: str,
        *,
        token_budget: int | None = None,
        timeout_seconds: int | None = None,
    ) -> Accepted:
        """Retry a ``FAILED`` or ``TIMED_OUT`` run from its last checkpoint."""
        body = {
            k: v
            for k, v in (("tokenBudget", token_budget), ("timeoutSeconds", timeout_seconds))
            if v is not None
        }
        d = self.request("POST", f"/api/runs/{run_id}/resume", body)
        return Accepted(d["id"], d["status"])

    def resolve(
        self,
        run_id: str,
        action: str,
        *,
        output: Any = _UNSET,
        is_error: bool = False,
        reason: str | None = None,
    ) -> Accepted:
        """Decide a ``NEEDS_ATTENTION`` run: ``supply_result`` (with ``output``), ``retry``
        or ``fail``."""
        body: dict[str, Any] = {"action": action}
        if output is not _UNSET:
            body["output"] = output
        if is_error:
            body["isError"] = True
        if reason:
            body["reason"] = reason
        d = self.request("POST", f"/api/runs/{run_id}/resolve", body)
        return Accepted(d["id"], d["status"])

    def fork(
        self,
        run_id: str,
        from_seq: int,
        *,
        input: Any = _UNSET,
        tool_result: tuple[int, Any] | None = None,
        model: str | None = None,
        token_budget: int | None = None,
        timeout_seconds: int | None = None,
        replay_model: bool = False,
        idempotency_key: str | None = None,
        reuse_approvals: bool = False,
    ) -> Accepted:
        """A new run that copies this one's steps before ``from_seq`` and runs on from there,
        with the edits given. ``reuse_approvals``: keep the decisions on the approval at
        ``from_seq`` and the approved ones before it (the token needs ``approve`` and each
        approval's role); otherwise the fork asks again for each of them."""
        body: dict[str, Any] = {"fromSeq": from_seq}
        if input is not _UNSET:
            body["input"] = input
        if tool_result is not None:
            body["toolResult"] = {"seq": tool_result[0], "output": tool_result[1]}
        for name, value in (
            ("model", model),
            ("tokenBudget", token_budget),
            ("timeoutSeconds", timeout_seconds),
        ):
            if value is not None:
                body[name] = value
        if replay_model:
            body["replayModel"] = True
        if reuse_approvals:
            body["reuseApprovals"] = True
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        d = self.request("POST", f"/api/runs/{run_id}/fork", body, headers=headers)
        return Accepted(d["id"], d["status"], created=self.last_status == 201)

    def send_message(
        self,
        run_id: str,
        text: Any,
        *,
        policy: str = "enqueue",
        idempotency_key: str | None = None,
    ) -> MessageSent:
        """A message into an agent-loop run (``POST /api/runs/{id}/messages``): text, or a
        list of content blocks; a finished run continues as its next turn."""
        body: dict[str, Any] = {"text" if isinstance(text, str) else "content": text}
        body["policy"] = policy
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        d = self.request("POST", f"/api/runs/{run_id}/messages", body, headers=headers)
        return MessageSent(d["runId"], d["messageId"], bool(d["new"]), d["status"])

    def diff(self, a: str, b: str) -> dict[str, Any]:
        """Two runs compared step by step (the JSON of ``GET /api/runs/{a}/diff/{b}``)."""
        result: dict[str, Any] = self.request("GET", f"/api/runs/{a}/diff/{b}")
        return result

    def tree(self, run_id: str) -> dict[str, Any]:
        """The tree of child runs the run belongs to, from its root down (the JSON of
        ``GET /api/runs/{id}/tree``: ``nodes`` depth first, each with its ``depth``)."""
        result: dict[str, Any] = self.request("GET", f"/api/runs/{run_id}/tree")
        return result

    # -- approvals ------------------------------------------------------------------------

    def approvals(self, *, status: str = "PENDING", role: str | None = None) -> list[Approval]:
        d = self.request("GET", "/api/approvals", query={"status": status, "role": role})
        return [Approval.from_json(a) for a in d["items"]]

    def approve(
        self, approval_id: str, *, comment: str | None = None, payload_hash: str | None = None
    ) -> Approval:
        """Approve (``payload_hash``: refused with :class:`Conflict` if the payload changed)."""
        return self._decide(approval_id, "approve", comment, payload_hash)

    def reject(
        self, approval_id: str, *, comment: str | None = None, payload_hash: str | None = None
    ) -> Approval:
        return self._decide(approval_id, "reject", comment, payload_hash)

    def _decide(
        self, approval_id: str, verb: str, comment: str | None, payload_hash: str | None
    ) -> Approval:
        body = {
            k: v for k, v in (("comment", comment), ("payloadHash", payload_hash)) if v is not None
        }
        return Approval.from_json(
            self.request("POST", f"/api/approvals/{approval_id}/{verb}", body)
        )


@dataclass(frozen=True, slots=True)
class Event:
    id: str
    name: str
    data: dict[str, Any] = field(default_factory=dict)


def parse_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Server-sent events from text lines (comments and ``retry:`` skipped)."""
    event_id, name = "", "message"
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield Event(event_id, name, json.loads("\n".join(data)))
            event_id, name, data = "", "message", []
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "id":
                event_id = value
            elif key == "event":
                name = value
            elif key == "data":
                data.append(value)
    if data:
        yield Event(event_id, name, json.loads("\n".join(data)))


def follow(
    base_url: str,
    run_id: str,
    *,
    token: str | None = None,
    last_event_id: str | None = None,
    reconnect_seconds: float = 1.0,
    timeout_seconds: float = 60.0,
) -> Iterator[Event]:
    """The run's events until ``run.finished``; a dropped connection is resumed after the
    last event received. HTTP errors (404, 400, 401, 403) raise ``urllib.error.HTTPError``."""
    url = f"{base_url.rstrip('/')}/api/runs/{run_id}/events"
    while True:
        headers = {"Accept": "text/event-stream"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_seconds) as resp:
                lines = (line.decode("utf-8") for line in resp)
                for event in parse_sse(lines):
                    last_event_id = event.id or last_event_id
                    yield event
                    if event.name == "run.finished":
                        return
        except urllib.error.HTTPError:
            raise
        except (OSError, ValueError):
            pass  # the connection dropped (a restart, a proxy): resume after the last event
        time.sleep(reconnect_seconds)
