"""Flow control: fleet-wide admission of model calls, by requests, tokens and concurrency.

On by default (DAR_FLOW_CONTROL=off turns it off), with nothing to configure: each model's
limits are learned from the API's ``anthropic-ratelimit-*`` headers, which every answer and
every 429 carries (the limit and what remains). Until a model's first answer its calls go
ahead; from then on they are paced at what the API grants. DAR_MODEL_LIMITS only adds limits
the API does not send (``maxConcurrent``) or tightens them (the lower of the configured and
the learned value applies).

Before a model call the worker asks :meth:`FlowControl.admit` for the call's estimated input
tokens and its ``max_tokens``; after the call :meth:`FlowControl.settle` returns what was not
used (or takes the excess). A refusal names the limit and a delay: the engine turns it into a
durable timer, so a waiting run holds no thread and no lease (invariant 8).

Why Redis and not PostgreSQL: admission is asked before every model call by every worker, it
is a read-modify-write of a few counters that must be atomic across the fleet, and it loses
nothing important when lost (a bucket refills in a minute). One Lua script per decision is
atomic in Redis by construction, costs one round trip, and keeps that hot write out of the
database that holds the truth. Losing Redis must not stop the fleet: every Redis error makes
admission *fail open* (the call goes ahead; the model client's retry path handles 429s as
before), with an error log line and ``dar_flow_fail_open_total``.

The buckets (one Redis hash per configured model limit) refill continuously at limit/60 per
second up to the limit. In-flight calls are members of a sorted set scored by their expiry
(now + the model timeout + a margin): a worker killed while it holds admission never leaks a
concurrency slot, its slot expires; the tokens it took are spent, and the bucket refills.
The caller's input estimate is deliberately high (3 characters a token); the bucket scales it
by the ratio of used to estimated input learned at each settle, so that waiters are paced at
what calls really take, not at 3/4 of the limit. Refused callers queue in a sorted set ordered
by priority, then arrival (the waiters of different concurrency keys interleaved): a call is
admitted only when its rank is below the number of calls that fit now, and each waiter is told
to come back when its turn should fit, so wake-ups are spread in priority order instead of
stampeding.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from db.records import Usage
from runtime.config import ConfigError
from runtime.observe.metrics import Metrics

if TYPE_CHECKING:  # redis is imported when a bucket is used: importing it pulls in ssl,
    # which must not happen in a gunicorn master before its gevent workers patch it
    import redis

log = logging.getLogger(__name__)

DIMENSIONS = ("requests", "input", "output")
LIMIT_NAMES = {
    "requests": "requests/min",
    "input": "input tokens/min",
    "output": "output tokens/min",
    "concurrent": "concurrent calls",
}
LEASE_MARGIN_SECONDS = 30.0
"""How long past the model timeout an in-flight call's concurrency slot lives unsettled."""
WAITER_GRACE_SECONDS = 10.0
"""How late a refused caller may come back and keep its place in the queue; while it is due
and not back, calls behind it wait for it."""


class FlowConfigError(ConfigError):
    """Invalid DAR_MODEL_LIMITS."""


@dataclass(frozen=True, slots=True)
class ModelLimit:
    """The limits of one model (``match`` exact) or model family (``match`` ending in ``*``).
    ``0`` means no limit of that kind."""

    match: str
    requests_per_minute: int = 0
    input_tokens_per_minute: int = 0
    output_tokens_per_minute: int = 0
    max_concurrent: int = 0

    def applies_to(self, model: str) -> bool:
        if self.match.endswith("*"):
            return model.startswith(self.match[:-1])
        return model == self.match


_FIELDS = {
    "requestsPerMinute": "requests_per_minute",
    "inputTokensPerMinute": "input_tokens_per_minute",
    "outputTokensPerMinute": "output_tokens_per_minute",
    "maxConcurrent": "max_concurrent",
}


