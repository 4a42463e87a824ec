"""The INT8 stage as one line of stages, called once per model by `make build` (tritonkit.build.build_int8).

    recipe file ──load──▶ entries (this CPU class's own, or a donor's)      tritonkit.int8.recipe
    (no recipe, or --search: Gates + Budget ──search──▶ SearchResult ──▶ recipe file + Judgement)   this module
    per form:  FP32 file ──gates──▶ Gates (bounds; the floor once, if needed)  tritonkit.int8.gates
               entry + Gates ──build──▶ graph ──judge──▶ Judgement      tritonkit.int8.builder, .judge
               Judgement ──decide──▶ Outcome + report                   tritonkit.int8.decide, .report

Takes the kind, its FP32 file, the runtime variants that serve FP32 and INT8 here, a `Budget` and the build's
measured facts of the FP32 file; returns one `Outcome` per form (with the Gates and Judgement that the packed proof
and the runtime choice reuse, and the report the build writes after them: decide.write_records) and whether it
searched. Nothing here calls back into the build: a searched form hands its Gates and Judgement to its replay in
memory (`Searched`); disk keeps the recipe, the reports and the judgement cache for later builds.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tritonkit import envinfo, fingerprint, paths
from tritonkit.errors import GateError
from tritonkit.int8 import decide, gates, judge, report, search, timing
from tritonkit.int8.budget import AFTER_SEARCH_SHARE, SERVED_SHARE, START_PASSES, Budget
from tritonkit.int8.builder import FewCalibrationBatches, Workspace
from tritonkit.int8.context import SearchContext
from tritonkit.int8.decide import Outcome
from tritonkit.int8.facts import FP32Facts
from tritonkit.int8.gates import Gates
from tritonkit.int8.judge import Judgement
from tritonkit.int8.recipe import (
    FALLBACK,
    FORMS,
    Entry,
    RecipeFile,
    committed_candidate,
    params_origin,
    params_path,
    recipe_digest,
    recipe_path,
    search_command,
)
from tritonkit.int8.recipe import read as read_recipes
from tritonkit.int8.recipe import write as write_recipes
from tritonkit.int8.records import ProbeTimings, Recipe, SearchResult
from tritonkit.serving.runtimes import DEFAULT, MIN_GAIN


@dataclass
class Searched:
    """One form's search, handed to its replay in memory: the gates it judged by and, where it found a recipe, the
    judgement of the graph it found (the replay rebuilds those bytes)."""

    gates: Gates
    judgement: Judgement | None = None


def _log(msg: str) -> None:
    print(f"[int8] {msg}", flush=True)


def trt_qdq_path(kind) -> Path:
    """The TensorRT-form Q/DQ kept beside a served INT8 of another form (read by tritonkit.tensorrt.engines)."""
    return paths.ARTIFACTS / f"{kind.INT8_MODEL}.trt_qdq.onnx"


def outputs(kind) -> dict[str, tuple[Path, str]]:
    """Per form: the file it writes and its fingerprint stage."""
    return {"served": (paths.model_file(kind.INT8_MODEL), "int8"), "tensorrt": (trt_qdq_path(kind), "int8_trt")}


def run(kind, fp32: Path, variants: tuple[str, str], *, forms=FORMS, search: bool = False,
        search_if_missing: bool = False, only: str | None = None, fresh: bool = False, budget: Budget | None = None,
        force: bool = False, progress: bool = True, facts: FP32Facts | None = None) -> tuple[list[Outcome], bool]:
    """The INT8 `forms` of `kind` from its recipe file (searched first with `search`, or where there is none and
    `search_if_missing`), each form built, judged and decided unless up to date; and whether it searched.
    `variants`: the runtime variants (FP32's, INT8's) that serve the models here; a search's served speed gate races
    FP32 as the INT8 name would serve it (tritonkit.int8.speed.fp32_competitor)."""
    from tritonkit.int8.speed import fp32_competitor

    budget, facts = budget or Budget(), facts or FP32Facts(kind, fp32)
    searched_forms: dict[str, Searched] = {}
    recipes = read_recipes(kind)
    if recipes is None and not (search or search_if_missing):
        raise GateError(f"{kind.NAME}: no committed INT8 recipe ({paths.rel(recipe_path(kind))}); run "
                        f"`{search_command(kind)}` (minutes) and commit the file it writes")
    searched = search or recipes is None
    if searched:
        if recipes is None:
            _log(f"{kind.NAME}: no committed recipe ({paths.rel(recipe_path(kind))}): searching")
        only = only if search else None
        against = variants[0]
        if only in (None, "served"):  # the served gate races FP32 as the INT8 name would serve it
            against = fp32_competitor(kind, fp32, variants[0], MIN_GAIN, log=_log)[0]
        # A new model's INT8 file is timed where FP32 runs fastest, not on ONNX Runtime by default (timing.int8_variant
        # falls back to it where the gates miss there): the MiniLM reranker's ran 0.87x on ONNX Runtime, 1.45x on
        # OpenVINO bf16, against FP32 on OpenVINO bf16.
        int8_on = variants[1] or against
        searching = budget.less(AFTER_SEARCH_SHARE * budget.seconds) if budget.bounded else budget
        recipes, searched_forms = search_forms(kind, fp32, progress, searching, only, (against, int8_on), fresh,
                                            facts)
        force = True
    variants = (variants[0], variants[1] or DEFAULT)  # before any record, the INT8 name serves on ONNX Runtime
    outcomes = []
    for form, (out, stage) in outputs(kind).items():
        if form not in forms:
            continue
        entry = recipes.resolved(form)
        extra = json.dumps([entry.to_json(), envinfo.fingerprint(), variants], sort_keys=True) + form + fp32.name
        stamp = fingerprint.stage(kind, "int8", extra)
        rep = report.report_path(kind, form)
        if not force and fingerprint.up_to_date(out, kind.NAME, stage, stamp) and rep.exists():
            status = json.loads(rep.read_text()).get("status", "failed")
            _log(f"{kind.NAME}: {form} INT8 {paths.rel(out)} up to date ({status})")
            outcomes.append(Outcome(form, out, status, []))
            continue
        _log(f"{kind.NAME}: {form} INT8 from {paths.rel(recipe_path(kind))} → {paths.rel(out)}")
        out.parent.mkdir(parents=True, exist_ok=True)
        done = searched_forms.get(form)  # judged by its search in this build: its gates and judgement, in memory
        form_gates = done.gates if done else gates.for_entry(kind, fp32, form, entry, log=_log)
        outcome = decide.replay(kind, fp32, form, entry, out, form_gates, progress, variants,
                                done.judgement if done else None, recipes.env)
        outcomes.append(outcome)
        if outcome.status != "failed":
            fingerprint.stamp(kind.NAME, stage, stamp)
        else:
            fingerprint.unstamp(kind.NAME, stage)
    return outcomes, searched


# -- the search (no recipe yet, or --search) ----------------------------------------------------------------------

def form_cut(kind, fp32: Path, form: str, left_s: float, row_s: float) -> SearchResult | None:
    """The result of a form the budget does not start (None where it fits): its first start (START_PASSES) and, where
    the gates measure it up front (gates.deferrable), its half-precision floor (the FP32 references it needs, then a
    run at its precision; floor.estimate_s) would take more than the `left_s` seconds it has, at `row_s` seconds an
    FP32 row (floor.row_seconds). Estimated rather than cut midway: a floor measured in part is lost."""
    from tritonkit.int8 import floor
    from tritonkit.int8.evaluate import row_count

    precision = floor.PRECISION[form]
    floor_s = 0.0 if gates.deferrable(kind) else floor.estimate_s(kind, fp32, precision, row_s)
    start_s = START_PASSES * row_s * row_count(kind.eval_batches("validation"))
    if floor_s + start_s <= left_s:
        return None
    what = (f"its {precision} floor (about {floor_s:.0f} s) and " if floor_s else "its ") + \
        f"first start (about {start_s:.0f} s)"
    reason = (f"the budget cut the {form} search before it started: {what} would not fit in the {left_s:.0f} s "
              f"it had; search it with `make int8-search MODEL={kind.NAME} FORM={form} MINUTES=<m>`")
    cut = {"stage": "form", "what": what, "estimate_s": round(floor_s + start_s, 1), "left_s": round(left_s, 1),
           "reserve_s": 0.0, "at_s": 0.0}
    return SearchResult("/".join(FORMS[form]), None, {}, {}, {}, [], [], [], 0.0, False, reason, [cut])


def form_share(kind, fp32: Path, form: str, left_s: float, fraction: float, row_s: float
               ) -> tuple[SearchResult | None, float]:
    """(form_cut's result on the form's `fraction` of the `left_s` seconds of the search's budget, the fraction it
    searches with). The served form serves every CPU replica: where its first start fits the whole budget but not
    its share, it takes the TensorRT form's share too (`make int8-search FORM=tensorrt` searches that one alone)."""
    cut = form_cut(kind, fp32, form, left_s * fraction, row_s)
    if cut is None or form != "served" or fraction >= 1.0 or form_cut(kind, fp32, form, left_s, row_s) is not None:
        return cut, fraction
    _log(f"{kind.NAME}: the served form's first start does not fit its {fraction:.0%} share of the search budget: "
         "it takes the TensorRT form's too")
    return None, 1.0


