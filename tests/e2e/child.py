"""A stand-in child for the supervisor's tests: ``python -m tests.e2e.child exit 3|sleep``."""

import sys
import time

if sys.argv[1] == "exit":
    raise SystemExit(int(sys.argv[2]))
time.sleep(600)
