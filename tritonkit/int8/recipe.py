"""The recipe file, models/<name>.int8.json (+ its quantization parameters, .npz): the INT8 stage's first record.

One reader (`committed_recipes`; `load_recipes` resolves the served entry for a CPU class, its own or a donor's) and
one writer (`write`, after a search). Also where a recipe's parameters live (`params_path`, `quant_params`) and the
marks a built file carries (`mark_recipe`: which recipe built it; `write_fp32_fallback`: why FP32 serves). Two forms
per model:
- served: the fastest form onnxruntime's CPU kernels run (U8S8 or S8S8, as the search finds), speed-gated, one
  entry per CPU INT8 class (envinfo.int8_class);
- tensorrt: symmetric INT8, zero points 0, Q/DQ on weighted ops' inputs (build/artifacts/<model>.trt_qdq.onnx).
"""

from __future__ import annotations

import json
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.int8.records import Recipe
from tritonkit.int8.speed import BF16_COMPETITOR
from tritonkit.serving.marks import PRECISION_PARAMETER

RECIPES = paths.SPECS

FORMS = {"served": ("int8", "uint8"), "tensorrt": ("int8",)}

FALLBACK = "fp32-fallback"


def recipe_path(kind) -> Path:
    """Beside the model's spec file (the recipe is one more of its facts)."""
    file = getattr(getattr(kind, "spec", None), "file", None)
    return (Path(file).parent if file else RECIPES) / f"{kind.NAME}.int8.json"


def params_path(kind, form: str, entry: dict, where: Path | None = None) -> Path:
    """Where the quantization parameters of a form's recipe live (tritonkit.int8.params): beside the recipe, one
    file per served CPU class (the recipes differ per class) and one for the TensorRT form."""
    cls = f"-{entry.get('borrowed_from') or entry.get('class') or envinfo.int8_class()}" if form == "served" else ""
    return (where or recipe_path(kind).parent) / f"{kind.NAME}.int8.{form}{cls}.npz"


def params_origin(kind) -> str:
    """What an FP32 graph is made from, the same on every machine (tritonkit.int8.floor.source)."""
    from tritonkit.int8 import floor

    return floor.source(kind, "int8-params", []) or ""


def quant_params(kind, form: str, entry: dict, fp32: Path, source: str | None = None):
    """(parameters, why not, file): the committed parameters of `entry`'s recipe when they apply to this FP32 graph
    and recipe, else those this machine saved at an earlier build; (None, why, None) without either."""
    from tritonkit.int8.params import QuantParams, file_digest

    source, digest, why = source or file_digest(fp32), recipe_digest(entry["recipe"]), "no quantization parameters"
    for path in (params_path(kind, form, entry), params_path(kind, form, entry, paths.BUILD_OUTPUTS / "int8-params")):
        if path.exists():
            params = QuantParams.load(path)
            applies, note = params.applies(source, digest, params_origin(kind))
            if applies:
                _log(f"{kind.NAME}: {form} INT8 built from the quantization parameters {paths.rel(path)} (no "
                     "calibration)"
                     + (f": {note}" if note else ""))
                return params, None, path
            why = f"{paths.rel(path)} does not apply: {note}"
    return None, why, None


def search_command(kind) -> str:
    return f"python -m tritonkit.build {kind.NAME} --search"


def _log(msg: str) -> None:
    print(f"[int8] {msg}", flush=True)


def committed_candidate(kind, form: str, entry: dict | None, fp32: Path, source: str):
    """(Recipe, QuantParams) a re-search judges first (steps.committed_first): this class's committed recipe for
    `form`, or the accurate candidate its speed gate rejected, with the parameters that build it without a
    calibration pass (a donor's entry, `borrowed_from`: the donor class's). None without one, or where its
    parameters do not apply to this FP32 graph (said)."""
    found = entry and (entry.get("recipe") or (entry.get("accurate") or {}).get("recipe"))
    if not found:
        return None
    given, why, _ = quant_params(kind, form, {"recipe": found, "class": entry.get("borrowed_from")}, fp32, source)
    if given is None:
        _log(f"{kind.NAME} {form}: the committed candidate is not judged first ({why}): searching from the starts")
        return None
    return Recipe.from_json(found), given


def committed_recipes(kind) -> dict | None:
    """The recipe file as committed, its "served" entries keyed by CPU INT8 class (`envinfo.int8_class`). A file
    written before classes holds one served entry: the class of the CPU its "env" names."""
    path = recipe_path(kind)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    served = data.get("served")
    if isinstance(served, dict) and "status" in served:
        env = data.get("env", {})
        data["served"] = {envinfo.int8_class(env.get("cpu_int8_features", [])): {**served, "env": env}}
    return data


