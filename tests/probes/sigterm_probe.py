"""Run only by test_launcher.py's SIGTERM test (explicit path; pytest collects no `*_probe.py` on its own): starts
a server through the shared fixture, writes its pid where TRITONKIT_PROBE_PID says, then waits to be killed."""

import os
import time
from pathlib import Path


def test_wait_for_sigterm(start_server, smoke_repository):
    server = start_server(smoke_repository)
    Path(os.environ["TRITONKIT_PROBE_PID"]).write_text(str(server.process.pid))
    time.sleep(120)
