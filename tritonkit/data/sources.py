"""Made sources: a model directory a spec derives rather than names (`[source] make = "module:function"` and its
`args`, tritonkit.kinds.spec), written once by that deterministic function under .build/sources/ and remade when the
function's module or its arguments change. Below the kinds, so a data module that makes one can name its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tritonkit import paths

MADE_RECORD = "tritonkit-source.json"  # written by a source maker: how `add` records the directory as `make` + `args`


def make_source(maker: str, args: dict[str, Any]) -> Path:
    """The directory `maker` ("module:function", called as function(target, **args)) writes, made once under
    .build/sources/ and remade when the maker's module or `args` change; the function must be deterministic."""
    import hashlib
    import importlib
    import json
    import shutil
    import tempfile

    module_name, _, function = maker.partition(":")
    if not module_name or not function:
        raise ValueError(f"source.make {maker!r}: expected 'module:function'")
    module = importlib.import_module(module_name)
    code = Path(module.__file__).read_bytes()
    key = hashlib.sha256(code + json.dumps([maker, args], sort_keys=True).encode()).hexdigest()
    target = paths.BUILD_DIR / "sources" / f"{module_name.rsplit('.', 1)[-1]}-{key[:12]}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / "made"
        getattr(module, function)(out, **args)
        (out / MADE_RECORD).write_text(json.dumps({"make": maker, "args": args}, indent=2) + "\n")
        (out / ".complete").write_text(key + "\n")
        shutil.rmtree(target, ignore_errors=True)
        out.rename(target)
    return target
