"""What a run shows while and after it runs: metrics, log context, traces, the live
channel of its event stream."""
