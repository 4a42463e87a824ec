"""The NGC container path. No Docker engine here: the image's files are checked offline, and its supervisor (the
container's command) runs against the real embedded tritonserver, the same 2.51 core."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from tests.support.tiny_models import build_sleepy_repository
from tritonkit import deploy, paths, release
from tritonkit.repository import variants
from tritonkit.repository.config import find_configs, load_config
from tritonkit.runtime import supervisor
from tritonkit.runtime.server import (
    CONTROL_HEADER,
    RESTRICTED_APIS,
    TritonServer,
    _stubs_of,
    prepare_backend_dir,
    server_env,
)
from tritonkit.runtime.watchdog import StubWatchdog, TritonHttp

DOCKER = paths.ROOT / "docker"


def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per Dockerfile instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(m.group(1).upper(), m.group(2).strip()) for m in re.finditer(r"^(\w+)\s+(.*)$", text, re.M)]


def test_dockerfile_keeps_ngc_entrypoint_and_has_one_release_setting():
    steps = _instructions(DOCKER / "Dockerfile")
    kinds = [k for k, _ in steps]
    assert "ENTRYPOINT" not in kinds  # NGC's entrypoint (driver compatibility handling) must stay
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG")
    assert args["NGC_RELEASE"] == release.DEFAULT
    (base,) = [a for k, a in steps if k == "FROM"]
    assert base == "nvcr.io/nvidia/tritonserver:${NGC_RELEASE}-py3"
    assert base.replace("${NGC_RELEASE}", args["NGC_RELEASE"]) == release.BASE_IMAGE
    (cmd,) = [a for k, a in steps if k == "CMD"]
    assert json.loads(cmd) == deploy.server_command()  # exec form, the command Kubernetes runs too


def test_compose_uses_the_image_command_mounts_repository_reserves_gpu_and_sets_shm():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    svc = compose["services"]["tritonserver"]
    assert "entrypoint" not in svc and "command" not in svc
    # The variable that picks the release for plan builds picks the image too.
    assert svc["build"]["args"]["NGC_RELEASE"] == f"${{{release.RELEASE_ENV}:-{release.DEFAULT}}}"
    assert svc["image"] == f"{release.IMAGE_NAME}:${{{release.RELEASE_ENV}:-{release.DEFAULT}}}"
    assert svc["environment"][supervisor.KEY_ENV].startswith(f"${{{supervisor.KEY_ENV}:?")
    # The NGC container serves the NGC view of the repository, not the embedded one.
    (volume,) = svc["volumes"]
    host, target, mode = volume.split(":")
    assert (DOCKER / host).resolve() == variants.NGC_REPOSITORY and (target, mode) == ("/models", "ro")
    assert svc["shm_size"] == "1gb"
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])  # loopback unless the user changes it


def _python_backend_imports() -> set[str]:
    modules = set()
    for cfg_path in find_configs(paths.MODEL_REPOSITORY):
        if load_config(cfg_path).backend != "python":
            continue
        for model_py in cfg_path.parent.glob("*/model.py"):
            for node in ast.walk(ast.parse(model_py.read_text())):
                if isinstance(node, ast.Import):
                    modules |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    modules.add(node.module.split(".")[0])
    return modules


def test_container_requirements_cover_python_backend_imports():
    """Every third-party module a Python-backend model imports is installed by the container image."""
    pins = (DOCKER / "requirements-container.txt").read_text().lower()
    provided_by = {"PIL": "pillow", "tokenizers": "tokenizers", "numpy": "numpy"}
    stdlib_or_image = set(sys.stdlib_module_names) | {"triton_python_backend_utils", "tritonkit"}
    imports = _python_backend_imports()
    assert imports, "no Python-backend model found"
    for module in sorted(imports - stdlib_or_image):
        assert provided_by.get(module, module).lower() in pins, f"{module} missing from requirements-container.txt"


def test_supervisor_imports_only_the_standard_library_and_tritonkit():
    """It runs on the container's Python (3.10 in 24.10), where only requirements-container.txt is installed, and
    the image ships the whole tritonkit package (Dockerfile COPY), so every module of ours it loads is there."""
    assert ("COPY", "tritonkit /opt/tritonkit/tritonkit") in _instructions(DOCKER / "Dockerfile")
    # -S: no site-packages, so an import of anything third-party fails here as it would in the container.
    loaded = subprocess.run(
        [sys.executable, "-S", "-c", "import sys, tritonkit.runtime.supervisor; "
         "print(*sorted(m for m in sys.modules if m.split('.')[0] == 'tritonkit'))"],
        cwd=paths.ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert {"tritonkit.runtime.supervisor", "tritonkit.runtime.watchdog"} <= set(loaded)
    allowed = set(sys.stdlib_module_names) | {"tritonkit", "__future__"}
    for name in loaded:
        # Imports inside functions too, and the container's Python version's syntax.
        tree = ast.parse(Path(importlib.util.find_spec(name).origin).read_text(), feature_version=(3, 10))
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert names <= allowed, f"{name}: {sorted(names - allowed)}"


def test_the_repository_api_is_always_restricted():
    cmd = ["tritonserver", "--model-control-mode=explicit"]
    restricted, key = supervisor.restricted_command(cmd, "k1")
    assert key == "k1"
    assert f"--http-restricted-api={RESTRICTED_APIS}:{CONTROL_HEADER}=k1" in restricted
    assert f"--grpc-restricted-protocol={RESTRICTED_APIS}:{CONTROL_HEADER}=k1" in restricted
    # A command that restricts the API itself keeps its key (the environment's is not needed).
    assert supervisor.restricted_command(restricted, None) == (restricted, "k1")
    with pytest.raises(supervisor.SupervisorError, match="TRITONKIT_CONTROL_KEY"):
        supervisor.restricted_command(cmd, None)
    with pytest.raises(supervisor.SupervisorError, match="--http-restricted-api"):
        supervisor.restricted_command([*cmd, "--http-restricted-api=trace:other=x"], "k1")
    assert supervisor.option(["a", "--http-port", "9", "--http-port=10"], "--http-port") == "10"
    assert supervisor.option(["a"], "--http-port", "8000") == "8000"


# --- against the real server ----------------------------------------------------------------------------------

def _echo(url: str, value: float) -> float:
    client = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("X", [1, 1], "FP32")
        inp.set_data_from_numpy(np.full((1, 1), value, np.float32))
        return float(client.infer("sleepy", [inp]).as_numpy("Y")[0, 0])
    finally:
        client.close()


def _wait(predicate, what: str, watchdog: StubWatchdog, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}; watchdog {dict(watchdog.counts)}, {watchdog.recoveries}")


def test_the_watchdog_over_http_reloads_a_killed_stub_and_leaves_an_unloaded_model(start_server, tmp_path):
    """The supervisor's watchdog: StubWatchdog watching through TritonHttp, the server's HTTP API alone."""
    # The launcher's own watchdog is off: only the one over HTTP may bring the model back.
    server = start_server(build_sleepy_repository(tmp_path / "repo", delay_ms=1), recover_crashed_stubs=False,
                          exit_timeout_s=5)
    api = TritonHttp(server.http_url, server.control_key, server.process)
    # Slow looks: the crash stays unhandled long enough to show what clients and probes see meanwhile.
    watchdog = StubWatchdog(api, poll_s=1.0)
    watchdog.start(server.process)
    try:
        ((pid, model),) = _stubs_of(server.process.pid).values()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)
        with pytest.raises(InferenceServerException, match="not healthy"):
            _echo(server.http_url, 1.0)  # what clients see until someone reloads
        # ...while everything a probe or the index shows still says the model is fine (Triton 2.51).
        probe = httpclient.InferenceServerClient(server.http_url)
        assert probe.is_server_ready() and probe.is_model_ready("sleepy")
        probe.close()
        assert api.model_states()["sleepy"][0] == "READY"
        _wait(lambda: watchdog.counts[("sleepy", "reloaded")] == 1, "reloaded", watchdog)
        assert watchdog.counts[("sleepy", "crash_detected")] == 1 and model == "sleepy"
        assert _echo(server.http_url, 2.0) == 2.0
        ((new_pid, _),) = _stubs_of(server.process.pid).values()
        assert new_pid != pid
        time.sleep(1.5)  # a look at the new stub: the watchdog can only report on stubs it saw alive

        # Unloaded on purpose: its stub goes away, the index says UNAVAILABLE, and it stays unloaded.
        control = httpclient.InferenceServerClient(server.http_url)
        control.unload_model("sleepy", headers={CONTROL_HEADER: server.control_key})
        control.close()
        _wait(lambda: watchdog.counts[("sleepy", "left_to_operator")] == 1, "unload left alone", watchdog)
        time.sleep(2.5)  # two more looks
        assert api.model_states()["sleepy"] == ("UNAVAILABLE", "unloaded")
        assert watchdog.counts[("sleepy", "reloaded")] == 1 and len(watchdog.recoveries) == 1, watchdog.recoveries
        assert not _stubs_of(server.process.pid)
        assert 'tritonkit_watchdog_actions_total{model="sleepy",action="left_to_operator"} 1' in watchdog.metrics()
    finally:
        api.process = None  # the server is stopping: the watchdog thread ends


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def test_supervisor_runs_the_server_recovers_a_stub_and_drains_on_sigterm(tmp_path):
    """The container's command, end to end, with the embedded server's binary in place of the image's."""
    repo = build_sleepy_repository(tmp_path / "repo", delay_ms=1)
    # `--load-model=*`, as the container command loads models (explicit control, every model at startup).
    spec = TritonServer.on_free_ports(model_repository=repo, models=["*"], exit_timeout_s=5)
    prepare_backend_dir(Path(spec.backend_dir))
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tritonkit.runtime.supervisor", "--poll-s", "0.2", "--",
                                 *spec.command()], env=server_env(), cwd=paths.ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    server_pid = None
    try:
        deadline = time.monotonic() + 120
        while not spec.is_ready():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        (server_pid,) = _children(proc.pid)
        # The supervisor's first snapshot follows readiness; a stub killed before it is never known to have lived
        # (a fixed 1 s wait lost that race on a loaded CI machine).
        while "supervisor: watching" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        ((pid, _),) = _stubs_of(server_pid).values()
        os.kill(pid, signal.SIGKILL)
        deadline, value = time.monotonic() + 60, None
        while value is None and time.monotonic() < deadline:
            try:
                value = _echo(spec.http_url, 3.0)
            except InferenceServerException:
                time.sleep(0.2)
        assert value == 3.0, f"not recovered:\n{log.read_text()}"
        # The shared watchdog's lines, on the supervisor's stdout (the container's log).
        assert "watchdog: model 'sleepy': crash_detected" in log.read_text()
        assert "watchdog: model 'sleepy': reloaded" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)  # forwarded: Triton drains within its 5 s exit timeout
        # Triton's exit code passes through. The version whose stub died never finishes unloading (Triton 2.51),
        # so the drain ends at the exit timeout and Triton itself exits 1.
        expected = 1 if "Exit timeout expired" in log.read_text() else 0
        assert code == expected, log.read_text()
        assert not _children(server_pid) and not Path(f"/proc/{server_pid}").exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if server_pid is not None:  # a failed run must not leave the server's group behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(server_pid, signal.SIGKILL)