def parse_model_limits(raw: str | None) -> tuple[ModelLimit, ...]:
    """``DAR_MODEL_LIMITS``: a JSON object from model (or ``prefix*``) to its limits, e.g.
    ``{"claude-sonnet-4*": {"requestsPerMinute": 50, "inputTokensPerMinute": 30000,
    "outputTokensPerMinute": 8000, "maxConcurrent": 20}}``."""
    if not raw or not raw.strip():
        return ()
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise FlowConfigError(f"DAR_MODEL_LIMITS is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise FlowConfigError("DAR_MODEL_LIMITS must be a JSON object: model -> limits")
    limits: list[ModelLimit] = []
    for match, spec in data.items():
        if not isinstance(spec, dict) or not match:
            raise FlowConfigError(
                f"DAR_MODEL_LIMITS[{match!r}] must be an object with {', '.join(_FIELDS)}"
            )
        unknown = sorted(set(spec) - set(_FIELDS))
        if unknown:
            raise FlowConfigError(
                f"DAR_MODEL_LIMITS[{match!r}]: unknown field(s) {', '.join(unknown)}; "
                f"known: {', '.join(_FIELDS)}"
            )
        values: dict[str, int] = {}
        for name, attr in _FIELDS.items():
            v = spec.get(name, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise FlowConfigError(
                    f"DAR_MODEL_LIMITS[{match!r}].{name} must be a whole number >= 0, got {v!r}"
                )
            values[attr] = v
        limits.append(ModelLimit(match, **values))
    return tuple(limits)


def limit_for(limits: Iterable[ModelLimit], model: str) -> ModelLimit | None:
    """The exact entry for ``model``, else the longest matching prefix."""
    best: ModelLimit | None = None
    for lim in limits:
        if not lim.applies_to(model):
            continue
        if not lim.match.endswith("*"):
            return lim
        if best is None or len(lim.match) > len(best.match):
            best = lim
    return best


@dataclass(frozen=True, slots=True)
class Grant:
    """Admission held by one call, until :meth:`FlowControl.settle`."""

    limit: ModelLimit
    lease: str
    input_tokens: int
    """Input tokens taken from the bucket: the caller's estimate scaled by the ratio of
    used to estimated tokens learned from earlier calls."""
    output_tokens: int
    estimated_input: int = 0
    """The caller's estimate, from which the ratio is learned at :meth:`FlowControl.settle`."""
    run: str = ""
    """The run whose call this is (``''``: none), for the lost-call record."""
    lost: Usage | None = None
    """The estimate of this run's previous call, admitted and never settled: lost with its
    worker (see :meth:`FlowControl.admit`)."""
    lost_step: tuple[str, int] | None = None
    """That call's step (key, lease epoch), when its admission named it: a step row of that
    key and epoch means the call was recorded after all (its worker died between the
    checkpoint and erasing the record), and the estimate must not be counted."""


@dataclass(frozen=True, slots=True)
class Answered:
    """A granted call that was answered, to be settled when its answer is recorded (one
    script then settles it and erases its record, see :meth:`FlowControl.settle`)."""

    grant: Grant
    input_tokens: int
    """Input tokens as the limits count them (cache reads do not count)."""
    output_tokens: int
    headers: tuple[tuple[str, str], ...] = ()
    """The response's ``anthropic-ratelimit-*`` headers."""


@dataclass(frozen=True, slots=True)
class Superseded:
    """Not admitted, and nothing changed: the run's record holds a call of a newer claim
    (a later lease epoch) than the caller's. The caller was taken over while it was away
    (stopped past its lease): the call in flight is its new holder's, not a lost one, and
    the caller must not call the model (its writes will be refused)."""

    epoch: int
    """The newer claim's lease epoch."""


@dataclass(frozen=True, slots=True)
class Refusal:
    limit: str
    """Which limit refused: ``requests``, ``input``, ``output`` or ``concurrent``."""
    delay_seconds: float
    model: str
    lost: Usage | None = None
    """As :attr:`Grant.lost`."""
    lost_step: tuple[str, int] | None = None
    """As :attr:`Grant.lost_step`."""

    @property
    def reason(self) -> str:
        return f"rate limit: {LIMIT_NAMES[self.limit]} for {self.model}"


# KEYS: 1 bucket hash, 2 in-flight zset, 3 waiters zset, 4 waiters' deadlines zset, 5 the
# concurrency keys' virtual clocks (hash)
# ARGV: 1-3 configured limits (requests, input, output per minute; 0 = none), 4 max
# concurrent, 5-6 cost (input, output), 7 lease id, 8 lease ttl s, 9 waiter id, 10 waiter
# priority, 11 waiter grace s, 12 the waiter's concurrency key ('' for none), 13 the spacing
# in ms between one key's waiters, 14 the run ('' for none), 15 the call's estimate
# ('input:output' tokens, then ':epoch:step key' when the caller names its step), 16 how long
# a 'charged:' marker is kept (s). KEYS 6: the runs' calls in flight (hash run -> 'lease:' ..
# ARGV 15, and 'charged:' .. lease -> the estimate counted as lost, for that call's settle),
# 7: when each 'charged:' marker is erased (zset lease -> time).
#
# A new waiter's score is -priority * 1e13 + its arrival in ms. A keyed waiter arrives, in
# this order, no earlier than its key's virtual clock, which each waiter of the key pushes
# one spacing further: the waiters of a key that queued 200 calls at once are spread out, and
# a key arriving later slots in between them (round-robin across keys, Zhang's VirtualClock).
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local stale = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[11]))
for _, w in ipairs(stale) do redis.call('ZREM', KEYS[3], w); redis.call('ZREM', KEYS[4], w) end
-- this run's previous call, admitted and never settled: lost with its worker; hand its
-- estimate to the caller once, and note it as charged for a settle that comes after all
local lost = ''
if ARGV[14] ~= '' then
  local prev = redis.call('HGET', KEYS[6], ARGV[14])
  -- a call of a newer claim of the run is in flight: the caller was taken over while it
  -- was away (stopped, paused), so that call is not lost: touch nothing, say so
  local theirs = prev and tonumber(string.match(prev, '^[^:]*:[^:]*:[^:]*:(%d+):') or '')
  local ours = tonumber(string.match(ARGV[15], '^[^:]*:[^:]*:(%d+):') or '')
  if theirs and ours and theirs > ours then
    return {0, 'superseded', tostring(theirs), '', ''}
  end
  if prev then
    lost = prev
    redis.call('HDEL', KEYS[6], ARGV[14])
    local sep = string.find(prev, ':', 1, true)
    local lease = string.sub(prev, 1, sep - 1)
    redis.call('HSET', KEYS[6], 'charged:' .. lease, string.sub(prev, sep + 1))
    -- the marker waits for a settle that never comes when the call's worker is dead (the
    -- usual case): markers past their time (ARGV 16 s) are erased as a new one is made
    for _, old in ipairs(redis.call('ZRANGEBYSCORE', KEYS[7], '-inf', now)) do
      redis.call('HDEL', KEYS[6], 'charged:' .. old)
    end
    redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', now)
    redis.call('ZADD', KEYS[7], now + tonumber(ARGV[16]), lease)
    redis.call('EXPIRE', KEYS[7], math.ceil(tonumber(ARGV[16])) + 60)
  end
