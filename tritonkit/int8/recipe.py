"""The recipe file, models/<name>.int8.json (+ its quantization parameters, .npz): the INT8 stage's first record.

One reader (`read`) and one writer (`write`) of `RecipeFile`, whose entries are `Entry` records; `resolved` picks a
form's entry for a CPU class (its own or a donor's). Also where a recipe's parameters live (`params_path`,
`quant_params`) and the marks a built file carries (`mark_recipe`: which recipe built it; `write_fp32_fallback`: why
FP32 serves). Two forms per model:
- served: the fastest form onnxruntime's CPU kernels run (U8S8 or S8S8, as the search finds), speed-gated, one
  entry per CPU INT8 class (envinfo.int8_class);
- tensorrt: symmetric INT8, zero points 0, Q/DQ on weighted ops' inputs (build/artifacts/<model>.trt_qdq.onnx).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.int8.records import Recipe
from tritonkit.int8.speed import BF16_COMPETITOR
from tritonkit.serving.marks import PRECISION_PARAMETER

RECIPES = paths.SPECS

FORMS = {"served": ("int8", "uint8"), "tensorrt": ("int8",)}

FALLBACK = "fp32-fallback"

@dataclass
class Entry:
    """One entry of the recipe file: a form's search (the served form's: one CPU class's) and what it found.
    `borrowed_from` and `without_bf16` are set by `resolved` for this CPU, never written."""

    recipe: dict | None = None
    status: str = FALLBACK
    reason: str = ""
    speed_against: str | None = None  # the FP32 variant its speed gate raced (served form)
    int8_variant: str | None = None  # the variant its INT8 file held its gates on (timing.int8_variant)
    search_seconds: float | None = None
    validation: dict = field(default_factory=dict)
    test: dict = field(default_factory=dict)
    floor: dict | None = None
    accurate: dict | None = None  # the accurate candidate its speed gate rejected (without_bf16 replays it)
    speed: dict | None = None  # an adopted proof's timings (tritonkit.build.adopt_proof)
    proven_from: str | None = None  # the donor class an adopted proof replayed
    env: dict | None = None
    borrowed_from: str | None = None
    without_bf16: bool = False
    # The keys the file holds, in its order: what a rewrite writes back, byte for byte.
    keys: tuple[str, ...] = ()

    @classmethod
    def made(cls, **values) -> Entry:
        """An entry holding `values`, written in their order."""
        return cls(**values, keys=tuple(values))

    @classmethod
    def from_json(cls, data: dict) -> Entry:
        known = {f.name for f in fields(cls)} - {"keys"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"recipe entry: unknown keys {sorted(unknown)}")
        return cls(**data, keys=tuple(data))

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.keys}

    def but(self, **values) -> Entry:
        """This entry with `values` set (new keys written after its own)."""
        return replace(self, **values, keys=(*self.keys, *(k for k in values if k not in self.keys)))

    def searched_env_first(self, env: dict) -> Entry:
        """The entry stamped with the environment that searched it (`env` where it names none), that key first: how
        a search of the other form keeps a TensorRT entry."""
        return replace(self, env=self.env if "env" in self.keys else env,
                       keys=("env", *(k for k in self.keys if k != "env")))

    @property
    def found(self) -> dict | None:
        """The recipe a re-search judges first: the entry's, or the accurate candidate its speed gate rejected."""
        return self.recipe or (self.accurate or {}).get("recipe")


@dataclass
class RecipeFile:
    """The recipe file: its search's header and, per form, its entries (the served form's keyed by CPU INT8 class)."""

    model: str | None = None
    created: str | None = None
    env: dict = field(default_factory=dict)
    search_seconds: float | None = None
    served: dict[str, Entry] = field(default_factory=dict)
    tensorrt: Entry | None = None
    keys: tuple[str, ...] = ()  # as the file holds them, in its order

    def to_json(self) -> dict:
        def one(k: str):
            value = getattr(self, k)
            if k == "served":
                return {c: e.to_json() for c, e in value.items()}
            return value.to_json() if isinstance(value, Entry) else value

        return {k: one(k) for k in self.keys}

    def resolved(self, form: str, cpu: str | None = None) -> Entry | None:
        """`form`'s entry for this CPU's INT8 class (or `cpu`): the served form's own entry, else the one searched on
        another class, marked `borrowed_from`. A borrowed recipe's replay re-checks every gate here and serves FP32,
        loudly, where one misses (tritonkit.int8.decide). This CPU without native bf16 gets its class's candidate
        for such CPUs where there is one (without_bf16)."""
        if form != "served":
            return self.tensorrt
        if not self.served:
            return None
        here = cpu is None
        cpu = cpu or envinfo.int8_class()
        if cpu in self.served:
            own = self.served[cpu]
            return (here and not envinfo.has_bf16() and without_bf16(own)) or own
        donor = donor_class(cpu, self.served)
        return self.served[donor].but(borrowed_from=donor)


def recipe_path(kind) -> Path:
    """Beside the model's spec file (the recipe is one more of its facts)."""
    file = getattr(getattr(kind, "spec", None), "file", None)
    return (Path(file).parent if file else RECIPES) / f"{kind.NAME}.int8.json"


