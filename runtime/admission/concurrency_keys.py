"""Concurrency keys: at most N runs of one key (a tenant, a customer, a repository) inside a
step at once, fleet-wide.

Before a keyed run's step the driver asks :meth:`KeyGate.acquire` for a slot of its key; after
the step (checkpoint, timer or end) it gives it back with :meth:`KeyGate.release`. A run whose
key is full holds nothing: the driver parks it on a durable timer (``waitReason``
``concurrency key <k>: N of N in steps``) and the run releasing a slot wakes the first waiter
still parked by sending its message at once (one cancelled or ended meanwhile is dropped from
the queue, and the next woken instead); the timer is only the fallback for a wake that was
lost. A holder whose next step follows at once keeps its place in line between its steps.

Why Redis and not PostgreSQL, like the model buckets of :mod:`runtime.admission.flow_control`: the
slot is asked for before *every* step of a keyed run, by every worker, and must be atomic across
the fleet; one Lua script per decision is atomic by construction and costs one round trip, where
PostgreSQL would need a lock on the key and a write per step on the hot path of the database
that holds the truth. A slot holds nothing important: losing it must not lose a run.

- **Killed holders never leak a slot.** A slot is a member of a sorted set scored by its
  expiry, one lease (DAR_LEASE_SECONDS) ahead, renewed by the worker's heartbeat with the
  run's lease (:meth:`renew`). A worker killed inside a step stops renewing; its slot
  lapses with its lease, exactly when another worker may take the run over.
- **Order.** Waiters queue per key by priority (higher first), then submission time: within
  a key the oldest runs go on first, so a key's N slots carry N runs to their end instead of
  advancing every run a step at a time.
- **Fairness across keys** comes from the per-key cap itself (a busy key never holds more
  than its N workers, however many runs it queued), and from the model buckets' waiter
  queue, which interleaves keys round-robin (:mod:`runtime.admission.flow_control`).
- **Losing Redis fails open**: the step goes ahead, with an error log line and
  ``dar_flow_fail_open_total{action="key"}``; the key cap is lost until Redis is back,
  nothing else.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runtime.admission.flow_control import FailOpenAlarm
from runtime.config import ConfigError
from runtime.observe.metrics import Metrics

if TYPE_CHECKING:  # redis is imported when a gate is built (see runtime.admission.flow_control)
    import redis

log = logging.getLogger(__name__)

MAX_KEY_CHARS = 200
"""The longest concurrencyKey a submit may carry."""
PRIORITY_RANGE = (-1000, 1000)
"""The priorities a submit may carry (higher first)."""
WAKE_GRACE_SECONDS = 10.0
"""How long a woken waiter keeps its place ahead of newcomers before it is presumed lost."""


class KeyConfigError(ConfigError):
    """Invalid DAR_KEY_CONCURRENCY or DAR_KEY_CONCURRENCY_OVERRIDES."""


def parse_key_overrides(raw: str | None) -> dict[str, int]:
    """``DAR_KEY_CONCURRENCY_OVERRIDES``: a JSON object from key to its limit,
    e.g. ``{"tenant-big": 20, "batch": 1}``; ``0`` means no limit for that key."""
    if not raw or not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise KeyConfigError(f"DAR_KEY_CONCURRENCY_OVERRIDES is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise KeyConfigError("DAR_KEY_CONCURRENCY_OVERRIDES must be a JSON object: key -> limit")
    out: dict[str, int] = {}
    for key, n in data.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise KeyConfigError(
                f"DAR_KEY_CONCURRENCY_OVERRIDES[{key!r}] must be a whole number >= 0 "
                f"(0: no limit), got {n!r}"
            )
        out[key] = n
    return out


def tenant_key(tenant: str, key: str) -> str:
    """The name a run's concurrency key has in Redis, in the flow-control queues and in
    overrides: scoped by its tenant (``tenant/key``), so tenants sharing a key's name share
    nothing, neither slots nor waiters nor what a wait reason reports. Tenant names hold no
    ``/`` (:data:`api.auth.NAME`); with authentication off the tenant is ``""`` and the key
    is its own name."""
    return f"{tenant}/{key}" if tenant else key


def waiter_score(priority: int, submitted_at: float) -> float:
    """Higher priority first, then the earlier submitted: a run keeps its place in the queue
    across its steps and its waits."""
    return -priority * 1e13 + submitted_at * 1000


@dataclass(frozen=True, slots=True)
class Slot:
    """A slot of ``key`` held by one run's step, until :meth:`KeyGate.release`."""

    key: str
    holder: str
    score: float