end
local dims = {'requests', 'input', 'output'}
local cost = {1, tonumber(ARGV[5]), tonumber(ARGV[6])}
-- the caller's input estimate is deliberately high: scale it by what calls really used
local ratio = tonumber(redis.call('HGET', KEYS[1], 'ratio:input') or '1')
cost[2] = math.ceil(cost[2] * ratio)
local caps, levels = {}, {}
local last = tonumber(redis.call('HGET', KEYS[1], 'ts') or now)
local fits = 1e18
local binding = ''
for i, d in ipairs(dims) do
  local cap = tonumber(ARGV[i])
  local learned = tonumber(redis.call('HGET', KEYS[1], 'cap:' .. d) or '0')
  if learned > 0 and (cap == 0 or learned < cap) then cap = learned end
  caps[i] = cap
  if cap > 0 then
    local level = tonumber(redis.call('HGET', KEYS[1], 'lvl:' .. d) or cap)
    level = math.min(cap, level + (now - last) * cap / 60)
    levels[i] = level
    if cost[i] > cap then cost[i] = cap end
    local n = 1e18
    if cost[i] > 0 then n = math.floor(level / cost[i]) end
    if level < 0 then n = 0 end
    if n < fits then fits = n; binding = d end
  end
end
local maxc = tonumber(ARGV[4])
if maxc > 0 then
  local free = maxc - redis.call('ZCARD', KEYS[2])
  if free < fits then fits = math.max(free, 0); binding = 'concurrent' end
end
local score = redis.call('ZSCORE', KEYS[3], ARGV[9])
local arrival = nil
local rank
if score then
  rank = redis.call('ZRANK', KEYS[3], ARGV[9])
