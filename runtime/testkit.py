"""The test kit's old import path, kept for scripts and tests written against it: the kit
lives in :mod:`runtime.testing.testkit`."""

from runtime.testing.testkit import DurableTester as DurableTester
from runtime.testing.testkit import FakeModel as FakeModel
from runtime.testing.testkit import RunAssert as RunAssert
from runtime.testing.testkit import RunResult as RunResult
from runtime.testing.testkit import SimulatedCrash as SimulatedCrash
from runtime.testing.testkit import StepAssert as StepAssert
from runtime.testing.testkit import assert_run as assert_run

__all__ = [
    "DurableTester",
    "FakeModel",
    "RunAssert",
    "RunResult",
    "SimulatedCrash",
    "StepAssert",
    "assert_run",
]