def load_recipes(kind, cpu: str | None = None) -> dict | None:
    """The committed recipes with "served" resolved for this CPU's INT8 class (or `cpu`): its own entry, else the
    one searched on another class, marked "borrowed_from". A borrowed recipe's replay re-checks every gate here
    and serves FP32, loudly, where one misses (see replay). This CPU without native bf16 gets its class's
    candidate for such CPUs where there is one (without_bf16)."""
    data = committed_recipes(kind)
    if data is None or not data.get("served"):
        return data
    here = cpu is None
    cpu = cpu or envinfo.int8_class()
    by_class = data["served"]
    if cpu in by_class:
        own = by_class[cpu]
        data["served"] = (here and not envinfo.has_bf16() and without_bf16(own)) or own
    else:
        donor = donor_class(cpu, by_class)
        data["served"] = {**by_class[donor], "borrowed_from": donor}
    return data


def donor_class(cpu: str, by_class: dict) -> str:
    """Whose served entry a class without its own replays: one that found a recipe, then one judged in the
    arithmetic `cpu` computes (VNNI's native int32 sums, or the exact path every other class takes), then the
    nearest in envinfo.CLASSES (an avx512 CPU borrows avx2's recipe, searched on a CPU of its own arithmetic)."""
    order = envinfo.CLASSES

    def distance(c: str) -> int:
        return abs(order.index(c) - order.index(cpu)) if c in order and cpu in order else len(order)

    return min(by_class, key=lambda c: (by_class[c].get("status") != "passed", (c == "vnni") != (cpu == "vnni"),
                                         distance(c), c))


def without_bf16(entry: dict) -> dict | None:
    """What a CPU of the class without native bf16 replays of its class's served `entry`: the search's accurate
    candidate where the speed gate alone rejected it, against FP32 on OpenVINO bf16, which such a CPU cannot run
    (accuracy is the class's, speed this machine's); its replay proves it on the test split and races FP32 as served
    here. None where the entry is no such fallback."""
    accurate = entry.get("accurate")
    if entry.get("status") != FALLBACK or not accurate or entry.get("speed_against") != BF16_COMPETITOR:
        return None
    return {**entry, "recipe": accurate["recipe"], "validation": accurate.get("validation") or {},
            "status": "passed", "without_bf16": True,
            **({"int8_variant": accurate["int8_variant"]} if accurate.get("int8_variant") else {})}


def all_classes_fall_back(kind) -> bool:
    """Every CPU class's committed served search found no INT8 candidate: the INT8 name holds FP32 everywhere."""
    served = (committed_recipes(kind) or {}).get("served") or {}
    return bool(served) and all(e.get("status") == FALLBACK for e in served.values())


PRECISION_KEY = PRECISION_PARAMETER  # ONNX metadata of an FP32 graph under an INT8 name (the backend warns)

RECIPE_KEY = "tritonkit_recipe"  # ONNX metadata of a served INT8 file: the digest of the recipe that built it


def recipe_digest(recipe: dict | None) -> str | None:
    """A short digest of a committed recipe (None: no recipe)."""
    import hashlib

    if recipe is None:
        return None
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def mark_recipe(path: Path, recipe: dict) -> None:
    """Record in `path`'s ONNX metadata which recipe built it, so that a replica can tell whether the file it holds
    is the one its CPU class proved (tritonkit.repository.replica)."""
    import onnx

    model = onnx.load(str(path))
    kept = [(p.key, p.value) for p in model.metadata_props if p.key != RECIPE_KEY]
    del model.metadata_props[:]
    for key, value in [*kept, (RECIPE_KEY, recipe_digest(recipe))]:
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(path))


def file_recipe(path: Path) -> str | None:
    """The recipe digest `mark_recipe` wrote into `path` (None: no file, or not marked)."""
    import onnx

    if not Path(path).exists():
        return None
    meta = onnx.load(str(path), load_external_data=False).metadata_props
    return next((p.value for p in meta if p.key == RECIPE_KEY), None)


def write_fp32_fallback(fp32: Path, out: Path, reason: str) -> None:
    """The FP32 graph, marked in its ONNX metadata, so that the server's log says what it serves on this machine
    even where the committed config cannot (a fallback of this CPU class only)."""
    import onnx

    model = onnx.load(str(fp32))
    del model.metadata_props[:]
    model.metadata_props.add(key=PRECISION_KEY, value=f"fp32-fallback: {reason}")
    onnx.save(model, str(out))


def write(kind, data: dict) -> Path:
    """Commit-ready recipe file of `kind` (its forms in FORMS order)."""
    path = recipe_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**{k: v for k, v in data.items() if k not in FORMS}, **{f: data[f] for f in FORMS if f in data}}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