else
  arrival = now * 1000
  if ARGV[12] ~= '' then
    local vc = tonumber(redis.call('HGET', KEYS[5], ARGV[12]) or '0')
    if vc > arrival then arrival = vc end
  end
  score = -tonumber(ARGV[10]) * 1e13 + arrival
  rank = redis.call('ZCOUNT', KEYS[3], '-inf', '(' .. score)
end
-- Only waiters ahead that are due back by now hold their place; one not yet due does not
-- block capacity that is free now.
local ahead = 0
if rank > 0 then
  for _, w in ipairs(redis.call('ZRANGE', KEYS[3], 0, math.min(rank, 2000) - 1)) do
    if tonumber(redis.call('ZSCORE', KEYS[4], w) or '0') <= now + 0.5 then ahead = ahead + 1 end
  end
end
if ahead < fits then
  for i, d in ipairs(dims) do
    if caps[i] > 0 then redis.call('HSET', KEYS[1], 'lvl:' .. d, levels[i] - cost[i]) end
  end
  redis.call('HSET', KEYS[1], 'ts', now)
  redis.call('EXPIRE', KEYS[1], 3600)
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[8]), ARGV[7])
  redis.call('EXPIRE', KEYS[2], 3600)
  redis.call('ZREM', KEYS[3], ARGV[9]); redis.call('ZREM', KEYS[4], ARGV[9])
  if ARGV[14] ~= '' then
    redis.call('HSET', KEYS[6], ARGV[14], ARGV[7] .. ':' .. ARGV[15])
    redis.call('EXPIRE', KEYS[6], 3600)
  end
  return {1, '', '0', tostring(cost[2]), lost}
end
local wait, why = 0, binding
for i, d in ipairs(dims) do
  if caps[i] > 0 and cost[i] > 0 then
    local w = (cost[i] * (rank + 1) - levels[i]) / (caps[i] / 60)
    if w > wait then wait = w; why = d end
  end
end
if binding == 'concurrent' and wait < 1 then wait = 1 + (rank - fits) * 0.25; why = 'concurrent' end
if wait < 0.05 then wait = 0.05 end
redis.call('HSET', KEYS[1], 'ts', now)
for i, d in ipairs(dims) do
  if caps[i] > 0 then redis.call('HSET', KEYS[1], 'lvl:' .. d, levels[i]) end
end
redis.call('EXPIRE', KEYS[1], 3600)
redis.call('ZADD', KEYS[3], 'NX', score, ARGV[9])
if arrival and ARGV[12] ~= '' then
  redis.call('HSET', KEYS[5], ARGV[12], arrival + tonumber(ARGV[13]))
  redis.call('EXPIRE', KEYS[5], 3600)
end
redis.call('ZADD', KEYS[4], now + wait, ARGV[9])
redis.call('EXPIRE', KEYS[3], 3600); redis.call('EXPIRE', KEYS[4], 3600)
return {0, why, tostring(wait), '', lost}
"""

# KEYS: 1 bucket hash, 2 in-flight zset, 3 the runs' calls in flight. ARGV: 1-3 configured
# limits, 4-6 refund (requests, input, output; negative takes more), 7 lease id, 8 the
# caller's input estimate (0: not billed, learn nothing), 9 the input tokens the call used,
# 10 the run ('' for none), 11 '1': keep the run's call record (answered: the checkpoint, not
# the settle, erases it, see FlowControl.forget).
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREM', KEYS[2], ARGV[7])
local last = tonumber(redis.call('HGET', KEYS[1], 'ts') or now)
for i, d in ipairs({'requests', 'input', 'output'}) do
  local cap = tonumber(ARGV[i])
  local learned = tonumber(redis.call('HGET', KEYS[1], 'cap:' .. d) or '0')
  if learned > 0 and (cap == 0 or learned < cap) then cap = learned end
  if cap > 0 then
    local level = tonumber(redis.call('HGET', KEYS[1], 'lvl:' .. d) or cap)
    level = math.min(cap, level + (now - last) * cap / 60 + tonumber(ARGV[3 + i]))
    redis.call('HSET', KEYS[1], 'lvl:' .. d, level)
  end
end
redis.call('HSET', KEYS[1], 'ts', now)
local est = tonumber(ARGV[8])
if est > 0 then
  local r = tonumber(redis.call('HGET', KEYS[1], 'ratio:input') or '1')
  r = 0.7 * r + 0.3 * tonumber(ARGV[9]) / est
  redis.call('HSET', KEYS[1], 'ratio:input', math.max(0.2, math.min(2.0, r)))
end
-- the call is settled: drop its record, and say whether a later admission already charged
-- its estimate as lost (this worker was fenced out, not dead)
local charged = ''
if ARGV[10] ~= '' then
  local cur = redis.call('HGET', KEYS[3], ARGV[10])
  if ARGV[11] ~= '1' and cur and string.sub(cur, 1, #ARGV[7] + 1) == ARGV[7] .. ':' then
    redis.call('HDEL', KEYS[3], ARGV[10])
  end
  charged = redis.call('HGET', KEYS[3], 'charged:' .. ARGV[7]) or ''
  if charged ~= '' then redis.call('HDEL', KEYS[3], 'charged:' .. ARGV[7]) end
end
return charged
"""

