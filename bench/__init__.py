"""Benchmarks of the durable agent runtime, with baselines measured in the same run.

Run ``python -m bench all`` (or ``--quick``); see docs/benchmarks.md. Nothing here is a test:
figures are printed and written to ``bench/results/``, never asserted.
"""
