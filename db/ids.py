"""Run ids: time-ordered UUIDs (version 7, RFC 9562) generated here, in Python.

A run's id leads the primary keys of its steps and events (``run_step (run_id, seq)``,
``run_event (run_id, n)``). With random ids (version 4) every new run writes into a random
leaf page of each of those indexes, and of ``run``'s own: on a database of a year, pages that
are neither in shared buffers nor dirty since the last checkpoint (a read, and a full-page
image in the WAL, per page). A version 7 id starts with the time in milliseconds, so a new
run's rows land at the right edge of each index, on the same few hot pages (measured in
docs/benchmarks.md). Ids made before stay valid: any UUID is a run id.
"""

from __future__ import annotations

import os
import time
import uuid


def uuid7(now_ms: int | None = None) -> uuid.UUID:
    """A version 7 UUID: 48 bits of Unix time in milliseconds, then 74 random bits."""
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits, 74 used
    value = (ms & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76  # version
    value |= (rand >> 68) << 64  # rand_a: 12 bits
    value |= 0b10 << 62  # variant
    value |= rand & 0x3FFF_FFFF_FFFF_FFFF  # rand_b: 62 bits
    return uuid.UUID(int=value)