# KEYS: 1 bucket hash. ARGV: (dimension, limit, remaining) triples, as read from headers.
_LEARN = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local last = tonumber(redis.call('HGET', KEYS[1], 'ts') or now)
for i = 1, #ARGV, 3 do
  local d, cap, rem = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local old = tonumber(redis.call('HGET', KEYS[1], 'cap:' .. d) or '0')
  redis.call('HSET', KEYS[1], 'cap:' .. d, cap)
  local level = tonumber(redis.call('HGET', KEYS[1], 'lvl:' .. d) or cap)
  local c = cap
  if old > 0 and old < c then c = old end
  level = math.min(c, level + (now - last) * c / 60)
  if rem < level then level = rem end
  redis.call('HSET', KEYS[1], 'lvl:' .. d, level)
end
redis.call('HSET', KEYS[1], 'ts', now)
redis.call('EXPIRE', KEYS[1], 3600)
return 1
"""

# KEYS: 1 the runs' calls in flight. ARGV: 1 run, 2 lease: erase the run's record if it is
# still this lease's; return (and drop) the estimate a later admission counted as lost, if
# one took the record first.
_FORGET = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.sub(cur, 1, #ARGV[2] + 1) == ARGV[2] .. ':' then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local charged = redis.call('HGET', KEYS[1], 'charged:' .. ARGV[2]) or ''
if charged ~= '' then redis.call('HDEL', KEYS[1], 'charged:' .. ARGV[2]) end
return charged
"""

_HEADER_DIMS = {
    "requests": "requests",
    "input-tokens": "input",
    "output-tokens": "output",
}


def learned_limits(headers: Mapping[str, str] | Iterable[tuple[str, str]]) -> list[str]:
    """``(dimension, limit, remaining)`` triples, flattened, from the API's
    ``anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining}``."""
    h = {k.lower(): v for k, v in (headers.items() if isinstance(headers, Mapping) else headers)}
    out: list[str] = []
    for name, dim in _HEADER_DIMS.items():
        limit = h.get(f"anthropic-ratelimit-{name}-limit")
        remaining = h.get(f"anthropic-ratelimit-{name}-remaining")
        if limit is None or remaining is None:
            continue
        try:
            lim, rem = int(limit), int(remaining)
        except ValueError:
            continue
        if lim > 0:
            out += [dim, str(lim), str(max(0, rem))]
    return out


class FailOpenAlarm:
    """Redis is away and a limit is let go: each time is counted
    (``dar_flow_fail_open_total{action}``), and logged loudly, but at most once every 10 s,
    not a line per model call or step."""

    def __init__(self, metrics: Metrics | None, event: str, what: str) -> None:
        self.metrics = metrics
        self.event = event
        self.what = what
        self._last = 0.0

    def __call__(self, action: str, e: Exception) -> None:
        if self.metrics is not None:
            self.metrics.flow_fail_open.labels(action).inc()
        now = time.monotonic()
        if now - self._last >= 10.0:
            self._last = now
            log.error(
                "%s (%s: %s)",
                self.what,
                type(e).__name__,
                e,
                extra={"event": self.event, "action": action},
            )


CHARGED_MARKER_SECONDS = 3600.0
"""How long the note that a call's estimate was counted as lost is kept for that call's own
settle (its worker was fenced out, not dead, and may still answer; the settle then takes the
estimate back). When its worker is dead the settle never comes: the note is erased after this
long, as the next one is made."""


