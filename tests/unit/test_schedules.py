"""Which ticks of a schedule are due, and which its catch-up policy keeps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from runtime.engine.schedules import (
    GRACE,
    MAX_TICKS_PER_PASS,
    Cron,
    ScheduleError,
    parse_cron,
    plan_ticks,
)

T0 = datetime(2026, 3, 1, 12, 0, 0, tzinfo=UTC)
EVERY_MINUTE = Cron("* * * * *", "UTC")


def test_a_tick_not_yet_due_claims_nothing() -> None:
    plan = plan_ticks(EVERY_MINUTE, T0 + timedelta(minutes=1), T0, "none")
    assert plan.ticks == []
    assert plan.next_tick_at == T0 + timedelta(minutes=1)


def test_the_due_tick_is_claimed_and_the_next_one_follows() -> None:
    plan = plan_ticks(EVERY_MINUTE, T0, T0 + timedelta(seconds=5), "none")
    assert plan.ticks == [T0]
    assert plan.next_tick_at == T0 + timedelta(minutes=1)


def test_catch_up_none_drops_ticks_older_than_the_grace() -> None:
    down_since = T0 - timedelta(hours=3)
    plan = plan_ticks(EVERY_MINUTE, down_since, T0, "none")
    assert plan.ticks == [T0 - timedelta(minutes=1), T0]
    assert all(t >= T0 - GRACE for t in plan.ticks)
    assert plan.next_tick_at == T0 + timedelta(minutes=1)


def test_catch_up_latest_runs_only_the_newest_missed_tick() -> None:
    plan = plan_ticks(EVERY_MINUTE, T0 - timedelta(hours=3), T0 + timedelta(seconds=30), "latest")
    assert plan.ticks == [T0]
    assert plan.next_tick_at == T0 + timedelta(minutes=1)


def test_catch_up_all_runs_every_missed_tick_a_bounded_number_per_pass() -> None:
    start = T0 - timedelta(hours=3)
    plan = plan_ticks(EVERY_MINUTE, start, T0, "all")
    assert len(plan.ticks) == MAX_TICKS_PER_PASS
    assert plan.ticks[0] == start
    assert plan.next_tick_at == start + timedelta(minutes=MAX_TICKS_PER_PASS)
    done = list(plan.ticks)
    nxt = plan.next_tick_at
    while nxt <= T0:
        plan = plan_ticks(EVERY_MINUTE, nxt, T0, "all")
        done += plan.ticks
        nxt = plan.next_tick_at
    assert len(done) == 3 * 60 + 1
    assert len(set(done)) == len(done)


def test_six_fields_tick_every_second() -> None:
    cron = parse_cron("* * * * * *", "UTC")
    plan = plan_ticks(cron, T0, T0 + timedelta(seconds=2, milliseconds=500), "none")
    assert plan.ticks == [T0, T0 + timedelta(seconds=1), T0 + timedelta(seconds=2)]


def test_six_fields_read_seconds_first_as_the_readme_says() -> None:
    every_ten = parse_cron("*/10 * * * * *", "UTC")
    plan = plan_ticks(every_ten, T0, T0 + timedelta(seconds=35), "none")
    assert plan.ticks == [T0 + timedelta(seconds=s) for s in (0, 10, 20, 30)]
    late = parse_cron("30 0 9 * * *", "UTC")  # 09:00:30 every day
    assert late.next_after(T0.replace(hour=8)) == T0.replace(hour=9, minute=0, second=30)


def test_the_expression_is_read_in_the_schedules_time_zone_across_dst() -> None:
    cron = parse_cron("0 9 * * *", "Europe/Paris")
    winter = cron.next_after(datetime(2026, 3, 1, tzinfo=UTC))
    summer = cron.next_after(datetime(2026, 4, 1, tzinfo=UTC))
    assert (winter.hour, summer.hour) == (8, 7)  # 09:00 in Paris, CET then CEST


@pytest.mark.parametrize(
    ("expression", "zone", "message"),
    [
        ("* * *", "UTC", "5 fields"),
        ("61 * * * *", "UTC", "ever fires"),
        ("0 0 31 2 *", "UTC", "ever fires"),
        ("* * * * *", "Mars/Olympus", "IANA"),
        ("* * * * *", "", "IANA"),
        ("", "UTC", "cron expression"),
    ],
)
def test_a_bad_schedule_names_the_fix(expression: str, zone: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        parse_cron(expression, zone)
