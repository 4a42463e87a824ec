"""A model's served INT8 file as a past git revision committed it, built here, so a benchmark races today's recipe
against an earlier one on one machine in one run (perf/bench_bf16_race.py, perf/bench_serving.py --rev).

    r, variant = revision.served_int8(kind, "de26b58", tmp / "int8.onnx")
    version = revision.served_version(kind, "de26b58", tmp)   # tmp/1/model.onnx (+ model.packed.onnx)

Built from the revision's recipe for this CPU class and its committed quantization parameters (calibrating only
where they do not apply to this FP32 file) as a replay builds it (tritonkit.int8.decide: the same builder, run-time
quantized nodes included); the runtime variant is the one the revision's runtime record served the INT8 name on.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.errors import TritonkitError


class RevisionError(TritonkitError, LookupError):
    """A revision has no served INT8 recipe for this CPU class, or a file it needs is missing."""


def at_rev(rev: str, path: Path) -> bytes | None:
    """`path` (in the checkout) as committed at `rev`; None where it did not exist."""
    out = subprocess.run(["git", "show", f"{rev}:{paths.rel(path)}"], cwd=paths.ROOT, capture_output=True)
    return out.stdout if out.returncode == 0 else None


def served_int8(kind, rev: str, out: Path, log=print):
    """(Recipe, INT8 runtime variant) of `kind`'s served recipe for this CPU class at `rev`, its INT8 graph written
    to `out`. Needs this checkout's FP32 file (`make build`)."""
    from tritonkit.int8 import recipe
    from tritonkit.int8.builder import Builder
    from tritonkit.int8.params import QuantParams, file_digest
    from tritonkit.int8.records import Recipe
    from tritonkit.repository import runtime_choice
    from tritonkit.serving.runtimes import DEFAULT

    cpu, fp32 = envinfo.int8_class(), paths.model_file(kind.FP32_MODEL)
    if not fp32.exists():
        raise RevisionError(f"{paths.rel(fp32)} is not built: run `make build MODEL={kind.NAME}` first")
    entry = (json.loads(at_rev(rev, recipe.recipe_path(kind)) or b"{}").get("served") or {}).get(cpu)
    if not entry or entry.get("recipe") is None:
        raise RevisionError(f"{kind.NAME}: no served INT8 recipe for the {cpu} class at {rev}")
    runtime = json.loads(at_rev(rev, runtime_choice.choice_path(kind)) or b"{}")
    variant = runtime.get("classes", {}).get(cpu, {}).get("models", {}).get(kind.INT8_MODEL, {}).get(
        "runtime", DEFAULT)
    r = Recipe.from_json(entry["recipe"])
    source = file_digest(fp32)
    given, blob = None, at_rev(rev, recipe.params_path(kind, "served", {"class": cpu}))
    with tempfile.TemporaryDirectory(prefix="tritonkit-rev-") as tmp:
        if blob is not None:
            (Path(tmp) / "params.npz").write_bytes(blob)
            given = QuantParams.load(Path(tmp) / "params.npz")
            applies, note = given.applies(source, recipe.recipe_digest(entry["recipe"]), recipe.params_origin(kind))
            if not applies:
                log(f"{rev}'s quantization parameters do not apply ({note}): calibrating")
                given = None
        builder = Builder(kind, fp32, committed=None if given is None else (r, given), progress=False,
                          all_methods=False, name=f"{kind.NAME}-served")
        try:
            builder.write(r, out, check=True)
        finally:
            builder.close()
    return r, variant


def served_version(kind, rev: str, root: Path, log=print) -> Path:
    """A version directory `root`/1 holding the INT8 file `rev`'s served recipe builds and, for a packable text
    encoder, its packed form, proven against the served form's test-split gates as `make build` proves it."""
    from tritonkit.int8.gates import packed_proof

    version = Path(root) / "1"
    version.mkdir(parents=True)
    r, variant = served_int8(kind, rev, version / "model.onnx", log)
    log(f"{rev}: {r.describe()} (INT8 served on {variant} there)")
    if getattr(kind, "packable", False):
        fp32 = paths.model_file(kind.FP32_MODEL)
        kind.write_packed(version / "model.onnx", fp32, *packed_proof(kind, fp32, log=log))
    return version
