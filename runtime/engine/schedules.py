"""Schedules: which ticks of a cron expression are due, and which of them start a run.

A schedule is a cron expression read in an IANA time zone (so ``0 9 * * 1-5`` is 09:00 in
Paris summer and winter alike). Five fields are the usual minute-to-weekday; with six, the
FIRST is seconds (``*/10 * * * * *``: every ten seconds; ``30 0 9 * * 1-5``: 09:00:30 on
weekdays), as in Quartz, Spring and most six-field crons.

The tick times come from the expression alone, never from when a beat happened to look, so
every beat computes the same times and the unique ``(schedule, tick)`` row in PostgreSQL
decides which one starts the run (:meth:`db.store.RunStore.claim_schedule_ticks`).

What a pass does with the ticks due since the schedule's ``next_tick_at`` is its catch-up
policy (``none``: only the ticks of the last :data:`GRACE` seconds, ticks missed while
everything was down are dropped; ``latest``: the newest due tick only; ``all``: every missed
tick, at most :data:`MAX_TICKS_PER_PASS` per pass). What a tick does while an earlier run
of the schedule is still live is its overlap policy (``skip``, ``queue``, ``allow``), applied
by the store under the schedule's row lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import CroniterBadCronError, croniter

from db.errors import DarError
from db.records import Dispatch, Schedule
from db.store import RunStore, SubmitQuota

log = logging.getLogger(__name__)

OVERLAPS = ("skip", "queue", "allow")
CATCH_UPS = ("none", "latest", "all")
GRACE = timedelta(seconds=60)
"""With catch-up ``none``, a tick later than this is missed, not started."""
MAX_TICKS_PER_PASS = 100
"""With catch-up ``all``, the ticks one pass starts; the next pass goes on from there."""
MAX_CRON_CHARS = 200
_EPSILON = timedelta(microseconds=1)


class ScheduleError(DarError):
    """A cron expression or time zone that cannot make ticks."""


@dataclass(frozen=True)
class Cron:
    expression: str
    timezone: str

    def _zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    def _fields(self) -> dict[str, bool]:
        """Six fields: seconds first (croniter's default reads them last)."""
        return {"second_at_beginning": len(self.expression.split()) == 6}

    def next_after(self, after: datetime) -> datetime:
        """The first tick strictly after ``after``, in UTC."""
        it = croniter(self.expression, after.astimezone(self._zone()), **self._fields())
        found: datetime = it.get_next(datetime)
        return found.astimezone(UTC)

    def first_from(self, start: datetime) -> datetime:
        """The first tick at or after ``start``, in UTC."""
        return self.next_after(start - _EPSILON)

    def latest_at(self, now: datetime) -> datetime:
        """The last tick at or before ``now``, in UTC."""
        it = croniter(self.expression, (now + _EPSILON).astimezone(self._zone()), **self._fields())
        found: datetime = it.get_prev(datetime)
        return found.astimezone(UTC)


def parse_cron(expression: str, timezone: str) -> Cron:
    """The schedule's expression and zone, checked: :class:`ScheduleError` names the fix."""
    if not isinstance(expression, str) or not expression.strip():
        raise ScheduleError("cron must be a cron expression such as '0 9 * * 1-5'")
    if len(expression) > MAX_CRON_CHARS:
        raise ScheduleError(f"cron must be at most {MAX_CRON_CHARS} characters")
    fields = expression.split()
    if len(fields) not in (5, 6):
        raise ScheduleError(
            f"cron must have 5 fields (minute hour day month weekday) or 6 (seconds first, "
            f"then those five); got {len(fields)} in {expression!r}"
        )
    try:
        zone_ok = bool(timezone) and ZoneInfo(timezone) is not None
    except (ZoneInfoNotFoundError, ValueError, OSError, TypeError):
        zone_ok = False
    if not zone_ok:
        raise ScheduleError(
            f"timezone must be an IANA time zone name such as 'UTC' or 'Europe/Paris'; "
            f"got {timezone!r}"
        )
    cron = Cron(" ".join(fields), timezone)
    try:
        if not croniter.is_valid(cron.expression, second_at_beginning=len(fields) == 6):
            raise CroniterBadCronError(cron.expression)
        cron.next_after(datetime.now(UTC))
    except Exception as e:  # croniter raises many types on garbage; all mean "not a cron"
        raise ScheduleError(
            f"cron {expression!r} is not a cron expression that ever fires ({e}); e.g. "
            "'*/5 * * * *' for every five minutes"
        ) from None
    return cron


@dataclass(frozen=True)
class TickPlan:
    """What one pass does for one schedule."""

    ticks: list[datetime]
    """The ticks to claim, oldest first."""
    next_tick_at: datetime
    """The first tick the next pass looks at."""


def plan_ticks(cron: Cron, next_tick_at: datetime, now: datetime, catch_up: str) -> TickPlan:
    """The ticks due at ``now`` since ``next_tick_at`` that ``catch_up`` keeps."""
    if next_tick_at > now:
        return TickPlan([], next_tick_at)
    if catch_up == "latest":
        return TickPlan([cron.latest_at(now)], cron.next_after(now))
    start = next_tick_at if catch_up == "all" else max(next_tick_at, now - GRACE)
    ticks: list[datetime] = []
    tick = cron.first_from(start)
    while tick <= now and len(ticks) < MAX_TICKS_PER_PASS:
        ticks.append(tick)
        tick = cron.next_after(tick)
    return TickPlan(ticks, tick)


def plan_schedule(schedule: Schedule, now: datetime) -> tuple[list[datetime], datetime]:
    """:func:`plan_ticks` for a stored schedule (the store's callback)."""
    plan = plan_ticks(
        Cron(schedule.cron, schedule.timezone), schedule.next_tick_at, now, schedule.catch_up
    )
    return plan.ticks, plan.next_tick_at


def tick_schedules(
    store: RunStore,
    *,
    limit: int = 100,
    quota: SubmitQuota | None = None,
    creator_ok: Callable[[str], bool] | None = None,
) -> list[Dispatch]:
    """One pass of a beat: claim the due ticks of every due schedule. Returns the drive_run
    messages of the runs started (committed already; send them now). Any number of beats
    may run this at once: each tick starts one run (a unique row), whoever inserts it.

    A tick's run is a submit by the schedule's creator: within ``quota`` and only while
    ``creator_ok`` (its token configured and unexpired); otherwise the tick is SKIPPED with
    its reason (:meth:`RunStore.claim_schedule_ticks`)."""
    started: list[Dispatch] = []
    for schedule_id in store.due_schedules(limit=limit):
        try:
            started += store.claim_schedule_ticks(
                schedule_id, plan_schedule, quota=quota, creator_ok=creator_ok
            )
        except Exception:  # one broken schedule must not stop the others
            log.exception("schedule=%s: its due ticks could not be claimed", schedule_id)
    return started


def shortest_gap(cron: Cron, start: datetime, ticks: int = 60) -> timedelta:
    """The shortest time between two of the next ``ticks`` ticks of ``cron`` after
    ``start`` (what ``DAR_SCHEDULE_MIN_INTERVAL_SECONDS`` bounds)."""
    previous = cron.next_after(start)
    gap = timedelta.max
    for _ in range(ticks):
        tick = cron.next_after(previous)
        gap = min(gap, tick - previous)
        previous = tick
    return gap
