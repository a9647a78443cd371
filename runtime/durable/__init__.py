"""Durable functions: a plain Python function ``fn(input, steps)`` whose non-deterministic work
goes through ``steps``. Same engine, step log, leases, guard and timeline as the agent loop:
each task replays the function and executes one step through the one step executor.

- :mod:`runtime.durable.api`: declaring (``@durable_agent``, ``@step``, ``Steps``);
- :mod:`runtime.durable.execution`: one task's replay of a function;
- :mod:`runtime.durable.compensation`: undoing completed steps after a failure or a stop.
"""

from runtime.durable.api import (
    TIMEOUT_POLICIES,
    ApprovalBuilder,
    ApprovalRequest,
    Billed,
    BilledFailure,
    DurableAgent,
    Model,
    StepOptions,
    Steps,
    current_steps,
    durable_agent,
    idempotent,
    step,
)
from runtime.durable.errors import (
    ApprovalMismatch,
    ApprovalRejected,
    ChildRunFailed,
    DurableConfigError,
    InfrastructureError,
    NonDeterministicReplay,
    SignalTimeout,
    StepError,
    StepTimeout,
    VersionUnsupported,
)

__all__ = [
    "TIMEOUT_POLICIES",
    "ApprovalBuilder",
    "ApprovalMismatch",
    "ApprovalRejected",
    "ApprovalRequest",
    "Billed",
    "BilledFailure",
    "ChildRunFailed",
    "DurableAgent",
    "DurableConfigError",
    "InfrastructureError",
    "Model",
    "NonDeterministicReplay",
    "SignalTimeout",
    "StepError",
    "StepOptions",
    "StepTimeout",
    "Steps",
    "VersionUnsupported",
    "current_steps",
    "durable_agent",
    "idempotent",
    "step",
]
