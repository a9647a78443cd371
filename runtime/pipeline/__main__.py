"""``python -m runtime.pipeline``: prints the crash table to paste into the docs."""

from runtime.pipeline.kinds import crash_table

print(crash_table())
