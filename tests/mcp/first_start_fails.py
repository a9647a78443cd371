"""Starts an MCP server's command, except the first time: ``first_start_fails.py MARKER
COMMAND...`` exits 3 at once when MARKER does not exist (creating it), as a server that is
still starting or restarting looks to its client; later starts run COMMAND."""

import os
import sys

marker = sys.argv[1]
if not os.path.exists(marker):
    open(marker, "w").close()
    sys.exit(3)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
