"""`scripts/serve` (what `make serve` runs): readiness, endpoints, clean SIGTERM/SIGINT shutdown, clear setup errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tritonkit import paths
from tritonkit.server import free_port


def _stub_count(pgid: int) -> int:
    out = subprocess.run(["ps", "-eo", "pgid=,comm="], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.split()[0] == str(pgid) and "triton_python" in line)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_script_serves_and_stops_cleanly(smoke_repository, tmp_path, sig):
    http, grpc, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [str(paths.ROOT / "scripts" / "serve"), "--model-repository", str(smoke_repository),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--log-file", str(tmp_path / "server.log")],
        cwd=tmp_path,  # any working directory
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C" in line or not line:
                break
        out = "".join(lines)
        assert f"http://127.0.0.1:{http}" in out and f"127.0.0.1:{grpc}" in out and f":{metrics}/metrics" in out, out
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
        server_pid = int(next(
            line.split()[0] for line in subprocess.run(
                ["ps", "-eo", "pid=,ppid=,comm="], capture_output=True, text=True).stdout.splitlines()
            if line.split()[1] == str(proc.pid) and line.split()[2] == "tritonserver"
        ))
        assert _stub_count(server_pid) >= 3
        proc.send_signal(sig)
        assert proc.wait(60) == 0
        assert "stopped" in proc.stdout.read()
        assert _stub_count(server_pid) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_check_fails_clearly_without_setup(tmp_path):
    env = dict(os.environ, TRITONKIT_BACKEND_DIR=str(tmp_path / "nowhere"))
    result = subprocess.run([sys.executable, "-m", "tritonkit.server", "check"], env=env,
                            capture_output=True, text=True)
    assert result.returncode == 2
    assert "make setup" in result.stderr


def test_serve_script_without_venv_says_run_setup(tmp_path):
    # A copy of the launcher in a checkout that has no .venv.
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "serve"
    script.write_text((paths.ROOT / "scripts" / "serve").read_text())
    script.chmod(0o755)
    result = subprocess.run([str(script)], capture_output=True, text=True)
    assert result.returncode == 2
    assert "make setup" in result.stderr