@dataclass(frozen=True, slots=True)
class KeyWait:
    key: str
    limit: int
    in_steps: int
    delay_seconds: float
    woken_ahead: int = 0
    """Runs already woken for the slots free now, ahead of this one."""
    label: str = ""
    """The key as the run named it (``key`` is scoped by tenant: :func:`tenant_key`)."""

    @property
    def reason(self) -> str:
        name = self.label or self.key
        reason = f"concurrency key {name}: {self.in_steps} of {self.limit} in steps"
        if self.in_steps < self.limit:
            reason += f", {self.woken_ahead} woken runs ahead"
        return reason


# KEYS: 1 held zset, 2 waiters zset, 3 waiters' due zset
# ARGV: 1 limit, 2 holder (run:epoch, one per claim), 3 ttl s, 4 score, 5 wake grace s,
# 6 fallback wait s, 7 waiter (the run id)
_ACQUIRE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local stale = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now - tonumber(ARGV[5]))
for _, w in ipairs(stale) do redis.call('ZREM', KEYS[2], w); redis.call('ZREM', KEYS[3], w) end
local limit = tonumber(ARGV[1])
local held = redis.call('ZCARD', KEYS[1])
local mine = redis.call('ZSCORE', KEYS[1], ARGV[2])
local ok = mine ~= false
if not ok and held < limit then
  -- woken waiters ahead of this caller (by score) keep their place
  local ahead = 0
  local free = limit - held
  local before = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[4], 'LIMIT', 0, 500)
  for _, w in ipairs(before) do
    if w ~= ARGV[7] and tonumber(redis.call('ZSCORE', KEYS[3], w) or '0') <= now + 0.5 then
      ahead = ahead + 1
    end
  end
  ok = ahead < free
  if not ok then
    redis.call('ZADD', KEYS[2], tonumber(ARGV[4]), ARGV[7])
    redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[7])
    return {0, held, ahead}
  end
end
if ok then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
  redis.call('EXPIRE', KEYS[1], 86400)
  redis.call('ZREM', KEYS[2], ARGV[7]); redis.call('ZREM', KEYS[3], ARGV[7])
  return {1, redis.call('ZCARD', KEYS[1]), 0}
end
redis.call('ZADD', KEYS[2], tonumber(ARGV[4]), ARGV[7])
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[7])
redis.call('EXPIRE', KEYS[2], 86400); redis.call('EXPIRE', KEYS[3], 86400)
return {0, held, 0}
"""

# The next waiter to wake for a slot just freed, or '' (a Lua fragment of _RELEASE and _SKIP).
# KEYS: 1 held zset, 2 waiters zset, 3 waiters' due zset; `me`: the releasing holder's run id
# when its next step follows at once (it then waits in line itself, woken), else ''.
_NEXT = """
local function next_waiter(now, grace, me)
  for _, w in ipairs(redis.call('ZRANGE', KEYS[2], 0, 20)) do
    if w == me then
      return ''  -- the holder is first in line and comes back for its next step itself
    end
    local due = tonumber(redis.call('ZSCORE', KEYS[3], w) or '0')
    -- one already woken (due now, within its grace) is on its way: wake the next
    if due > now + 0.5 or due < now - grace then
      redis.call('ZADD', KEYS[3], now, w)
      return w
    end
  end
  return ''
