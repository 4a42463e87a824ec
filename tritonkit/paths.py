"""Where things live, derived from this file so any checkout location works."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tritonkit.errors import PackageNotInstalled

ROOT = Path(__file__).resolve().parent.parent
# The overrides let a second tree of specs, configs and build outputs live elsewhere (tests, experiments).
MODEL_REPOSITORY = Path(os.environ.get("TRITONKIT_MODEL_REPOSITORY", ROOT / "model_repository"))
SPECS = Path(os.environ.get("TRITONKIT_SPECS", ROOT / "models"))
BUILD_OUTPUTS = Path(os.environ.get("TRITONKIT_BUILD_OUTPUTS", ROOT / "build"))
BUILD_DIR = ROOT / ".build"
# Server backend directory assembled by `make setup`: the Python backend from the wheel plus our Python-based ones.
BACKEND_DIR = Path(os.environ.get("TRITONKIT_BACKEND_DIR", BUILD_DIR / "backends"))
PROJECT_BACKENDS = ROOT / "backends"
ARTIFACTS = BUILD_OUTPUTS / "artifacts"
REPORTS = BUILD_OUTPUTS / "reports"


def model_file(model: str, version: int = 1) -> Path:
    """A served model's ONNX file in the embedded repository."""
    return MODEL_REPOSITORY / model / str(version) / "model.onnx"


def venv_bin() -> Path:
    """The bin/ of the interpreter running us; the Python stub must find the same packages."""
    return Path(sys.executable).parent


def rel(path: Path) -> str:
    """A path for messages: relative to the checkout when inside it."""
    path = Path(path)
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def package_dir(name: str) -> Path:
    """The folder of an installed Python package (weights, tokenizers and photos live in some)."""
    import importlib.util

    found = importlib.util.find_spec(name)
    if found is None or not found.submodule_search_locations:
        raise PackageNotInstalled(f"Python package '{name}' is not installed in {sys.prefix}; run `make setup`")
    return Path(next(iter(found.submodule_search_locations)))


def package_file(ref: str) -> Path:
    """'package:relative/path' → that file of an installed package."""
    package, _, rel = ref.partition(":")
    return package_dir(package) / rel
