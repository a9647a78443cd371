"""The engine: claims a run, runs its program (the agent loop, a durable function) one
step, hands the run over; builds the parts from settings (:mod:`runtime.engine.bootstrap`)
and checks them before a process starts (:mod:`runtime.engine.preflight`)."""