end
"""

# KEYS: 1 held zset, 2 waiters zset, 3 waiters' due zset
# ARGV: 1 holder, 2 its score, 3 continuing (1: the holder's next step follows at once),
# 4 wake grace s, 5 the holder's run id
# Returns the waiter woken (due now, its place kept for the grace), or ''.
_RELEASE = (
    _NEXT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREM', KEYS[1], ARGV[1])
local me = ''
if ARGV[3] == '1' then
  -- The holder keeps its place in line, as a woken waiter: a newcomer behind it cannot take
  -- the slot before its next step comes back for it.
  me = ARGV[5]
  redis.call('ZADD', KEYS[2], tonumber(ARGV[2]), me)
  redis.call('ZADD', KEYS[3], now, me)
  redis.call('EXPIRE', KEYS[2], 86400); redis.call('EXPIRE', KEYS[3], 86400)
end
return next_waiter(now, tonumber(ARGV[4]), me)
"""
)

# KEYS: as _RELEASE; ARGV: 1 the woken waiter that is not parked any more (cancelled, ended,
# or already claimed), 2 wake grace s, 3 the releasing holder's run id if it continues, or ''
# Drops the waiter from the queue; returns the next one woken instead, or ''.
_SKIP = (
    _NEXT
    + """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
redis.call('ZREM', KEYS[2], ARGV[1]); redis.call('ZREM', KEYS[3], ARGV[1])
return next_waiter(now, tonumber(ARGV[2]), ARGV[3])
"""
)

# KEYS: as _RELEASE; ARGV: 1 the waiter's run id
# 1: it is in the key's queue, not woken; 0: woken, or dropped from the queue meanwhile.
_WAITING = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local due = redis.call('ZSCORE', KEYS[3], ARGV[1])
if due == false or redis.call('ZSCORE', KEYS[2], ARGV[1]) == false then return 0 end
if tonumber(due) <= now + 0.5 then return 0 end
return 1
"""

# KEYS: held zsets; ARGV: 1 ttl s, then one holder per key
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
for i, k in ipairs(KEYS) do redis.call('ZADD', k, 'XX', now + tonumber(ARGV[1]), ARGV[i + 1]) end
return 1
"""


