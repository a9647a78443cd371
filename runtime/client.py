"""A small client of the live event stream: ``follow(base_url, run_id)`` yields a run's
events as they happen, reconnecting with ``Last-Event-ID`` until ``run.finished``.

Standard library only (``urllib``), so scripts and the ``dar`` CLI can use it anywhere.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


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
