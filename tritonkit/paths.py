"""Where things live, derived from this file so any checkout location works."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL_REPOSITORY = ROOT / "model_repository"
BUILD_DIR = ROOT / ".build"
# Server backend directory assembled by `make setup`: the Python backend from the wheel plus our Python-based ones.
BACKEND_DIR = Path(os.environ.get("TRITONKIT_BACKEND_DIR", BUILD_DIR / "backends"))
PROJECT_BACKENDS = ROOT / "backends"
ARTIFACTS = ROOT / "build" / "artifacts"


def venv_bin() -> Path:
    """The bin/ of the interpreter running us; the Python stub must find the same packages."""
    return Path(sys.executable).parent