def read(kind) -> RecipeFile | None:
    """The recipe file as committed (None: none), its served entries keyed by CPU INT8 class. A file written before
    classes holds one served entry: the class of the CPU its "env" names. The file's one reader."""
    path = recipe_path(kind)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    served = data.get("served")
    if isinstance(served, dict) and "status" in served:
        env = data.get("env", {})
        data["served"] = {envinfo.int8_class(env.get("cpu_int8_features", [])): {**served, "env": env}}
    values = {**data, "served": {c: Entry.from_json(e) for c, e in (data.get("served") or {}).items()},
              "tensorrt": Entry.from_json(data["tensorrt"]) if data.get("tensorrt") else None}
    return RecipeFile(**values, keys=tuple(data))


def write(kind, recipes: RecipeFile) -> Path:
    """Commit-ready recipe file of `kind`, its keys in the order it holds them. The file's one writer."""
    path = recipe_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipes.to_json(), indent=2) + "\n")
    return path


def load_recipes(kind, cpu: str | None = None) -> dict[str, Entry] | None:
    """Each form's committed entry resolved for this CPU's INT8 class (or `cpu`; RecipeFile.resolved); None without
    a recipe file."""
    recipes = read(kind)
    if recipes is None:
        return None
    return {form: e for form in FORMS if (e := recipes.resolved(form, cpu)) is not None}


def params_path(kind, form: str, cpu: str | None = None, where: Path | None = None) -> Path:
    """Where the quantization parameters of a form's recipe live (tritonkit.int8.params): beside the recipe, one
    file per served CPU class (`cpu`, default this one's: the recipes differ per class) and one for the TensorRT
    form."""
    cls = f"-{cpu or envinfo.int8_class()}" if form == "served" else ""
    return (where or recipe_path(kind).parent) / f"{kind.NAME}.int8.{form}{cls}.npz"


def params_origin(kind) -> str:
    """What an FP32 graph is made from, the same on every machine (tritonkit.int8.floor.source)."""
    from tritonkit.int8 import floor

    return floor.source(kind, "int8-params", []) or ""


def quant_params(kind, form: str, recipe: dict, cpu: str | None, fp32: Path, source: str | None = None):
    """(parameters, why not, file): the committed parameters of `recipe`, searched on CPU class `cpu` (default
    this one), when they apply to this FP32 graph and recipe, else those this machine saved at an earlier build;
    (None, why, None) without either."""
    from tritonkit.int8.params import QuantParams, file_digest

    source, digest, why = source or file_digest(fp32), recipe_digest(recipe), "no quantization parameters"
    for path in (params_path(kind, form, cpu), params_path(kind, form, cpu, paths.BUILD_OUTPUTS / "int8-params")):
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


def committed_candidate(kind, form: str, entry: Entry | None, fp32: Path, source: str):
    """(Recipe, QuantParams) a re-search judges first (steps.committed_first): this class's committed recipe for
    `form`, or the accurate candidate its speed gate rejected, with the parameters that build it without a
    calibration pass (a donor's entry, `borrowed_from`: the donor class's). None without one, or where its
    parameters do not apply to this FP32 graph (said)."""
    found = entry and entry.found
    if not found:
        return None
    given, why, _ = quant_params(kind, form, found, entry.borrowed_from, fp32, source)
    if given is None:
        _log(f"{kind.NAME} {form}: the committed candidate is not judged first ({why}): searching from the starts")
        return None
    return Recipe.from_json(found), given


def donor_class(cpu: str, by_class: dict[str, Entry]) -> str:
    """Whose served entry a class without its own replays: one that found a recipe, then one judged in the
    arithmetic `cpu` computes (VNNI's native int32 sums, or the exact path every other class takes), then the
    nearest in envinfo.CLASSES (an avx512 CPU borrows avx2's recipe, searched on a CPU of its own arithmetic)."""
    order = envinfo.CLASSES

    def distance(c: str) -> int:
        return abs(order.index(c) - order.index(cpu)) if c in order and cpu in order else len(order)

    return min(by_class, key=lambda c: (by_class[c].status != "passed", (c == "vnni") != (cpu == "vnni"),
                                         distance(c), c))


def without_bf16(entry: Entry) -> Entry | None:
    """What a CPU of the class without native bf16 replays of its class's served `entry`: the search's accurate
    candidate where the speed gate alone rejected it, against FP32 on OpenVINO bf16, which such a CPU cannot run
    (accuracy is the class's, speed this machine's); its replay proves it on the test split and races FP32 as served
    here. None where the entry is no such fallback."""
    accurate = entry.accurate
    if entry.status != FALLBACK or not accurate or entry.speed_against != BF16_COMPETITOR:
        return None
    return entry.but(recipe=accurate["recipe"], validation=accurate.get("validation") or {}, status="passed",
                     without_bf16=True,
                     **({"int8_variant": accurate["int8_variant"]} if accurate.get("int8_variant") else {}))


def all_classes_fall_back(kind) -> bool:
    """Every CPU class's committed served search found no INT8 candidate: the INT8 name holds FP32 everywhere."""
    served = (read(kind) or RecipeFile()).served
    return bool(served) and all(e.status == FALLBACK for e in served.values())


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
