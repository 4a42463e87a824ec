"""The embedded server's files: tritonserver 2.51 and its Python-backend stubs from the nvidia-pytriton wheel, and
the backend directory they run from (Triton's Python backend plus our Python-based backends in backends/)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import SetupError

# The caller's LD_PRELOAD, handed to the stubs by STUB_WRAPPER while the server itself runs with an allocator.
STUB_PRELOAD_VAR = "TRITONKIT_STUB_LD_PRELOAD"
# Installed as <backend-dir>/python/triton_python_backend_stub (the path the Python backend execs); the real stub
# is python/stub/. The server's allocator stays out of the stubs: their memory is handled by ArenaRelease, and
# jemalloc there cost 8 % of image throughput (perf/bench_allocator.py).
STUB_WRAPPER = f"""#!/bin/sh
# Written by tritonkit.runtime.server: run the Python-backend stub with the launcher's LD_PRELOAD, not the server's.
if [ -n "${{{STUB_PRELOAD_VAR}+x}}" ]; then
  if [ -n "${STUB_PRELOAD_VAR}" ]; then export LD_PRELOAD="${STUB_PRELOAD_VAR}"; else unset LD_PRELOAD; fi
  unset {STUB_PRELOAD_VAR}
fi
exec "$(dirname "$0")/stub/triton_python_backend_stub" "$@"
"""


def triton_home() -> Path:
    try:
        return paths.package_dir("pytriton") / "tritonserver"
    except paths.PackageNotInstalled as err:
        raise SetupError(f"{err} (it carries tritonserver)") from None


def server_binary() -> Path:
    binary = triton_home() / "bin" / "tritonserver"
    if not binary.exists():
        raise SetupError(f"tritonserver binary not found at {binary}; run `make setup`.")
    return binary


def prepare_backend_dir(target: Path = paths.BACKEND_DIR) -> Path:
    """Assemble <target>/python (wheel files + stub for this Python) and our Python-based backends.

    Files are copied, not linked: tritonserver refuses backend libraries that resolve outside the directory.
    Idempotent and cheap (unchanged files are skipped), so every server start refreshes it.
    """
    home = triton_home()
    py_src = home / "backends" / "python"
    stub = home / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = stub / "triton_python_backend_stub"
    if not stub.exists():
        raise SetupError(f"no Python backend stub for Python {sys.version_info[:2]} in {stub.parent.parent}")
    python_dir = target / "python"
    (python_dir / "stub").mkdir(parents=True, exist_ok=True)
    for src in (py_src / "libtriton_python.so", py_src / "triton_python_backend_utils.py"):
        _copy(src, python_dir / src.name)
    _copy(stub, python_dir / "stub" / stub.name)
    wrapper = python_dir / stub.name
    if wrapper.is_symlink() or not wrapper.exists() or wrapper.read_bytes() != STUB_WRAPPER.encode():
        wrapper.unlink(missing_ok=True)
        wrapper.write_text(STUB_WRAPPER)
    wrapper.chmod(0o755)
    for backend in sorted(paths.PROJECT_BACKENDS.iterdir()):
        if (backend / "model.py").exists():
            (target / backend.name).mkdir(parents=True, exist_ok=True)
            for src in backend.glob("*.py"):
                _copy(src, target / backend.name / src.name)
    return target


def _copy(src: Path, dst: Path) -> None:
    if dst.is_symlink():
        dst.unlink()
    elif dst.exists() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
        return
    shutil.copy2(src, dst)
