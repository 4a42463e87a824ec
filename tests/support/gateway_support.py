"""Start the gateway as its users do (`python -m tritonkit_client.gateway`) on a free port, in front of a server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from tritonkit.runtime.server import free_port


def start_gateway(server, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """The gateway process and its port, once /health answers 200; extra: its command-line flags."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tritonkit_client.gateway", "--port", str(port), "--triton", server.grpc_url, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"gateway did not start: {proc.stdout.read()}")
