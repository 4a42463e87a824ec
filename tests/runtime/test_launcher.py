"""`scripts/serve` (what `make serve` runs): readiness, endpoints, clean SIGTERM/SIGINT shutdown, clear setup errors."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tritonkit import paths
from tritonkit.runtime.server import CONTROL_HEADER, free_port, free_ports
from tritonkit.serving.backend_utils import cgroup_cpu_limit


def _stub_count(pgid: int) -> int:
    out = subprocess.run(["ps", "-eo", "pgid=,comm="], capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line.split()[0] == str(pgid) and "triton_python" in line)


def _launch(smoke_repository, tmp_path, *extra: str, prefix: tuple[str, ...] = ()):
    """`scripts/serve` on free ports, read until it says it is ready: (process, its output so far, http port)."""
    http, grpc, metrics = free_ports(3)
    proc = subprocess.Popen(
        [*prefix, str(paths.ROOT / "scripts" / "serve"), "--model-repository", str(smoke_repository),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--log-file", str(tmp_path / "server.log"), *extra],
        cwd=tmp_path,  # any working directory
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if "Ctrl-C" in line or not line:
            break
    return proc, "".join(lines), (http, grpc, metrics)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serve_script_serves_and_stops_cleanly(smoke_repository, tmp_path, sig):
    watchdog = free_port()
    proc, out, (http, grpc, metrics) = _launch(smoke_repository, tmp_path, "--key-file", str(tmp_path / "key"),
                                               "--watchdog-metrics-port", str(watchdog))
    try:
        assert f"http://127.0.0.1:{http}" in out and f"127.0.0.1:{grpc}" in out and f":{metrics}/metrics" in out, out
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=5) as r:
            assert r.status == 200
        assert f":{watchdog}/metrics" in out, out
        with urllib.request.urlopen(f"http://127.0.0.1:{watchdog}/metrics", timeout=5) as r:
            assert b"tritonkit_watchdog_actions_total" in r.read()
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


def _repository_index(http: int, key: str) -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{http}/v2/repository/index", data=b"{}", method="POST",
                                     headers={CONTROL_HEADER: key})
    with urllib.request.urlopen(request, timeout=10) as r:
        return r.status


@pytest.mark.parametrize("existing", [False, True])
def test_key_file_is_owner_only_and_holds_the_working_key(smoke_repository, tmp_path, existing):
    key_file = tmp_path / "keys" / "control-key"
    if existing:  # a file left world-readable (e.g. by an older version) is tightened, not just rewritten
        key_file.parent.mkdir()
        key_file.write_text("stale\n")
        key_file.chmod(0o644)
    proc, out, (http, _, _) = _launch(smoke_repository, tmp_path, "--key-file", str(key_file))
    try:
        assert "Ctrl-C" in out, out
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        key = key_file.read_text().strip()
        assert key != "stale" and _repository_index(http, key) == 200
        # The key is not on the launcher's own command line (tritonserver's is documented in docs/security.md).
        assert key not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert not [p for p in key_file.parent.iterdir() if p != key_file]  # no temporary file left behind
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to restrict to 1")
def test_thread_pools_follow_cpu_affinity(smoke_repository, tmp_path):
    """Under `taskset -c <one cpu>` the ORT backend sizes its pool from 1 CPU, not from every core of the host."""
    cpu = str(min(os.sched_getaffinity(0)))
    probe = subprocess.run(["taskset", "-c", cpu, sys.executable, "-c",
                            "from tritonkit.serving.backend_utils import usable_cpus; print(usable_cpus())"],
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "1"
    proc, out, _ = _launch(smoke_repository, tmp_path, "--key-file", str(tmp_path / "key"),
                           prefix=("taskset", "-c", cpu))
    try:
        assert "Ctrl-C" in out, out
        log = (tmp_path / "server.log").read_text()
        # smoke_ragged: one instance, no thread parameter, so the default (usable CPUs / instances) decides.
        assert "smoke_ragged: onnxruntime threads intra_op=1 " in log, [
            line for line in log.splitlines() if "onnxruntime threads" in line]
    finally:
        proc.terminate()
        proc.wait(60)


def test_cgroup_quota_caps_usable_cpus(tmp_path):
    """cgroup v2 `cpu.max` along the process's path: the tightest quota wins, `max` means none."""
    root = tmp_path / "cgroup"
    (root / "pod" / "ctr").mkdir(parents=True)
    (root / "cpu.max").write_text("max 100000\n")
    (root / "pod" / "cpu.max").write_text("150000 100000\n")
    (root / "pod" / "ctr" / "cpu.max").write_text("max 100000\n")
    proc_cgroup = tmp_path / "cgroup-of-self"
    proc_cgroup.write_text("0::/pod/ctr\n")
    assert cgroup_cpu_limit(str(proc_cgroup), str(root)) == 1.5
    proc_cgroup.write_text("0::/\n")
    assert cgroup_cpu_limit(str(proc_cgroup), str(root)) is None


def test_check_fails_clearly_without_setup(tmp_path):
    env = dict(os.environ, TRITONKIT_BACKEND_DIR=str(tmp_path / "nowhere"))
    result = subprocess.run([sys.executable, "-m", "tritonkit.runtime.server", "check"], env=env,
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


def test_sigterm_to_pytest_stops_the_servers_its_fixtures_started(tmp_path):
    """`pkill pytest` must not leave tritonservers behind (they run in their own process groups)."""
    pid_file = tmp_path / "server.pid"
    env = {**os.environ, "TRITONKIT_PROBE_PID": str(pid_file)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(paths.ROOT / "tests" / "probes" / "sigterm_probe.py")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not pid_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pid_file.exists(), proc.communicate()[0] if proc.poll() is not None else "probe never started its server"
    server_pid = int(pid_file.read_text())
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0]
    for _ in range(100):
        if not Path(f"/proc/{server_pid}").exists():
            break
        time.sleep(0.1)
    else:
        os.killpg(server_pid, signal.SIGKILL)
        pytest.fail(f"tritonserver {server_pid} outlived the SIGTERM'd pytest:\n{out}")