class KeyGate:
    """Per-key slots held in Redis (see the module docstring)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        default_limit: int,
        overrides: Mapping[str, int],
        lease_seconds: float,
        fallback_seconds: float = 30.0,
        metrics: Metrics | None = None,
        prefix: str = "dar:keys",
    ) -> None:
        self.client = client
        self.default_limit = default_limit
        self.overrides = dict(overrides)
        self.lease_seconds = lease_seconds
        self.fallback_seconds = fallback_seconds
        self.metrics = metrics
        self.prefix = prefix
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(_RELEASE)
        self._skip = client.register_script(_SKIP)
        self._renew = client.register_script(_RENEW)
        self._waiting = client.register_script(_WAITING)
        self._held: dict[str, Slot] = {}
        self._fail_open = FailOpenAlarm(
            metrics,
            "keys.fail_open",
            "concurrency keys unavailable: steps go ahead without a key slot until Redis is back",
        )

    def limit(self, key: str, label: str | None = None) -> int:
        """The key's limit; ``0``: none. An override may name the scoped key (``tenant/key``,
        one tenant's) or the key as runs name it (``label``: that name in every tenant)."""
        if key in self.overrides:
            return self.overrides[key]
        return self.overrides.get(label if label is not None else key, self.default_limit)

    def _keys(self, key: str) -> list[str]:
        base = f"{self.prefix}:{{{key}}}"
        return [f"{base}:held", f"{base}:waiters", f"{base}:due"]

    def acquire(
        self,
        key: str,
        run_id: uuid.UUID,
        epoch: int,
        *,
        priority: int,
        submitted_at: float,
        label: str | None = None,
    ) -> Slot | KeyWait | None:
        """A :class:`Slot` to give back with :meth:`release`, a :class:`KeyWait` (the key is
        full: wait for a wake, or the fallback timer), or ``None``: the key has no limit, or
        Redis is unreachable (fail open). ``key`` is scoped (:func:`tenant_key`); ``label``
        is the name the run gave it, for the wait reason and overrides."""
        limit = self.limit(key, label)
        if limit <= 0:
            return None
        score = waiter_score(priority, submitted_at)
        who = f"{run_id}:{epoch}"
        try:
            ok, n, ahead = self._acquire(
                keys=self._keys(key),
                args=[
                    limit,
                    who,
                    self.lease_seconds,
                    score,
                    WAKE_GRACE_SECONDS,
                    self.fallback_seconds,
                    str(run_id),
                ],
            )
        except _redis_error() as e:
            self._fail_open("key", e)
            return None
        if int(ok):
            slot = Slot(key, who, score)
            self._held[who] = slot
            return slot
        if self.metrics is not None:
            self.metrics.key_refused.inc()
        return KeyWait(key, limit, int(n), self.fallback_seconds, int(ahead), label or "")

    def release(self, slot: Slot, *, continuing: bool) -> uuid.UUID | None:
        """Give the slot back; returns the waiter to wake now (send its message), if any.
        ``continuing``: the holder's next step follows at once; it keeps its place in line
        (a newcomer behind it cannot take the slot meanwhile), and a waiter behind it is not
        woken only to find the slot taken again."""
        self._held.pop(slot.holder, None)
        try:
            woken = self._release(
                keys=self._keys(slot.key),
                args=[
                    slot.holder,
                    slot.score,
                    "1" if continuing else "0",
                    WAKE_GRACE_SECONDS,
                    _run_of(slot),
                ],
            )
        except _redis_error() as e:
            self._fail_open("key", e)
            return None
        return _waiter(woken)

    def skip(self, slot: Slot, woken: uuid.UUID, *, continuing: bool) -> uuid.UUID | None:
        """``woken`` (returned by :meth:`release` of ``slot``) is not parked any more: it was
        cancelled, ended, or is already on its way. Drop it from the key's queue and return
        the next waiter to wake instead, if any, so the freed slot does not sit empty until
        the next waiter's fallback timer."""
        try:
            got = self._skip(
                keys=self._keys(slot.key),
                args=[str(woken), WAKE_GRACE_SECONDS, _run_of(slot) if continuing else ""],
            )
        except _redis_error() as e:
            self._fail_open("key", e)
            return None
        return _waiter(got)

    def still_waiting(self, key: str, run_id: uuid.UUID) -> bool:
        """Whether ``run_id``, refused a slot of ``key``, is still in the key's queue and
        not woken. ``False`` when a slot freed after its refusal and its release could not
        wake it, because it was not parked yet (it still held its lease): the run must then
        wake itself once parked. Redis away: ``True`` (the fallback timer stands)."""
        try:
            return bool(int(self._waiting(keys=self._keys(key), args=[str(run_id)])))
        except _redis_error() as e:
            self._fail_open("key", e)
            return True

    def renew(self) -> None:
        """Extend every slot this process holds by one lease (from the heartbeat)."""
        by_key: dict[str, list[str]] = {}
        for slot in list(self._held.values()):
            by_key.setdefault(slot.key, []).append(slot.holder)
        # One call per key: every key of one script call is in one hash slot (Redis Cluster
        # refuses a script whose keys are not: CROSSSLOT).
        for key, holders in by_key.items():
            try:
                self._renew(
                    keys=[self._keys(key)[0]] * len(holders), args=[self.lease_seconds, *holders]
                )
            except _redis_error() as e:
                self._fail_open("key", e)
                return

    def in_steps(self, key: str) -> int:
        """Slots of ``key`` held now (lapsed ones excluded), for tests and tools."""
        now = self.client.time()
        return int(self.client.zcount(self._keys(key)[0], now[0] + now[1] / 1e6, "+inf"))


def _run_of(slot: Slot) -> str:
    """The run id of a slot's holder (``run:epoch``)."""
    return slot.holder.rsplit(":", 1)[0]


def _waiter(raw: object) -> uuid.UUID | None:
    text = raw.decode() if isinstance(raw, bytes) else str(raw or "")
    return uuid.UUID(text) if text else None


def _redis_error() -> type[Exception]:
    import redis

    return redis.RedisError
