"""`make serve` before anything is built, with a port taken, or with a stale build: one line, the fixing command."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

from tritonkit import paths
from tritonkit.runtime.server import free_ports


def _run(tmp_path, *args, specs=None):
    env = {**os.environ, "TRITONKIT_SPECS": str(specs or tmp_path / "models"),
           "TRITONKIT_MODEL_REPOSITORY": str(tmp_path / "repo"), "TRITONKIT_BUILD_OUTPUTS": str(tmp_path / "build")}
    (tmp_path / "repo").mkdir(exist_ok=True)
    return subprocess.run([str(paths.ROOT / "scripts" / "serve"), *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_a_never_built_checkout_is_told_what_to_run(tmp_path):
    specs = tmp_path / "models"
    specs.mkdir()
    shutil.copy(paths.SPECS / "text_embedding.toml", specs)
    subprocess.run([sys.executable, "-m", "tritonkit.repository.generate"], check=True, capture_output=True,
                   timeout=120, env={**os.environ, "TRITONKIT_SPECS": str(specs),
                                     "TRITONKIT_MODEL_REPOSITORY": str(tmp_path / "repo")})
    http, grpc, metrics = free_ports(3)
    out = _run(tmp_path, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics))
    assert out.returncode == 2
    assert "text_embedding: not built" in out.stderr and "make build" in out.stderr
    assert "no model is built yet" in out.stderr
    assert "tritonserver" not in out.stdout, "the server must not start"
    assert len(out.stderr.strip().splitlines()) <= 3, out.stderr


def test_a_taken_port_is_named_with_the_make_variable(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = _run(tmp_path, "--http-port", str(port), specs=paths.SPECS)
    assert out.returncode == 2
    assert f"port {port} (http) is in use" in out.stderr and "HTTP_PORT=" in out.stderr


def test_stale_generated_configs_are_refused(tmp_path):
    specs = tmp_path / "models"
    specs.mkdir()
    shutil.copy(paths.SPECS / "text_embedding.toml", specs)
    out = _run(tmp_path, specs=specs)  # nothing generated into the scratch repository yet
    assert out.returncode == 2 and "python -m tritonkit.repository.generate" in out.stderr
