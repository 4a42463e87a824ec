"""INT8 for one model spec: search a recipe (or replay the committed one), prove it, report it, or fall back.

The searched recipe is data, committed at models/<name>.int8.json beside the model's other facts: an ordinary
build replays it (quantize from its committed parameters, seconds), re-checks every gate on the test split and at
the served batch sizes, and writes build/reports/<name>_int8.json (+ .md). `--search` re-runs the search (after a
model, data or dependency change). Two forms per model:
- served: the fastest form onnxruntime's CPU kernels run (U8S8 or S8S8, as the search finds), speed-gated;
- tensorrt: symmetric INT8, zero points 0, Q/DQ on weighted ops' inputs (build/artifacts/<model>.trt_qdq.onnx).
A model whose search found nothing that passes is served as FP32 under its INT8 name, loudly; a committed recipe
that no longer passes here fails the build, naming the gate.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.errors import GateError
from tritonkit.int8.pages import render_markdown
from tritonkit.int8.search import (
    BF16_COMPETITOR,
    MIN_TENSORRT_INT8_SHARE,
    Evaluator,
    FewCalibrationBatches,
    Recipe,
    Search,
    SearchResult,
    Workspace,
    speedup,
)
from tritonkit.kinds.gates import missed
from tritonkit.serving.marks import PRECISION_PARAMETER
from tritonkit.serving.runtimes import DEFAULT

RECIPES = paths.SPECS
REPORTS = paths.REPORTS
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


def report_path(kind, form: str = "served") -> Path:
    return REPORTS / f"{kind.NAME}_int8{'' if form == 'served' else '_trt'}.json"


def search_command(kind) -> str:
    return f"python -m tritonkit.build {kind.NAME} --search"


def exact_judgement(form: str) -> bool:
    """Whether a form's accuracy is judged in a session that asks for exact int32 sums (evaluate.session(exact=True)):
    wherever this CPU's u8s8 kernels do not sum exactly (no VNNI). Both forms are then judged in the arithmetic
    every served session computes on every class, as TensorRT sums too; with VNNI the plain session is that."""
    return not envinfo.int8_sums_exact()


def _log(msg: str) -> None:
    print(f"[int8] {msg}", flush=True)


# -- search --------------------------------------------------------------------------------------------------

# A whole search of one model (both forms) by default: a new model's `make build` ends within it on 2 cores.
DEFAULT_BUDGET_S = 15 * 60
# The served form's share when both forms are searched: it serves every CPU replica; TensorRT's form gets the rest
# (it reuses the served search's graphs, calibrations and references, so it needs less).
SERVED_SHARE = 2 / 3


# A build that searches spends its model's budget before the search (export) and after it (replays, packing, the
# runtime choice): perf/bench_new_model.py's 4-layer encoder, 2026-11-27, spent 25 s before and 199 s after (22 % of
# 15 min). The search gets the budget less what came before and this share, so the whole build keeps the budget.
AFTER_SEARCH_SHARE = 0.25
# What a form's first start costs (its calibration pass and its sample's scoring) in FP32 passes over the validation
# split: MPNet's took 190 s where a pass takes ~150 s (2-core Xeon, 2026-11-28). A form whose floor and first start
# would not fit in its share of the budget is not searched (form_cut).
START_PASSES = 1.3


def search_budget_s(budget_s: float | None, elapsed_s: float) -> float | None:
    """What a build's INT8 search may spend of its model's `budget_s` once the build has spent `elapsed_s`, keeping
    AFTER_SEARCH_SHARE of it for the steps after the search. At least a second: form_cut decides what starts in it."""
    if budget_s is None:
        return None
    return max(budget_s * (1 - AFTER_SEARCH_SHARE) - elapsed_s, 1.0)


def form_budget_s(budget_s: float | None, elapsed_s: float, form: str, both: bool) -> float | None:
    """What one form's search may spend of a model's `budget_s` after `elapsed_s` (floors, an earlier form): the
    served form SERVED_SHARE of it when the TensorRT form comes after, the TensorRT form all that is left. At least
    a second: form_cut decides whether the form starts in it."""
    if budget_s is None:
        return None
    left = budget_s - elapsed_s
    return max(left * SERVED_SHARE if form == "served" and both else left, 1.0)


def form_cut(kind, fp32: Path, form: str, left_s: float, row_s: float) -> SearchResult | None:
    """The result of a form the budget does not start (None where it fits): its half-precision floor (the FP32
    references it needs, then a run at its precision; floor.estimate_s) and its first start (START_PASSES) would
    take more than the `left_s` seconds it has, at `row_s` seconds an FP32 row (floor.row_seconds). Estimated rather
    than cut midway: a floor measured in part is lost."""
    from tritonkit.int8 import floor
    from tritonkit.int8.evaluate import row_count

    precision = floor.PRECISION[form]
    floor_s = floor.estimate_s(kind, fp32, precision, row_s)
    start_s = START_PASSES * row_s * row_count(kind.eval_batches("validation"))
    if floor_s + start_s <= left_s:
        return None
    what = f"its {precision} floor (about {floor_s:.0f} s) and first start (about {start_s:.0f} s)"
    reason = (f"the budget cut the {form} search before it started: {what} would not fit in the {left_s:.0f} s "
              f"it had; search it with `make int8-search MODEL={kind.NAME} FORM={form} MINUTES=<m>`")
    cut = {"stage": "form", "what": what, "estimate_s": round(floor_s + start_s, 1), "left_s": round(left_s, 1),
           "reserve_s": 0.0, "at_s": 0.0}
    return SearchResult("/".join(FORMS[form]), None, {}, {}, {}, [], [], [], 0.0, False, reason, [cut])


def speed_probe(kind, fp32: Path, forms, workspace: Workspace, speed_variants: tuple[str, str], progress: bool
                ) -> SearchResult | None:
    """The served form's result where no INT8 graph can meet its speed gate (Search.speed_probe), before its floor
    is measured or anything calibrated; None where one might."""
    t0 = time.perf_counter()
    probe = Search(FewCalibrationBatches(kind), fp32, forms, check_speed=True, progress=progress, log=_log,
                   workspace=workspace.graphs_only(), speed_variants=speed_variants)
    ceiling = probe.speed_probe()
    if ceiling is None:
        return None
    return SearchResult("/".join(forms), None, {}, {}, ceiling[1], [], [], [], round(time.perf_counter() - t0, 1),
                        False, ceiling[0])


def search(kind, fp32: Path, progress: bool = True, budget_s: float | None = DEFAULT_BUDGET_S,
           only: str | None = None, speed_variants: tuple[str, str] = (DEFAULT, DEFAULT), fresh: bool = False) -> dict:
    """Search both forms (or `only` one, keeping the other's committed recipe and log) within `budget_s` in all
    (None: unbounded); write the committed recipe file and the full search report; returns the recipe data.
    `speed_variants`: the runtime variants that serve the FP32 and INT8 models here, which the speed gate times.
    Each form judges its committed candidate first (Search.committed_first) unless `fresh`."""
    from tritonkit.export import write_json
    from tritonkit.int8 import floor
    from tritonkit.int8.params import file_digest

    t0 = time.perf_counter()
    out: dict = {"model": kind.EXPORT.name, "created": time.strftime("%Y-%m-%d"), "env": envinfo.fingerprint()}
    full: dict = {}
    cpu = envinfo.int8_class()
    committed = committed_recipes(kind) or {}
    others = {c: e for c, e in committed.get("served", {}).items() if c != cpu}
    if others:
        _log(f"{kind.NAME}: keeping the served recipes of other CPU INT8 classes ({', '.join(others)}); this CPU "
             f"is {cpu} (re-search those on such a CPU after a model, data or dependency change)")
    if only is not None:
        if only not in FORMS:
            raise GateError(f"form: '{only}' is not one of {', '.join(FORMS)}")
        kept, log = committed or None, REPORTS / f"{kind.NAME}_int8_search.json"
        if kept is None:
            raise GateError(f"form: searching only '{only}' needs a committed recipe for the other form "
                            f"({paths.rel(recipe_path(kind))}); run `{search_command(kind)}` first")
        old = json.loads(log.read_text()).get("search", {}) if log.exists() else {}
        for form in FORMS:
            if form != only:  # kept as committed, with the environment that searched it
                out[form] = kept[form] if form == "served" else {"env": kept.get("env", {}), **kept[form]}
                if form in old:
                    full[form] = old[form]
    source = file_digest(fp32)
    workspace = Workspace()  # the TensorRT form reuses the served search's graphs, ranges and references
    row_s = None  # FP32 seconds a row here (floor.row_seconds), measured once where a budget needs it
    try:
        for form, forms in FORMS.items():
            if only is not None and form != only:
                continue
            _log(f"{kind.NAME}: searching the {form} form ({'/'.join(forms)})")
            own = committed.get(form, {}).get(cpu) if form == "served" else committed.get(form)
            candidate = None if fresh else committed_candidate(kind, form, own, fp32, source)
            result = None
            if form == "served" and candidate is None:  # a committed candidate is judged first instead
                result = speed_probe(kind, fp32, forms, workspace, speed_variants, progress)
            left = form_budget_s(budget_s, time.perf_counter() - t0, form, only is None)
            if result is None and left is not None:
                row_s = row_s if row_s is not None else floor.row_seconds(kind, fp32)
                result = form_cut(kind, fp32, form, left, row_s)
            if result is not None:
                half = {"precision": floor.PRECISION[form], "unavailable": f"not measured: {result.reason}"}
                _log(f"{kind.NAME}: {result.reason}")
            else:
                half = form_floor(kind, fp32, form)
                searcher = Search(kind, fp32, forms, check_speed=form == "served",
                                  budget_s=form_budget_s(budget_s, time.perf_counter() - t0, form, only is None),
                                  progress=progress, log=_log, workspace=workspace, exact=exact_judgement(form),
                                  floor=half, speed_variants=speed_variants, committed=candidate)
                result = searcher.run()
            full[form] = result.to_json()
            # Committed beside the recipe (or the candidate CPUs without bf16 replay): replays skip calibration.
            kept = result.recipe or (Recipe.from_json(result.accurate["recipe"]) if result.accurate else None)
            if kept is not None:
                saved = searcher.quant_params(kept, recipe_digest(asdict(kept)), params_origin(kind)).save(
                    params_path(kind, form, {"class": cpu}))
                _log(f"{kind.NAME} {form}: quantization parameters -> {paths.rel(saved)} (commit it)")
            elif (stale := params_path(kind, form, {"class": cpu})).exists():  # an earlier recipe's: unread now
                stale.unlink()
                _log(f"{kind.NAME} {form}: removed {paths.rel(stale)} (no recipe to replay)")
            entry = {
                "recipe": asdict(result.recipe) if result.recipe else None,
                **({"speed_against": speed_variants[0]} if form == "served" else {}),
                **({"int8_variant": result.int8_variant} if result.int8_variant else {}),
                "status": "passed" if result.passed else FALLBACK,
                "reason": result.reason,
                "search_seconds": result.seconds,
                "validation": result.validation,
                "test": result.test,
                "floor": half,
                **({"accurate": result.accurate} if result.accurate else {}),
                "env": envinfo.fingerprint(),
            }
            # The served form runs on this CPU's INT8 kernels: one entry per class. TensorRT's runs on a GPU.
            out[form] = {**others, cpu: entry} if form == "served" else entry
            found = f"recipe {result.recipe.describe()}" if result.recipe else f"FAILED: {result.reason}"
            _log(f"{kind.NAME} {form}: {found} ({result.seconds:.0f} s)")
    finally:
        workspace.close()
    out = {**{k: v for k, v in out.items() if k not in FORMS}, **{f: out[f] for f in FORMS if f in out}}
    out["search_seconds"] = round(time.perf_counter() - t0, 1)  # forms in FORMS order, whichever was searched
    path = recipe_path(kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    write_json(REPORTS / f"{kind.NAME}_int8_search.json", {**out, "search": full})
    _log(f"{kind.NAME}: recipe -> {paths.rel(path)} (commit it); search log -> "
         f"build/reports/{kind.NAME}_int8_search.json")
    return load_recipes(kind)


def committed_candidate(kind, form: str, entry: dict | None, fp32: Path, source: str):
    """(Recipe, QuantParams) a re-search judges first (Search.committed_first): this class's committed recipe for
    `form`, or the accurate candidate its speed gate rejected, with the parameters that build it without a
    calibration pass. None without one, or where its parameters do not apply to this FP32 graph (said)."""
    found = entry and (entry.get("recipe") or (entry.get("accurate") or {}).get("recipe"))
    if not found:
        return None
    given, why, _ = quant_params(kind, form, {"recipe": found}, fp32, source)
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
        donor = "vnni" if "vnni" in by_class else sorted(by_class)[0]
        data["served"] = {**by_class[donor], "borrowed_from": donor}
    return data


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


def served_label(name: str) -> str:
    """What model `name`'s INT8 name serves, for labels: "INT8", or "FP32 fallback" when the build here served the
    FP32 graph under the INT8 name (its report says so), else when the committed served-form search found none."""
    from tritonkit import kinds

    kind = kinds.get(name)
    report = report_path(kind)
    if report.exists():
        status = json.loads(report.read_text()).get("status")
    else:
        status = (load_recipes(kind) or {}).get("served", {}).get("status")
    return "FP32 fallback" if status == FALLBACK else "INT8"


def floor_summary(name: str) -> str:
    """One line on the served form's gates, from this build's report: INT8's test-split result beside the
    half-precision floor and the gate it set, or why the FP32 graph is served, with the floor beside."""
    from tritonkit import kinds

    kind = kinds.get(name)
    path = report_path(kind)
    if not path.exists():
        return "no INT8 report yet"
    report = json.loads(path.read_text())
    half = report.get("floor") or {}
    floor_test = half.get("test", {})
    bounds = {g["metric"]: g.get("test", g["value"]) for g in report.get("gates", [])}
    cells = []
    for t in kind.TARGETS:
        got = report.get("test", {}).get(t.metric)
        cell = t.metric + (f" {got:.4f}" if got is not None else "")
        if t.metric in floor_test:
            cell += f" (floor {floor_test[t.metric]:.4f}, gate {bounds.get(t.metric, t.value):.4f})"
        cells.append(cell)
    if "test" in half:
        where = f"beside the {half['precision']} floor"
    else:
        where = f"absolute gates ({half.get('unavailable') or 'a report from before floors: rebuild'})"
    if report.get("status") == FALLBACK:
        return f"no INT8 candidate met its gates ({report.get('reason', '')[:160]}); {where}: " + "; ".join(cells)
    return f"INT8, test split, {where}: " + "; ".join(cells)


def all_classes_fall_back(kind) -> bool:
    """Every CPU class's committed served search found no INT8 candidate: the INT8 name holds FP32 everywhere."""
    served = (committed_recipes(kind) or {}).get("served") or {}
    return bool(served) and all(e.get("status") == FALLBACK for e in served.values())


# -- replay + gates ------------------------------------------------------------------------------------------

@dataclass
class Outcome:
    form: str
    path: Path
    status: str  # "passed", FALLBACK, or "failed" (a committed recipe that misses a gate here)
    missed: list[str]


def form_floor(kind, fp32: Path, form: str) -> dict:
    """The FP32 graph's metrics at the half precision `form` competes with (tritonkit.int8.floor), logged."""
    from tritonkit.int8 import floor

    half = floor.measure(kind, fp32, floor.PRECISION[form])
    if "unavailable" in half:
        _log(f"{kind.NAME}: no {half['precision']} floor for the {form} form: {half['unavailable']}; absolute gates")
    else:
        _log(f"{kind.NAME}: {form} form's {half['precision']} floor (test split): "
             + ", ".join(f"{t.metric} {half['test'].get(t.metric, float('nan')):.4f}" for t in kind.TARGETS))
    return half


def replay(kind, fp32: Path, form: str, data: dict, out: Path, progress: bool = True,
           speed_variants: tuple[str, str] = (DEFAULT, DEFAULT)) -> Outcome:
    """Build `out` from the committed recipe and prove it on both splits; FP32 goes there when the search failed."""
    from tritonkit.int8.checks import artefact_int8_share, quantized_ops
    from tritonkit.int8.params import file_digest
    from tritonkit.int8.quantize import quantize_with_params

    entry = data[form]
    report: dict = {"model": kind.EXPORT.name, "form": form, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "recipe_file": paths.rel(recipe_path(kind)), "env": envinfo.fingerprint(),
                    "search_env": data.get("env", {}), "search": _search_summary(kind, form)}
    from tritonkit.int8 import floor

    recorded = entry.get("floor") or {}
    # A fallback proves nothing against the floor: the one its search recorded stands (a budget-cut search has none).
    half = form_floor(kind, fp32, form) if entry["recipe"] is not None else \
        (recorded or {"precision": floor.PRECISION[form], "unavailable": "not measured (no recipe)"})
    if "unavailable" in half and "test" in recorded:
        # The floor is the FP32 graph's, not this CPU's: where it cannot be measured here (bf16 is emulated on every
        # CPU; a converted graph may not load), the one recorded with the recipe stands rather than absolute gates.
        _log(f"{kind.NAME}: using the {recorded['precision']} floor recorded with the recipe ({half['unavailable']})")
        half = {**recorded, "recorded": f"measured where the recipe was searched; here: {half['unavailable']}"}
    targets = {split: floor.targets(kind, floor.split_floor(half, split)) for split in ("validation", "test")}
    report["floor"] = half
    # One row per gate: the absolute bound, the floor-judged bound of each split, and the catastrophe bounds.
    report["gates"] = [{**asdict(t), "absolute": next((a.value for a in kind.TARGETS if a.metric == t.metric), None),
                        "validation": t.value, "test": targets["test"][i].value}
                       for i, t in enumerate(targets["validation"])]
    if form == "served":
        report["gates"].append({**asdict(kind.SPEED_TARGET)})
    borrowed, here, candidate = entry.get("borrowed_from"), envinfo.int8_class(), entry.get("without_bf16")
    if borrowed:
        report["recipe_cpu"] = f"searched on a {borrowed} CPU; this one is {here}"
    if candidate:
        report["recipe_cpu"] = (f"the {here} search's accurate candidate, which lost its speed race to FP32 on "
                                f"{BF16_COMPETITOR} there; this CPU has no native bf16")

    def fall_back(reason: str) -> Outcome:
        write_fp32_fallback(fp32, out, reason)
        report.update(status=FALLBACK, passed=False, served="fp32", reason=reason)
        _write_report(kind, form, report)
        _loud(f"{kind.NAME}: no INT8 candidate met every gate ({reason}); {paths.rel(out)} is the FP32 model, "
              f"served under the INT8 model's name")
        return Outcome(form, out, FALLBACK, [])

    if entry["recipe"] is None:
        return fall_back(entry.get("reason", ""))
    recipe = Recipe.from_json(entry["recipe"])
    quant = recipe.to_quant(kind.WEIGHT_OPS, name=f"{kind.NAME}-{form}")
    t0 = time.perf_counter()
    tmp = out.with_name(out.name.removesuffix(".onnx") + ".quant.onnx")
    fp32_digest = file_digest(fp32)  # read once: both the lookup and the parameters' record need it
    given, why, source = quant_params(kind, form, entry, fp32, fp32_digest)
    used = quantize_with_params(fp32, tmp, quant, kind.calibration_batches, kind.calibration_batch_count(), progress,
                                given, recipe_digest(entry["recipe"]), params_origin(kind), fp32_digest)
    if given is None:  # kept for the next build here; committing it makes every machine's replay skip calibration
        built = used.save(params_path(kind, form, entry, paths.BUILD_OUTPUTS / "int8-params"))
        _log(f"{kind.NAME}: calibrated ({why}); its parameters -> {paths.rel(built)}")
    calib_s = time.perf_counter() - t0
    report["quantization_parameters"] = paths.rel(source) if given is not None else f"calibrated: {why}"
    # The held-out test split is the proof here; the validation split chose the recipe, and its numbers are the
    # search's (recorded with the recipe): measuring it again would double a replay's time and prove nothing new.
    metrics = {"test": Evaluator(kind, fp32, "test").metrics(tmp, exact=exact_judgement(form)),
               "validation": entry.get("validation") or {}}
    speed: dict = {}
    if form == "served":
        speed_variants = (replay_competitor(kind, entry, speed_variants[0]), speed_variants[1])
        speed = speedup(kind, fp32, tmp, kind.SPEED_BATCHES, variants=speed_variants,
                        separate_from=kind.SPEED_TARGET.value)
    miss = [f"test: {m}" for m in missed(targets["test"], metrics["test"])]
    if form == "served" and not kind.SPEED_TARGET.met(speed):
        miss += missed([kind.SPEED_TARGET], speed)
    share = artefact_int8_share(tmp, kind.WEIGHT_OPS)
    if form == "tensorrt" and share < MIN_TENSORRT_INT8_SHARE:  # GPU speed is not measurable here; compute is
        miss.append(f"int8_mac_share {share:.3f} < {MIN_TENSORRT_INT8_SHARE:.3f}: the FP16 plan would be faster")
    # Accuracy is the class's, speed this machine's (two CPUs of one class differ, e.g. with and without AMX): a
    # served recipe that misses only its speed gate here serves FP32, loudly, rather than failing the build.
    slow_here = form == "served" and not any(m.startswith("test: ") for m in miss)
    # borrowed: no recipe was ever searched for this CPU's kernels; a candidate: its class served FP32 all along
    if miss and (borrowed or slow_here or candidate):
        tmp.unlink()
        report.update(recipe=entry["recipe"], recipe_summary=recipe.describe(), validation=metrics["validation"],
                      test=metrics["test"], speed=speed, missed_here=miss)
        if borrowed:
            return fall_back(f"the served recipe was searched on a {borrowed} CPU and misses here, on a "
                             f"{here} CPU ({'; '.join(miss)}); search this CPU's with "
                             f"`make int8-search MODEL={kind.NAME} FORM=served` and commit it")
        report["speed_variants"] = list(speed_variants)
        if candidate:
            return fall_back(f"the {here} search's accurate candidate, replayed for a CPU without native bf16, "
                             f"misses here ({'; '.join(miss)}); FP32 serves")
        return fall_back(f"the served recipe holds its accuracy gates here but not its speed gate against FP32 on "
                         f"{speed_variants[0]} ({'; '.join(miss)}): FP32 serves faster on this machine")
    mark_recipe(tmp, entry["recipe"])
    tmp.replace(out)
    report.update(status="passed" if not miss else "failed", passed=not miss, served="int8", missed=miss,
                  recipe=entry["recipe"], recipe_summary=recipe.describe(), validation=metrics["validation"],
                  test=metrics["test"], speed=speed, speed_variants=list(speed_variants) if speed else None,
                  int8_mac_share=round(share, 4), quantized_ops=quantized_ops(out),
                  quantize_s=round(calib_s, 1))
    _write_report(kind, form, report)
    return Outcome(form, out, report["status"], miss)


def replay_competitor(kind, entry: dict, served: str) -> str:
    """The FP32 variant a replay's speed gate races: the one its recipe was searched against (`speed_against`),
    unless this CPU cannot run it (bf16 without native bf16), then `served`, the FP32 model's variant here."""
    against = entry.get("speed_against")
    if against is None:
        if envinfo.has_bf16():
            _log(f"{kind.NAME}: this recipe was raced against FP32 on {served} only; here the INT8 name could serve "
                 f"the FP32 file on {BF16_COMPETITOR} instead (`python perf/bench_bf16_race.py {kind.NAME}` times "
                 "both; a search here races it, for the whole CPU class)")
        return served
    if against == BF16_COMPETITOR and not envinfo.has_bf16():
        return served
    return against


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


def _search_summary(kind, form: str) -> dict:
    """The search's steps and float units, from its report when this machine ran it."""
    path = REPORTS / f"{kind.NAME}_int8_search.json"
    if not path.exists():
        return {"note": f"search report not on this machine; re-run with `{search_command(kind)}`"}
    full = json.loads(path.read_text())["search"].get(form, {})
    return {k: full.get(k) for k in ("steps", "sensitivity", "best_failed", "seconds", "speed", "cuts", "walls")}


def _loud(msg: str) -> None:
    bar = "!" * 100
    print(f"{bar}\n[int8] WARNING: {msg}\n{bar}", file=sys.stderr, flush=True)


def _write_report(kind, form: str, report: dict) -> None:
    from tritonkit.export import write_json

    path = report_path(kind, form)
    write_json(path, report)
    path.with_suffix(".md").write_text(render_markdown(report))
    print(render_markdown(report), flush=True)


# -- reading reports back (serve, demo, docs) ----------------------------------------------------------------

def served_problems(kind) -> list[str]:
    """Why the served INT8 model of `kind` must not be served here (empty: fine). FP32 fallback is allowed."""
    path = report_path(kind)
    fix = f"run `make build` (replays models/{kind.NAME}.int8.json) or `{search_command(kind)}`"
    if not path.exists():
        return [f"{kind.NAME}: no INT8 report ({paths.rel(path)}); {fix}"]
    report = json.loads(path.read_text())
    if report.get("status") == FALLBACK:
        return []
    problems = []
    if not report.get("passed"):
        problems.append(f"{kind.NAME}: INT8 missed {', '.join(report.get('missed', [])) or 'its gates'}; "
                        f"re-run the search: `{search_command(kind)}`")
    diffs = envinfo.differences(report.get("env", {}))
    if diffs:
        problems.append(f"{kind.NAME}: INT8 report was made with {'; '.join(diffs)}; {fix}")
    return problems


def check_all(names: list[str] | None = None) -> list[str]:
    """Problems of every registered model's served INT8 (empty: all may be served)."""
    from tritonkit import kinds

    return [p for name in (names or kinds.names()) for p in served_problems(kinds.get(name))]


README_MARKERS = ("<!-- int8-results:begin (python -m tritonkit.int8.recipe docs) -->", "<!-- int8-results:end -->")


def docs_page(cpu: str) -> Path:
    """The full reports of one CPU INT8 class: docs/int8.md for VNNI (the reference machine), docs/int8-<class>.md
    for the others."""
    return paths.ROOT / "docs" / ("int8.md" if cpu == "vnni" else f"int8-{cpu}.md")


def _class_tables(block: str) -> dict[str, str]:
    """CPU class -> its table in README's INT8 block (each starts with a "CPU INT8 class `x`" line)."""
    import re

    heads = list(re.finditer(r"^CPU INT8 class `(\w+)`", block, flags=re.M))
    return {m.group(1): block[m.start(): heads[i + 1].start() if i + 1 < len(heads) else len(block)].strip()
            for i, m in enumerate(heads)}


def docs(readme: Path = paths.ROOT / "README.md", out: Path | None = None) -> Path:
    """This CPU class's page of full reports (docs_page) and its table in README's INT8 block, from
    build/reports/; the other classes' tables stay as their machines wrote them."""
    import hashlib

    from tritonkit import kinds

    cpu = envinfo.int8_class()
    out = out or docs_page(cpu)

    lock = paths.ROOT / "requirements.lock"
    lock_id = f"requirements.lock sha256 {hashlib.sha256(lock.read_bytes()).hexdigest()[:12]}" if lock.exists() \
        else "no lock file"
    env = envinfo.fingerprint()
    head = (f"Regenerated by `python -m tritonkit.int8.recipe docs` from build/reports/ on "
            f"{time.strftime('%Y-%m-%d')}; environment {lock_id}; CPU INT8 features "
            f"{', '.join(env['cpu_int8_features']) or 'none'} ({env['machine']}).")
    pages, rows = [f"# INT8 results\n\n{head}\n"], []
    for name in kinds.names():
        kind = kinds.get(name)
        for form in FORMS:
            path = report_path(kind, form)
            if not path.exists():
                continue
            report = json.loads(path.read_text())
            page = render_markdown(report, brief=True).replace("# ", "## ", 1)
            if not (report.get("search") or {}).get("steps"):  # the search's log is history: git keeps it
                page += (f"\n_This build replayed the committed recipe ({paths.rel(recipe_path(kind))}); the "
                         f"search that made it is in the git history of {paths.rel(out)}._\n")
            pages.append(page)
            test, half = report.get("test", {}), (report.get("floor") or {}).get("test", {})
            bounds = {g["metric"]: g.get("test", g["value"]) for g in report.get("gates", [])}
            # Result, then the floor and the bound it sets (a bare result: no floor on this CPU, absolute gates).
            accuracy = ", ".join(f"{t.metric} {test[t.metric]:.4f}"
                                 + (f" ({half[t.metric]:.4f}, {bounds.get(t.metric, t.value):.4f})"
                                    if t.metric in half else "") for t in kind.TARGETS if t.metric in test)
            speed = report.get("speed", {}).get("int8_speedup")
            rows.append(f"| {kind.NAME} | {form} | {report['status']} | `{report.get('recipe_summary', 'FP32')}` | "
                        f"{accuracy or '-'} | {f'{speed:.2f}x' if speed else '-'} |")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(pages))
    page = paths.rel(out)
    table = "\n".join([f"CPU INT8 class `{cpu}`. {head}", "",
                       "| model | form | status | recipe | test split: INT8 (half-precision floor, gate) | "
                       "INT8 vs FP32 (slowest batch) |",
                       "|---|---|---|---|---|---|", *rows, "", f"Full reports and the search steps: [{page}]({page})."])
    text = readme.read_text()
    begin, end = README_MARKERS
    if begin in text and end in text:
        tables = _class_tables(text[text.index(begin) + len(begin): text.index(end)])
        tables[cpu] = table
        block = "\n\n".join(tables[c] for c in sorted(tables, key=lambda c: (c != "vnni", c)))
        text = text[: text.index(begin) + len(begin)] + "\n" + block + "\n" + text[text.index(end):]
        readme.write_text(text)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.recipe", description="INT8 gates and reports")
    sub = parser.add_subparsers(dest="cmd", required=True)
    check = sub.add_parser("check", help="refuse (exit 2) an INT8 model that must not be served here")
    check.add_argument("models", nargs="*", help="build targets (default: all)")
    sub.add_parser("docs", help="regenerate this CPU class's INT8 page (docs/int8.md for VNNI) and README table")
    args = parser.parse_args(argv)
    if args.cmd == "docs":
        print(f"wrote {paths.rel(docs())}")
        return 0
    problems = check_all(args.models or None)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