class FlowControl:
    """Admission against fleet-wide model limits held in Redis (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        limits: tuple[ModelLimit, ...],
        *,
        lease_seconds: float,
        metrics: Metrics | None = None,
        prefix: str = "dar:flow",
        charged_marker_seconds: float = CHARGED_MARKER_SECONDS,
    ) -> None:
        self.client = client
        self.limits = limits
        self.lease_seconds = lease_seconds
        self.charged_marker_seconds = charged_marker_seconds
        self.metrics = metrics
        self.prefix = prefix
        self._admit = client.register_script(_ADMIT)
        self._settle = client.register_script(_SETTLE)
        self._learn = client.register_script(_LEARN)
        self._forget = client.register_script(_FORGET)
        self._fail_open = FailOpenAlarm(
            metrics,
            "flow.fail_open",
            "flow control unavailable: model calls go ahead unadmitted and rely on retries "
            "of 429s until Redis is back",
        )

    def limit(self, model: str) -> ModelLimit:
        """The configured limit of ``model`` (DAR_MODEL_LIMITS), else one of its own with no
        configured value: its bucket holds only what the API's headers taught it."""
        return limit_for(self.limits, model) or ModelLimit(model)

    def _keys(self, limit: ModelLimit) -> list[str]:
        base = f"{self.prefix}:{{{limit.match}}}"
        return [
            f"{base}:bucket",
            f"{base}:inflight",
            f"{base}:waiters",
            f"{base}:due",
            f"{base}:vclock",
            f"{base}:calls",
            f"{base}:charged",
        ]

    def admit(
        self,
        model: str,
        input_tokens: int,
        max_tokens: int,
        *,
        waiter: str,
        priority: int = 0,
        key: str | None = None,
        run: str = "",
        step: tuple[str, int] | None = None,
        estimate: Usage | None = None,
    ) -> Grant | Refusal | Superseded | None:
        """A :class:`Grant` to hold until :meth:`settle`, a :class:`Refusal` (come back
        after its delay), :class:`Superseded` (a newer claim of the run has a call in
        flight), or ``None``: Redis is unreachable (fail open). A model with no
        configured limit is admitted at once until the API's headers taught its limits. Refused
        callers queue by ``priority`` (higher first), then arrival; the callers of each
        concurrency ``key`` are interleaved with other keys' round-robin.

        With ``run``, a granted call is written down (its lease and estimate: ``estimate``,
        by default ``input_tokens`` in and ``max_tokens`` out) until :meth:`settle`; the
        next admission of that run finds a record never settled (its worker died in the
        call) and returns it once as ``lost``: the API billed that call, and nobody recorded
        it. ``step`` (key, lease epoch) names the call's step in the record, returned as
        ``lost_step``: the next admission can tell a call recorded after all (a step row of
        that key and epoch) from one lost."""
        limit = self.limit(model)
        lease = uuid.uuid4().hex
        # one key's waiters are spaced by about one request's share of the limit
        spacing = 60_000 / limit.requests_per_minute if limit.requests_per_minute else 250.0
        try:
            ok, why, wait, charged, lost = self._admit(
                keys=self._keys(limit),
                args=[
                    limit.requests_per_minute,
                    limit.input_tokens_per_minute,
                    limit.output_tokens_per_minute,
                    limit.max_concurrent,
                    input_tokens,
                    max_tokens,
                    lease,
                    self.lease_seconds,
                    waiter,
                    priority,
                    WAITER_GRACE_SECONDS,
                    key or "",
                    spacing,
                    run,
                    (
                        f"{input_tokens}:{max_tokens}"
                        if estimate is None
                        else f"{estimate.input_tokens}:{estimate.output_tokens}"
                    )
                    + (f":{step[1]}:{step[0]}" if step is not None else ""),
                    self.charged_marker_seconds,
                ],
            )
        except _redis_error() as e:
            self._fail_open("admit", e)
            return None
        if int(ok):
            if self.metrics is not None:
                self.metrics.flow_admitted.labels(model).inc()
                self.metrics.flow_granted.labels(model, "input").inc(input_tokens)
                self.metrics.flow_granted.labels(model, "output").inc(max_tokens)
            taken = int(charged) if charged else input_tokens
            return Grant(
                limit,
                lease,
                taken,
                max_tokens,
                estimated_input=input_tokens,
                run=run,
                lost=_estimate(lost, with_lease=True),
                lost_step=_step(lost),
            )
        dim = why.decode() if isinstance(why, bytes) else str(why)
        if dim == "superseded":
            return Superseded(int(float(wait)))
        if self.metrics is not None:
            self.metrics.flow_refused.labels(model, dim).inc()
        return Refusal(
            dim or "requests",
            float(wait),
            model,
            _estimate(lost, with_lease=True),
            _step(lost),
        )

    def settle(
        self,
        grant: Grant,
        input_tokens: int,
        output_tokens: int,
        *,
        headers: Iterable[tuple[str, str]] = (),
        billed: bool = True,
        keep_record: bool = False,
    ) -> Usage | None:
        """The call is over: free its concurrency slot and give back what it did not use
        (``billed`` false: the API refused it, so give back all tokens but not the request).
        Headers from the API (``anthropic-ratelimit-*``) correct the buckets. Returns the
        estimate a later admission of the run already counted as lost (this worker was
        fenced out mid-call, not dead), else ``None``."""
        lim = grant.limit
        keys = self._keys(lim)
        used_in = input_tokens if billed else 0
        used_out = output_tokens if billed else 0
        charged: Usage | None = None
        try:
            raw = self._settle(
                keys=[keys[0], keys[1], keys[5]],
                args=[
                    lim.requests_per_minute,
                    lim.input_tokens_per_minute,
                    lim.output_tokens_per_minute,
                    0,
                    grant.input_tokens - used_in,
                    grant.output_tokens - used_out,
                    grant.lease,
                    grant.estimated_input if billed else 0,
                    used_in,
                    grant.run,
                    "1" if keep_record else "0",
                ],
            )
            charged = _estimate(raw, with_lease=False)
            learned = learned_limits(headers)
            if learned:
                self._learn(keys=keys[:1], args=learned)
        except _redis_error() as e:
            self._fail_open("settle", e)
        return charged

    def forget(self, grant: Grant) -> Usage | None:
        """The answered call of ``grant`` is recorded (its checkpoint, or the run's
        unrecorded tokens): erase its record, so no later admission counts it as lost.
        Returns the estimate a later admission took from the record and counted as lost
        before this (the caller's exact count must replace it), else ``None``."""
        if not grant.run:
            return None
        try:
            raw = self._forget(keys=[self._keys(grant.limit)[5]], args=[grant.run, grant.lease])
        except _redis_error() as e:
            self._fail_open("forget", e)
            return None
        return _estimate(raw, with_lease=False)

    def in_flight(self, model: str) -> int:
        """Calls holding admission now (expired slots excluded)."""
        limit = self.limit(model)
        now = self.client.time()
        return int(self.client.zcount(self._keys(limit)[1], now[0] + now[1] / 1e6, "+inf"))

    def level(self, model: str, dim: str) -> float | None:
        """The bucket's stored level for ``dim`` (not refilled to now), for tests and tools."""
        limit = self.limit(model)
        raw = self.client.hget(self._keys(limit)[0], f"lvl:{dim}")
        return None if raw is None else float(raw)


def _fields(raw: object, *, with_lease: bool) -> list[str]:
    """``[lease:]input:output[:epoch:step key]`` as written by the admit script (a step key
    may hold colons itself: it comes last)."""
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    if with_lease:
        text = text.partition(":")[2]
    return text.split(":", 3) if text else []


def _estimate(raw: object, *, with_lease: bool) -> Usage | None:
    """The estimate (input and output tokens) of a call record, or ``None``."""
    parts = _fields(raw, with_lease=with_lease)
    if len(parts) not in (2, 4):
        return None
    try:
        return Usage(input_tokens=int(parts[0]), output_tokens=int(parts[1]))
    except ValueError:
        return None


def _step(raw: object) -> tuple[str, int] | None:
    """The step (key, lease epoch) a call record names, or ``None``."""
    parts = _fields(raw, with_lease=True)
    if len(parts) != 4:
        return None
    try:
        return parts[3], int(parts[2])
    except ValueError:
        return None


def _redis_error() -> type[Exception]:
    import redis

    return redis.RedisError
