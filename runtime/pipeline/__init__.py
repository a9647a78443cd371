"""The step pipeline: every kind of step is looked up in the step log, run (an effect or a
model call), recorded and stopped the same way; what differs per kind is one table,
:data:`runtime.pipeline.kinds.KINDS` (``python -m runtime.pipeline`` prints it).

Modules: :mod:`~runtime.pipeline.kinds` (the table and the lookup),
:mod:`~runtime.pipeline.checkpoint` (:class:`~runtime.pipeline.checkpoint.Task`, what a
program gets for the run it holds, and every record it makes),
:mod:`~runtime.pipeline.effects` (steps that change the world),
:mod:`~runtime.pipeline.modelcall` and :mod:`~runtime.pipeline.mcpcall` (model and MCP calls
as steps), :mod:`~runtime.pipeline.replay` (the conversation from the log),
:mod:`~runtime.pipeline.guard`, :mod:`~runtime.pipeline.heartbeat` (the leases renewed while
steps run), :mod:`~runtime.pipeline.codec` (step values as JSON),
:mod:`~runtime.pipeline.faults` (crash points), :mod:`~runtime.pipeline.prompthash`.
"""
