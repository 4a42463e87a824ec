"""Per replica: what each spec'd model serves on this CPU, and a view of the repository that serves just that.

The repository records on which CPU INT8 classes (tritonkit.envinfo.int8_class) each INT8 file and runtime config
were proven: a class's own served entry in models/<name>.int8.json (its search and gates ran on that class) and
its own entry in models/<name>.runtime.json (its runtime timed and gated there). The INT8 file in a repository
carries the digest of the recipe that built it (tritonkit.int8.recipe.mark_recipe). The rule, `decide`:

- a spec's INT8 model (and its fused model) serves its INT8 file on the class's recorded runtime when that class
  has its own passed recipe, that recipe built the file here, and its own runtime record; where the class's search
  found no INT8 (status fp32-fallback), its FP32 file on the class's recorded runtime;
- where the recorded runtime computes in bf16 and this CPU has none: the INT8 file on ONNX Runtime (the arithmetic
  its gates judged) when it is the class's proven file, or the class's candidate for such CPUs built and proven by
  a build on one (tritonkit.int8.recipe.without_bf16: the accurate candidate that lost its race only to bf16);
- otherwise that model's FP32 file on ONNX Runtime, under the same name, loudly;
- an FP32 model serves on its class's recorded runtime, else ONNX Runtime. Another class's record is never used.

`record()` collects those facts for every class and renders the configs each choice serves (it needs the specs
and Triton's config schema). `view()` applies a record on one CPU with the standard library only: a directory of
links to the repository's files plus the chosen configs, with `tritonkit_int8_served` ("1"/"0") on each INT8-named
model, which its stub publishes as the gauge `tritonkit_int8_served{model}`. Nothing committed is rewritten. The
NGC views carry their record in RECORD, read by the container's supervisor (tritonkit.runtime.supervisor).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tritonkit import envinfo
from tritonkit.errors import ReplicaError
from tritonkit.serving.marks import INT8_SERVED_PARAMETER, PRECISION_PARAMETER

RECORD = "tritonkit-replicas.json"  # a file, not a folder: Triton takes only folders for models
FALLBACK = "fp32"
_VIEW_MARK = ".tritonkit-replica-view"


@dataclass(frozen=True)
class Decision:
    model: str
    role: str  # "int8", "fp32" or "fused"
    cpu_class: str
    option: str  # the class whose record is served, or FALLBACK
    int8: bool  # the INT8 graph is served
    variant: str  # runtime variant (tritonkit.serving.runtimes.VARIANTS)
    reason: str
    without_bf16: bool = False  # the class's option for CPUs without native bf16 (its "without_bf16" entry)

    @property
    def loud(self) -> bool:
        """An INT8-named model serving FP32."""
        return self.role != "fp32" and not self.int8


def decide(entry: dict, model: str, cpu_class: str, bf16: bool) -> Decision:
    """What `model` (its `record()` entry) serves on a CPU of `cpu_class`, with or without native bf16."""
    role, own = entry["role"], entry["classes"].get(cpu_class) or {}
    why = own.get("missing") or f"nothing recorded for CPU class {cpu_class} (recorded: " \
                                f"{', '.join(sorted(entry['classes'])) or 'none'})"
    if own.get("variant"):
        variant = own["variant"]
        if own.get("needs_bf16") and not bf16:
            why = f"{variant}, recorded for {cpu_class}, computes in bf16 and this CPU has no native bf16"
            free = own.get("without_bf16") or {}
            if free.get("variant"):
                return Decision(model, role, cpu_class, cpu_class, True, free["variant"],
                                f"INT8 proven on {cpu_class}, on {free['variant']} ({why})", True)
            why += f"; {free['missing']}" if free.get("missing") else ""
        elif role == "fp32":
            return Decision(model, role, cpu_class, cpu_class, False, variant, f"{variant}, measured on {cpu_class}")
        elif own.get("status") == "passed":
            here = f" by this machine's build ({own['proven_here']})" if own.get("proven_here") else ""
            return Decision(model, role, cpu_class, cpu_class, True, variant,
                            f"INT8 proven on {cpu_class}{here}, on {variant}")
        elif own.get("proven_here"):
            return Decision(model, role, cpu_class, cpu_class, False, variant,
                            f"another class's INT8 recipe misses its gates on this machine ({own['proven_here']}); "
                            f"FP32 on {variant}")
        else:
            return Decision(model, role, cpu_class, cpu_class, False, variant,
                            f"the {cpu_class} INT8 search found no candidate that meets its gates; FP32 on {variant}")
    variant = entry["fallback"]["variant"]
    if role == "fp32":
        return Decision(model, role, cpu_class, FALLBACK, False, variant, f"{variant}: {why}")
    return Decision(model, role, cpu_class, FALLBACK, False, variant, f"FP32 on {variant}: {why}")


def served_option(entry: dict, decision: Decision) -> dict:
    """The option of `entry` (a `record()` model) that `decision` serves: its files, configs and variant."""
    if decision.option == FALLBACK:
        return entry["fallback"]
    own = entry["classes"][decision.option]
    return own["without_bf16"] if decision.without_bf16 else own


def _pbtxt_string(text: str) -> str:
    return json.dumps(text.replace("\n", " "), ensure_ascii=True)  # a JSON string is a valid protobuf text string


def _marks(decision: Decision) -> str:
    """Config parameters appended to an INT8-named model's config: the gauge's value and, for FP32, why."""
    lines = [f'parameters {{ key: "{INT8_SERVED_PARAMETER}" value {{ string_value: "{int(decision.int8)}" }} }}']
    if not decision.int8:
        why = f"CPU class {decision.cpu_class}: {decision.reason}"
        lines.append(f'parameters {{ key: "{PRECISION_PARAMETER}" value {{ string_value: {_pbtxt_string(why)} }} }}')
    return "\n".join(lines) + "\n"


def this_cpu() -> tuple[str, bool]:
    return envinfo.int8_class(), envinfo.has_bf16()


def view(source: Path, dest: Path, record: dict, cpu_class: str | None = None, bf16: bool | None = None
         ) -> list[Decision]:
    """Write at `dest` the repository a replica on `cpu_class` (default: this CPU, envinfo) serves from `source`:
    every model folder with its entries linked, the recorded models' configs as `decide` chooses, the FP32 model's
    version folders where an INT8 name serves FP32. Returns the decisions, one per recorded model."""
    source, dest = Path(source).resolve(), Path(dest)
    here, native_bf16 = this_cpu()
    cpu_class, bf16 = cpu_class or here, native_bf16 if bf16 is None else bf16
    if dest.exists() and any(dest.iterdir()) and not (dest / _VIEW_MARK).exists():
        raise ReplicaError(f"{dest} exists and is not a replica view; not writing into it")
    dest.mkdir(parents=True, exist_ok=True)
    (dest / _VIEW_MARK).write_text(f"{source}\n")
    decisions = []
    for folder in sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith(".")):
        out = dest / folder.name
        if out.is_symlink() or out.is_file():
            out.unlink()
        out.mkdir(exist_ok=True)
        entry = record.get("models", {}).get(folder.name)
        decision = option = None
        files_from = folder
        if entry is not None:
            decision = decide(entry, folder.name, cpu_class, bf16)
            option = served_option(entry, decision)
            files_from = source / option["files_from"]
            if not files_from.is_dir():
                raise ReplicaError(f"{folder.name}: the record serves files of {option['files_from']}, which "
                                   f"{source} does not hold")
            decisions.append(decision)
        for child in folder.iterdir():
            if child.name.startswith(".") or (option is not None and child.name in ("config.pbtxt", "configs")):
                continue
            target = files_from / child.name if child.name.isdigit() else child
            _link(target, out / child.name)
        if option is None:
            continue
        for rel, text in option["configs"].items():
            path = out / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            marks = _marks(decision) if decision.role != "fp32" and option.get("marks", True) else ""
            path.write_text(f"# A replica's view (tritonkit.repository.replica), CPU class {cpu_class}: "
                            f"{_pbtxt_string(decision.reason)[1:-1]}\n{text}{marks}")
    return decisions


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() or link.exists():
        link.unlink()
    os.symlink(target.resolve(), link)


def read_record(repository: Path) -> dict | None:
    path = Path(repository) / RECORD
    return json.loads(path.read_text()) if path.exists() else None


def describe(decisions: list[Decision]) -> list[str]:
    """One line per decision, loud (a bar of '!') where an INT8 name serves FP32."""
    lines = []
    for d in decisions:
        if d.loud:
            bar = "!" * 100
            lines += [bar, f"WARNING: {d.model} SERVES FP32 on this CPU (class {d.cpu_class}): {d.reason}", bar]
        else:
            lines.append(f"replica ({d.cpu_class}): {d.model}: {d.reason}")
    return lines


# -- collecting the record (the build side: specs and Triton's config schema) ----------------------------------

def _configs(folder: Path) -> dict[str, str]:
    files = [folder / "config.pbtxt", *sorted((folder / "configs").glob("*.pbtxt"))]
    return {p.relative_to(folder).as_posix(): p.read_text() for p in files if p.exists()}


def _render(kind, folder: Path, variant: str, onnx_from: str | None, native) -> dict[str, str]:
    """`folder`'s config and profiles served as `variant` (threads kept; the other variants' parameters dropped),
    a fused model reading `onnx_from`'s file, in the repository's form (`native`: an NGC view's converter)."""
    from tritonkit.repository import runtime_choice
    from tritonkit.repository.config import check_config, parse_config, to_pbtxt
    from tritonkit.serving.runtimes import VARIANTS

    runtime = VARIANTS[variant][0]
    out = {}
    for rel, text in _configs(folder).items():
        cfg = parse_config(text, folder.name)
        runtime_choice.serve_on(runtime)(cfg)
        for key in {k for _, params in VARIANTS.values() for k, _ in params} | {PRECISION_PARAMETER,
                                                                               INT8_SERVED_PARAMETER}:
            if key in cfg.parameters:
                del cfg.parameters[key]
        for key, value in runtime_choice.variant_parameters(kind, variant).items():
            cfg.parameters[key].string_value = value
        if cfg.backend == "python":
            if onnx_from is not None:
                cfg.parameters["onnx_model"].string_value = f"../{onnx_from}/1/model.onnx"
        elif runtime == "openvino":
            cfg.default_model_filename = "model.onnx"  # Triton's openvino default is model.xml
        else:
            cfg.ClearField("default_model_filename")
        if native is not None:
            native(cfg)
        check_config(cfg)
        header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
        out[rel] = header + to_pbtxt(cfg)
    return out


def _option(configs: dict[str, str], **facts) -> dict:
    # The native openvino backend hands every parameter to OpenVINO, which refuses names it does not know.
    embedded = facts.pop("embedded")
    marks = embedded or not any('backend: "openvino"' in text for text in configs.values())
    return {**facts, "configs": configs, "marks": marks}


def _recorded(kind, recipes: dict, runtimes: dict, cpu: str, model: str, gated: bool
              ) -> tuple[object, str | None, str | None]:
    """(served recipe entry, runtime variant, why not) that `cpu`'s own records give `model` (gated: an INT8-named
    model, which needs that class's own INT8 search too)."""
    served = recipes.get(cpu)  # a tritonkit.int8.recipe.Entry, or None
    variant = runtimes.get(cpu, {}).get("models", {}).get(model, {}).get("runtime")
    if gated and not served:
        return served, variant, f"no INT8 search ran on CPU class {cpu} (models/{kind.NAME}.int8.json)"
    if variant is None:
        return served, variant, f"no runtime measured on CPU class {cpu} (models/{kind.NAME}.runtime.json)"
    return served, variant, None


def int8_classes(kind) -> dict[str, str]:
    """CPU class -> runtime variant, for the classes whose own records prove `kind`'s INT8 model (passed search and
    measured runtime; whether a repository's file is the proven one is `record`'s check)."""
    from tritonkit.int8 import recipe
    from tritonkit.repository import runtime_choice

    recipes = (recipe.read(kind) or recipe.RecipeFile()).served
    runtimes = runtime_choice.load(kind)["classes"]
    out = {}
    for cpu in sorted(recipes):
        served, variant, missing = _recorded(kind, recipes, runtimes, cpu, kind.INT8_MODEL, True)
        if not missing and served.status == "passed":
            out[cpu] = variant
    return out


def _local(kind, repository: Path, recipes: dict, runtimes: dict) -> tuple[dict, dict, str | None]:
    """`recipes` and `runtimes` with this machine's proof for its CPU class added (tritonkit.int8.proof), where the
    class has no committed served entry and the proof speaks for the repository's INT8 file; and its file."""
    from tritonkit import envinfo
    from tritonkit.int8 import proof as proofs
    from tritonkit.int8.recipe import Entry

    cpu = envinfo.int8_class()
    if cpu in recipes:
        return recipes, runtimes, None
    made, _ = proofs.valid(kind, Path(repository) / kind.INT8_MODEL / "1" / "model.onnx")
    if made is None:
        return recipes, runtimes, None
    recipes = {**recipes, cpu: Entry(made.recipe, made.status)}
    models = {**runtimes.get(cpu, {}).get("models", {}), kind.INT8_MODEL: {"runtime": made.variant}}
    return recipes, {**runtimes, cpu: {**runtimes.get(cpu, {}), "models": models}}, str(proofs.path(kind))


def record(kinds: list, repository: Path, native=None, local: bool = False) -> dict:
    """For every spec'd model in `repository`: per CPU class what its records prove, with the configs each choice
    serves (`native`: the NGC view's config converter, tritonkit.repository.variants.native_form). `local`: this
    machine's proofs count too, for its own CPU class (the embedded server's view; never a committed one)."""
    from tritonkit.int8 import recipe
    from tritonkit.repository import runtime_choice
    from tritonkit.serving.runtimes import DEFAULT, needs_bf16

    repository = Path(repository)
    models: dict[str, dict] = {}
    for kind in kinds:
        committed = (recipe.read(kind) or recipe.RecipeFile()).served
        recipes, runtimes = committed, runtime_choice.load(kind)["classes"]
        proven_here = None
        if local:
            recipes, runtimes, proven_here = _local(kind, repository, recipes, runtimes)
        built_with = recipe.file_recipe(repository / kind.INT8_MODEL / "1" / "model.onnx")
        where = f"models/{kind.NAME}"
        for model, role in ((kind.INT8_MODEL, "int8"), (kind.FP32_MODEL, "fp32"), (f"{kind.NAME}_fused", "fused")):
            folder = repository / model
            if not (folder / "config.pbtxt").exists() or not re.search(
                    r'^backend: "(onnxruntime|openvino|python)"', (folder / "config.pbtxt").read_text(), re.M):
                continue  # not generated here, or a TensorRT plan (GPUs: tritonkit.tensorrt)
            measured = kind.FP32_MODEL if role == "fp32" else kind.INT8_MODEL  # a fused model runs INT8's file
            fp32_files = model if role != "int8" else kind.FP32_MODEL
            classes: dict[str, dict] = {}
            for cpu in sorted(set(recipes) | set(runtimes)):
                served, variant, missing = _recorded(kind, recipes, runtimes, cpu, measured, role != "fp32")
                if not missing and role != "fp32" and served.status == "passed" and \
                        recipe.recipe_digest(served.recipe) != built_with:
                    missing = (f"the INT8 file here was not built from the recipe proven on {cpu} ({where}.int8.json;"
                               f" `make build MODEL={kind.NAME}` on such a CPU builds it)")
                if missing:
                    classes[cpu] = {"missing": missing}
                    continue
                int8 = role != "fp32" and served.status == "passed"
                onnx_from = (kind.INT8_MODEL if int8 else kind.FP32_MODEL) if role == "fused" else None
                classes[cpu] = _option(_render(kind, folder, variant, onnx_from, native), embedded=native is None,
                                       variant=variant, needs_bf16=needs_bf16(variant),
                                       status=None if role == "fp32" else served.status,
                                       files_from=model if int8 or role == "fp32" else fp32_files,
                                       **({"proven_here": proven_here} if proven_here and role != "fp32" and
                                          cpu not in committed
                                          else {}))
                candidate = recipe.without_bf16(served) if role != "fp32" and not int8 else None
                if needs_bf16(variant) and (int8 or candidate is not None):
                    built = int8 or recipe.recipe_digest(candidate.recipe) == built_with
                    classes[cpu]["without_bf16"] = _without_bf16(kind, folder, model, role, variant, native, cpu, built)
            fallback = _render(kind, folder, DEFAULT, kind.FP32_MODEL if role == "fused" else None, native)
            models[model] = {"spec": kind.NAME, "role": role, "classes": classes,
                             "fallback": _option(fallback, embedded=native is None, variant=DEFAULT,
                                                 files_from=fp32_files)}
    return {"models": models}


def _without_bf16(kind, folder: Path, model: str, role: str, variant: str, native, cpu: str, built: bool) -> dict:
    """A class's option for its CPUs without native bf16, whose INT8 name runs on `variant` in bf16: the INT8 file on
    ONNX Runtime (serving.runtimes.without_bf16: the arithmetic the accuracy gates judged), when the file here is the
    class's proven one or the accurate candidate its search kept (`built`: a build on such a CPU replays and proves
    that, tritonkit.int8.recipe.load_recipes), else why not."""
    from tritonkit.serving.runtimes import without_bf16  # lazily: the container's supervisor imports this module

    if not built:
        return {"missing": (f"the INT8 file here is not the {cpu} candidate for CPUs without native bf16 "
                            f"(`make build MODEL={kind.NAME}` on such a CPU builds and proves it)")}
    free = without_bf16(variant)
    onnx_from = kind.INT8_MODEL if role == "fused" else None
    return _option(_render(kind, folder, free, onnx_from, native), embedded=native is None, variant=free,
                   needs_bf16=False, status="passed", files_from=model)


def write_record(repository: Path, data: dict) -> Path:
    path = Path(repository) / RECORD
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path
