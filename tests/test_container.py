"""The NGC container path, checked offline (no Docker engine here): image, mounts, GPU, shm, Python deps."""

from __future__ import annotations

import ast
import re

import yaml

from tritonkit import paths
from tritonkit.config import find_configs, load_config
from tritonkit.server import CONTROL_HEADER, RESTRICTED_APIS

DOCKER = paths.ROOT / "docker"


def test_dockerfile_uses_the_2_51_core_and_installs_backend_deps():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:24\.10-py3$", text, re.M)
    assert "requirements-container.txt" in text and "--model-repository=/models" in text


def test_compose_mounts_repository_reserves_gpu_and_sets_shm():
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    svc = compose["services"]["tritonserver"]
    assert "../model_repository:/models:ro" in svc["volumes"]
    assert (DOCKER / svc["volumes"][0].split(":")[0]).resolve() == paths.MODEL_REPOSITORY
    assert svc["shm_size"] == "1gb"
    devices = svc["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])  # loopback unless the user changes it
    restricted = f"{RESTRICTED_APIS}:{CONTROL_HEADER}="
    assert any(a.startswith(f"--http-restricted-api={restricted}") for a in svc["command"])
    assert any(a.startswith(f"--grpc-restricted-protocol={restricted}") for a in svc["command"])


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
    stdlib_or_image = set(__import__("sys").stdlib_module_names) | {"triton_python_backend_utils", "tritonkit"}
    imports = _python_backend_imports()
    assert imports, "no Python-backend model found"
    for module in sorted(imports - stdlib_or_image):
        assert provided_by.get(module, module).lower() in pins, f"{module} missing from requirements-container.txt"
