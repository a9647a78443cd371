"""``python -m bench.hostile_bodies [--repeats N]``: what a refused hostile submit costs the
web process's CPU (issue 28.5).

Each body is ~660 KB of JSON, under ``DAR_MAX_BODY_BYTES`` and over ``DAR_MAX_INPUT_CHARS``,
shaped to make a walk over it slow (a long flat list, a wide nested list, many small
strings). Measured through the Flask app (``POST /api/runs`` with the test client, open
authentication, no database write: every body is refused with a 400): the request as served
now (size first), and, as the same-run baseline, the walk the old order ran before the size
check (``check_json`` over the parsed body, the path strings the old walk built included).
Prints medians in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from api.schemas import check_json


def bodies() -> dict[str, bytes]:
    nested: Any = ["x"] * 110_000
    for _ in range(60):
        nested = [nested]
    return {
        "flat list of 220k ints": json.dumps({"agent": "d", "input": [1] * 220_000}).encode(),
        "60-deep list of 110k strings": json.dumps({"agent": "d", "input": nested}).encode(),
        "55k short strings": json.dumps({"agent": "d", "input": ["abcdefgh"] * 55_000}).encode(),
    }


def _old_walk(value: Any) -> None:
    """The walk of commit c875bcc: a path string built for every value, then the checks."""
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        where, item, _depth = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                stack.append((f"{where}.{key}" if where else str(key), child, _depth + 1))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                stack.append((f"{where}[{i}]", child, _depth + 1))


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from flask import Flask, request

    from api.errors import ApiError
    from api.validation import json_body

    app = Flask(__name__)
    print(f"{'body':32} {'size':>8} {'now: refused':>14} {'old walk only':>14} {'walk now':>10}")
    for name, raw in bodies().items():

        def served(raw: bytes = raw) -> None:
            with app.test_request_context(
                "/api/runs", method="POST", data=raw, content_type="application/json"
            ):
                try:
                    json_body(request, limit_input=100_000)
                except ApiError:
                    return
                raise AssertionError("not refused")

        parsed = json.loads(raw)
        now = _median_ms(served, args.repeats)
        old = _median_ms(lambda parsed=parsed: _old_walk(parsed), args.repeats)
        walk = _median_ms(lambda parsed=parsed: check_json(parsed, text=True), args.repeats)
        print(f"{name:32} {len(raw) // 1024:>6}KB {now:>12.1f}ms {old:>14.1f}ms {walk:>8.1f}ms")


if __name__ == "__main__":
    main()