def speed_probe(kind, fp32: Path, forms, workspace: Workspace, speed_variants: tuple[str, str], progress: bool,
                form_gates: Gates) -> tuple[SearchResult | None, ProbeTimings]:
    """The served form's result where no INT8 graph can meet its speed gate (timing.speed_probe, by `form_gates`'
    speed gate), before its floor is measured or anything calibrated, else None; and what the probe timed, which the
    search does not time again."""
    t0 = time.perf_counter()
    # exact as the search judges: off VNNI a start onnxruntime's exact path cannot open is rejected, not timed
    probe = SearchContext(FewCalibrationBatches(kind), fp32, forms, check_speed=True, progress=progress, log=_log,
                          workspace=workspace.graphs_only(), speed_variants=speed_variants,
                          exact=judge.exact_judgement(), gates=form_gates)
    ceiling = timing.speed_probe(probe)
    if ceiling is None:
        return None, probe.probed
    return SearchResult("/".join(forms), None, {}, {}, ceiling[1], [], [], [], round(time.perf_counter() - t0, 1),
                        False, ceiling[0]), probe.probed


def search_forms(kind, fp32: Path, progress: bool = True, budget: Budget | None = None, only: str | None = None,
                 speed_variants: tuple[str, str] = ("onnxruntime", "onnxruntime"), fresh: bool = False,
                 facts: FP32Facts | None = None) -> tuple[RecipeFile, dict[str, Searched]]:
    """Search both forms (or `only` one, keeping the other's committed recipe and log) within `budget`; write the
    recipe file, the quantization parameters and the full search report; returns the recipe file as written and, per
    searched form, what its replay reuses (`Searched`: its gates and its found recipe's judgement,
    also kept by tritonkit.int8.judge for later builds). `speed_variants`: the runtime variants that serve the FP32
    and INT8 models here, which the speed gate times. Each form judges its committed candidate first
    (steps.committed_first) unless `fresh`."""
    from tritonkit.export import write_json
    from tritonkit.int8.params import file_digest

    t0, budget, facts = time.perf_counter(), budget or Budget(), facts or FP32Facts(kind, fp32)
    searched: dict[str, Searched] = {}
    out = RecipeFile(kind.EXPORT.name, time.strftime("%Y-%m-%d"), envinfo.fingerprint(),
                     keys=("model", "created", "env", "search_seconds", *FORMS))
    full: dict = {}
    cpu = envinfo.int8_class()
    committed = read_recipes(kind)
    others = {c: e for c, e in (committed or RecipeFile()).served.items() if c != cpu}
    if others:
        _log(f"{kind.NAME}: keeping the served recipes of other CPU INT8 classes ({', '.join(others)}); this CPU "
             f"is {cpu} (re-search those on such a CPU after a model, data or dependency change)")
    if only is not None:
        if only not in FORMS:
            raise GateError(f"form: '{only}' is not one of {', '.join(FORMS)}")
        log = report.REPORTS / f"{kind.NAME}_int8_search.json"
        if committed is None:
            raise GateError(f"form: searching only '{only}' needs a committed recipe for the other form "
                            f"({paths.rel(recipe_path(kind))}); run `{search_command(kind)}` first")
        old = json.loads(log.read_text()).get("search", {}) if log.exists() else {}
        for form in FORMS:
            if form != only:  # kept as committed, with the environment that searched it
                if form == "served":
                    out.served = committed.served
                else:
                    out.tensorrt = committed.tensorrt.searched_env_first(committed.env)
                if form in old:
                    full[form] = old[form]
    source = file_digest(fp32)
    workspace = Workspace()  # the TensorRT form reuses the served search's graphs, ranges and references
    exact = judge.exact_judgement()
    both = only is None
    try:
        for form, forms in FORMS.items():
            if only is not None and form != only:
                continue
            _log(f"{kind.NAME}: searching the {form} form ({'/'.join(forms)})")
            own = None if committed is None else committed.served.get(cpu) if form == "served" else committed.tensorrt
            candidate = None if fresh else committed_candidate(kind, form, own, fp32, source)
            result, probed = None, None
            # The form's gates, once: the probe's speed gate, the search's and the replay's; a floor waits for a
            # judgement that needs it (or, where the kind cannot wait, for the search to start).
            form_gates = gates.for_form(kind, fp32, form, log=_log, defer=True)
            if form == "served" and candidate is None:  # a committed candidate is judged first instead
                result, probed = speed_probe(kind, fp32, forms, workspace, speed_variants, progress, form_gates)
            fraction = SERVED_SHARE if form == "served" and both else 1.0
            if result is None and budget.bounded:
                result, fraction = form_share(kind, fp32, form, max(budget.left(), 1.0), fraction, facts.row_s())
            if result is not None:
                form_gates.unmeasured(f"not measured: {result.reason}")
                _log(f"{kind.NAME}: {result.reason}")
            else:
                if not gates.deferrable(kind):  # measured up front, inside what form_cut counted for it
                    form_gates.resolve()
                share = budget.share(fraction)  # after an up-front floor
                searcher = SearchContext(kind, fp32, forms, check_speed=form == "served", budget=share,
                                         progress=progress, log=_log, workspace=workspace, exact=exact,
                                         gates=form_gates, speed_variants=speed_variants, committed=candidate,
                                         probed=probed, facts=facts)
                result = search.run(searcher)
            full[form] = result.to_json()
            # Committed beside the recipe (or the candidate CPUs without bf16 replay): replays skip calibration.
            kept = result.recipe or (Recipe.from_json(result.accurate["recipe"]) if result.accurate else None)
            if kept is not None:
                saved = searcher.builder.quant_params(kept, recipe_digest(kept.to_json()), params_origin(kind),
                                                      source).save(params_path(kind, form, cpu))
                _log(f"{kind.NAME} {form}: quantization parameters -> {paths.rel(saved)} (commit it)")
            elif (stale := params_path(kind, form, cpu)).exists():  # an earlier recipe's: unread now
                stale.unlink()
                _log(f"{kind.NAME} {form}: removed {paths.rel(stale)} (no recipe to replay)")
            judged = None
            if result.recipe is not None and result.digest:  # the replay rebuilds these bytes: it reuses this
                judged = judge.record(judge.Judgement(
                    result.digest, form, exact, judge.context(kind, fp32), result.test,
                    result.speed if form == "served" else {},
                    [speed_variants[0], result.int8_variant] if form == "served" else [], by="search"))
            searched[form] = Searched(form_gates, judged)
            entry = Entry.made(
                recipe=result.recipe.to_json() if result.recipe else None,
                **({"speed_against": speed_variants[0]} if form == "served" else {}),
                **({"int8_variant": result.int8_variant} if result.int8_variant else {}),
                status="passed" if result.passed else FALLBACK, reason=result.reason,
                search_seconds=result.seconds, validation=result.validation, test=result.test,
                floor=form_gates.floor, **({"accurate": result.accurate} if result.accurate else {}),
                env=envinfo.fingerprint())
            # The served form runs on this CPU's INT8 kernels: one entry per class. TensorRT's runs on a GPU.
            if form == "served":
                out.served = {**others, cpu: entry}
            else:
                out.tensorrt = entry
            found = f"recipe {result.recipe.describe()}" if result.recipe else f"FAILED: {result.reason}"
            _log(f"{kind.NAME} {form}: {found} ({result.seconds:.0f} s)")
    finally:
        workspace.close()
    out.search_seconds = round(time.perf_counter() - t0, 1)
    path = write_recipes(kind, out)
    write_json(report.REPORTS / f"{kind.NAME}_int8_search.json", {**out.to_json(), "search": full})
    _log(f"{kind.NAME}: recipe -> {paths.rel(path)} (commit it); search log -> "
         f"build/reports/{kind.NAME}_int8_search.json")
    return out, searched

