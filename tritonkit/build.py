"""Build model artefacts: export + validate (FP32 ONNX) → calibrated INT8 Q/DQ → accuracy report.

    python -m tritonkit.build {text,image,all} [--force] [--skip-int8] [--search]

Artefacts go to model_repository/<model>/1/model.onnx (gitignored); reports to build/reports/<name>_*.json.
INT8 comes from the committed recipe models/<name>.int8.json (tritonkit.int8.recipe): the served form goes to
model_repository/<INT8_MODEL>, the TensorRT form to build/artifacts/<INT8_MODEL>.trt_qdq.onnx, which
tritonkit.tensorrt.engines compiles into TensorRT plans. `--search` (or a missing recipe) runs the accuracy-aware search
first (tritonkit.int8.search). Exit status 1 when a committed recipe misses a gate here; a model whose search found
nothing is served as FP32 (exit 0, with a warning).
A step is skipped when its artefact exists and the fingerprint of everything it depends on (spec module,
export/quantize/search code, data, recipe, package versions and CPU features) is unchanged; `--force` rebuilds.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tritonkit import fingerprint, kinds, paths
from tritonkit.int8 import pipeline
from tritonkit.int8.budget import AFTER_SEARCH_SHARE, DEFAULT_BUDGET_S, Budget
from tritonkit.int8.decide import Outcome, write_records
from tritonkit.int8.facts import FP32Facts
from tritonkit.int8.recipe import FALLBACK, FORMS

REPORTS = paths.REPORTS


@dataclass
class BuildResult:
    name: str
    fp32: Path
    int8: Path | None
    built: list[str]
    int8_status: str | None = None  # "passed", "fp32-fallback" or "failed"
    # The TensorRT-form Q/DQ (symmetric INT8), compiled by tritonkit.tensorrt.engines.
    trt_int8: Path | None = None
    outcomes: list = field(default_factory=list)


trt_qdq_path = pipeline.trt_qdq_path


def _log(msg: str) -> None:
    print(f"[build] {msg}", flush=True)


def build_fp32(kind, force: bool = False, progress: bool = True) -> tuple[Path, bool]:
    from tritonkit.export import export_onnx, validate_onnx, write_json

    path = paths.model_file(kind.FP32_MODEL)
    stamp = fingerprint.stage(kind, "fp32")
    if not force and fingerprint.up_to_date(path, kind.NAME, "fp32", stamp):
        _log(f"{kind.NAME}: FP32 {paths.rel(path)} up to date")
        return path, False
    _log(f"{kind.NAME}: exporting {kind.EXPORT.name} → {paths.rel(path)}")
    t0 = time.perf_counter()
    module = kind.EXPORT.loader()
    tmp = path.with_name("model.export.onnx")
    export_onnx(kind.EXPORT, tmp, module=module)
    # Validate before installing it, so a failed export never replaces a good model.
    result = validate_onnx(kind.EXPORT, tmp, module=module, progress=progress)
    tmp.replace(path)
    write_json(REPORTS / f"{kind.NAME}_export.json", {**result.to_json(), "seconds": time.perf_counter() - t0})
    _log(
        f"{kind.NAME}: validated {result.samples} samples on {result.grid_points} shapes: "
        f"{result.metric} min {result.summary['min']:.6f} (tolerance {result.tolerance})"
    )
    fingerprint.stamp(kind.NAME, "fp32", stamp)
    return path, True


def build_int8(kind, fp32: Path, variants: tuple[str, str], force: bool = False, progress: bool = True,
               run_search: bool = False, search_if_missing: bool = False,
               search_budget_s: float | None = DEFAULT_BUDGET_S, search_form: str | None = None,
               forms: Sequence[str] = FORMS, started: float | None = None, fresh: bool = False,
               facts: FP32Facts | None = None) -> tuple[list[Outcome], bool]:
    """The INT8 `forms` (tritonkit.int8.pipeline: from the committed recipe, searched first with run_search, or if
    there is none and search_if_missing: `make build` does that for a new model; library callers get an error
    instead), and whether it searched. `variants`: the runtime variants (FP32's, INT8's) that serve the models here
    (runtime_choice.served_variants), which its speed gates race. `search_budget_s`: the whole build's, from
    `started` (time.perf_counter; default now). `fresh`: the search does not judge the committed candidates first.
    `facts`: the build's measured facts of the FP32 file (tritonkit.int8.facts), handed on to the runtime choice."""
    return pipeline.run(kind, fp32, variants, forms=forms, search=run_search,
                        search_if_missing=search_if_missing, only=search_form, fresh=fresh,
                        budget=Budget.of(search_budget_s, start=started), force=force, progress=progress,
                        facts=facts)


def build_packed(kind, model_path: Path, fp32: Path | None = None, force: bool = False, twin: Path | None = None,
                 gates=None) -> Path | None:
    """The packed form of a text encoder's graph (tritonkit.serving.packing), re-made when its source graph changes;
    `fp32` for an INT8 graph, which is proven against the spec's gates instead of against itself padded. `twin`: the
    FP32 graph an FP32 fallback under the INT8 name was written from; its packed form, with the fallback's marks,
    is this one's (the same graph: nothing to pack or prove again; MPNet's takes ~45 s). `gates`: the served
    form's (tritonkit.int8.gates), as the INT8 build judged the graph: not measured again."""
    from tritonkit.serving import packing

    if not getattr(kind, "packable", False) or not model_path.exists():
        return None
    out = packing.packed_path(model_path)
    stage = f"packed.{model_path.parent.parent.name}"
    digest = hashlib.sha256(model_path.read_bytes()).hexdigest() + Path(inspect.getfile(packing)).read_text() + \
        str(fp32)
    stamp = fingerprint.stage(kind, stage, digest)
    if not force and fingerprint.up_to_date(out, kind.NAME, stage, stamp):
        return out
    if twin is not None and packing.packed_path(twin).exists():
        import onnx

        packed = onnx.load(str(packing.packed_path(twin)))
        marks = {p.key: p.value for p in onnx.load(str(model_path), load_external_data=False).metadata_props}
        onnx.helper.set_model_props(packed, {**{p.key: p.value for p in packed.metadata_props}, **marks})
        onnx.save(packed, str(out))
        _log(f"{kind.NAME}: packed form {paths.rel(out)} (its FP32 twin's, with the fallback's marks)")
        fingerprint.stamp(kind.NAME, stage, stamp)
        return out
    judge, reference = None, None
    if fp32 is not None:  # an INT8 graph: the spec's gates judged against its served-form floor on the test split
        from tritonkit.int8.gates import packed_proof

        judge, reference = packed_proof(kind, fp32, gates, log=_log)  # the replay's reference, when it ran here
    try:
        kind.write_packed(model_path, fp32, judge, reference)
    except packing.PackingError as err:  # the backend then runs padded length buckets, as before
        _log(f"{kind.NAME}: no packed form of {paths.rel(model_path)}: {err}")
        out.unlink(missing_ok=True)
        return None
    proof = "meets the INT8 gates on the test split, packed" if fp32 else "matches the padded graph"
    _log(f"{kind.NAME}: packed form {paths.rel(out)} ({proof})")
    fingerprint.stamp(kind.NAME, stage, stamp)
    return out


def build(name: str, force: bool = False, skip_int8: bool = False, run_search: bool = False,
          progress: bool = True, search_if_missing: bool = False,
          search_budget_s: float | None = DEFAULT_BUDGET_S,
          search_form: str | None = None, choose_runtime: bool = False,
          forms: Sequence[str] = FORMS, fresh: bool = False) -> BuildResult:
    """Configs, FP32, packed forms and the INT8 `forms` of one model (`make demo` builds only the served form: the
    TensorRT form is compiled by `make build-engines`, whose `make build` makes it)."""
    from tritonkit.repository import generate

    t0 = time.perf_counter()
    kind = kinds.get(name)
    # The model's configs first: a build can then be served even when the INT8 step below stops it.
    for path in generate.write([kind]):
        _log(f"{kind.NAME}: generated {paths.rel(path)}")
    fp32, built_fp32 = build_fp32(kind, force=force, progress=progress)
    built = ["fp32"] if built_fp32 else []
    # Small non-ONNX build outputs a spec may have (e.g. a classifier's labels file); cheap, always rewritten.
    for asset in getattr(kind, "write_assets", lambda _repo: [])(paths.MODEL_REPOSITORY):
        _log(f"{kind.NAME}: wrote {paths.rel(Path(asset))}")
    build_packed(kind, fp32, force=built_fp32)
    if skip_int8:
        return BuildResult(name, fp32, None, built)
    # A build that searches keeps the model's budget end to end: the search gets what the export left, less a share
    # for the replays and the runtime choice after it.
    from tritonkit.repository import runtime_choice

    facts = FP32Facts(kind, fp32)  # measured once, by the stage that first needs them
    variants = runtime_choice.served_variants(kind)  # what serves here, read once, before the INT8 stage runs
    outcomes, searched = build_int8(kind, fp32, variants, force=force or built_fp32, progress=progress,
                                    run_search=run_search, search_if_missing=search_if_missing,
                                    search_budget_s=search_budget_s, search_form=search_form, forms=forms, started=t0,
                                    fresh=fresh, facts=facts)
    served = next(o for o in outcomes if o.form == "served")
    trt = next((o for o in outcomes if o.form == "tensorrt"), None)
    # A build that searched keeps its budget to the end: the runtime choice fits in what is left of it.
    budget = Budget.of(search_budget_s, start=t0) if searched else None
    try:
        build_packed(kind, served.path, fp32 if served.status == "passed" else None,
                     twin=fp32 if served.status == FALLBACK else None, gates=served.gates)
        runtime_choice.choose(kind, fp32, served.path if served.status != "failed" else None, force=choose_runtime,
                              log=_log, budget=budget, gates=served.gates, facts=facts)
    finally:  # after the last judgement: the packed proof or the runtime choice may measure a floor a form deferred
        write_records(kind, outcomes)
    for path in generate.write([kind]):  # an FP32 fallback and the chosen runtime show in the configs
        _log(f"{kind.NAME}: generated {paths.rel(path)}")
    if searched:
        took = time.perf_counter() - t0
        _log(f"{kind.NAME}: built with an INT8 search in {took / 60:.1f} min ({budget.describe()})")
    return BuildResult(name, fp32, served.path, built, served.status, trt.path if trt else None, outcomes)


def adopt_proof(kind) -> list[Path]:
    """Make this machine's proof of a donor class's recipe (tritonkit.int8.proof) this CPU class's own committed
    entry: the served recipe (with its quantization parameters) or fallback in models/<name>.int8.json, and the INT8
    name's runtime in models/<name>.runtime.json. Returns the files written (commit them); every replica of the
    class, the NGC views and the manifests then serve it."""
    import json
    import shutil

    from tritonkit import envinfo
    from tritonkit.errors import GateError
    from tritonkit.int8 import proof, recipe
    from tritonkit.int8.report import report_path
    from tritonkit.repository import runtime_choice

    made, why = proof.valid(kind, paths.model_file(kind.INT8_MODEL))
    if made is None:
        raise GateError(f"{kind.NAME}: no proof to adopt: {why}; run `make build MODEL={kind.NAME}` first")
    data = recipe.read(kind) or recipe.RecipeFile()
    served = data.served
    if made.cpu_class in served:
        raise GateError(f"{kind.NAME}: CPU class {made.cpu_class} has its own served entry already")
    passed = made.status == "passed"
    report = json.loads(report_path(kind).read_text())
    donor = served[made.donor]
    served[made.cpu_class] = recipe.Entry.made(
        **{k: getattr(donor, k) for k in ("validation", "floor") if k in donor.keys},
        recipe=made.recipe if passed else None, status=made.status, reason=made.reason, int8_variant=made.variant,
        proven_from=made.donor, test=report.get("test", {}), speed=report.get("speed", {}),
        env=envinfo.fingerprint())
    written = [recipe.write(kind, data)]
    if passed:  # the donor's parameters build this recipe on every class
        src, dst = (recipe.params_path(kind, "served", c) for c in (made.donor, made.cpu_class))
        shutil.copyfile(src, dst)
        written.append(dst)
    models = {kind.INT8_MODEL: {"runtime": made.variant, "reason": f"adopted from this machine's proof of the "
                                f"{made.donor} recipe ({made.date}); timed on {made.variant} only"}}
    return [*written, runtime_choice.write_class(kind, runtime_choice.load(kind), made.cpu_class, models, made.cpu,
                                                 "--adopt-proof")]


def budget_from_minutes(minutes: float | None) -> float | None:
    """Seconds for a whole search of one model: the default when not given, none (unbounded) for 0."""
    return DEFAULT_BUDGET_S if minutes is None else minutes * 60 or None


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tritonkit.build", description=__doc__.splitlines()[0])
    parser.add_argument("target", choices=[*kinds.names(), *kinds.ALIASES, "all"])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--skip-int8", action="store_true", help="only export + validate FP32")
    parser.add_argument("--search", action="store_true",
                        help="re-run the accuracy-aware INT8 search and rewrite models/<name>.int8.json")
    parser.add_argument("--budget-minutes", type=float, metavar="M",
                        help="cap the build of a model that searches (--search, or `make build` of a model with "
                             "no committed recipe) at M minutes of wall clock, end to end: export, floors, both "
                             "forms' searches, replays and the runtime choice (default "
                             f"{DEFAULT_BUDGET_S // 60}; 0: no cap). The search gets what the export left, "
                             f"less {AFTER_SEARCH_SHARE * 100:.0f}%% of M for the steps after it; it reports "
                             "the best it found and what the budget cut")
    parser.add_argument("--form", choices=list(FORMS),
                        help="with --search: re-search only this form, keeping the other's committed recipe")
    parser.add_argument("--fresh", action="store_true",
                        help="with --search: do not judge the committed candidates first (a re-search starts from "
                             "them, built from their quantization parameters)")
    parser.add_argument("--choose-runtime", action="store_true",
                        help="re-time every served file on ONNX Runtime and OpenVINO for this CPU class "
                             "(models/<name>.runtime.json; commit it)")
    parser.add_argument("--adopt-proof", action="store_true",
                        help="after the build, make this machine's proof of another CPU class's served recipe (a "
                             "class with no entry of its own) this class's committed entry and runtime record "
                             "(models/; commit them)")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.form and not args.search:
        parser.error("--form only applies with --search")
    if args.fresh and not args.search:
        parser.error("--fresh only applies with --search")
    targets = kinds.names() if args.target == "all" else [args.target]
    status = 0
    for target in targets:
        result = build(target, force=args.force, skip_int8=args.skip_int8, run_search=args.search,
                       progress=not args.no_progress, search_if_missing=True,
                       search_budget_s=budget_from_minutes(args.budget_minutes),
                       search_form=args.form, choose_runtime=args.choose_runtime, fresh=args.fresh)
        for outcome in result.outcomes:
            if outcome.status == "failed":
                status = 1
                _log(f"{target}: {outcome.form} INT8 MISSED ITS GATES: {'; '.join(outcome.missed)} "
                     f"(report build/reports/{target}_int8*.json). The committed recipe no longer passes here: "
                     f"re-run `python -m tritonkit.build {target} --search`")
            elif outcome.status == FALLBACK:
                _log(f"{target}: {outcome.form} form serves FP32 (no INT8 candidate passed every gate)")
        forms = "".join(f"; {o.form} INT8 {o.status}" for o in result.outcomes)
        _log(f"{target}: done (built {', '.join(result.built) or 'nothing'}{forms})")
        if args.adopt_proof:
            for path in adopt_proof(kinds.get(target)):
                _log(f"{target}: wrote {paths.rel(path)} (commit it)")
    return status


if __name__ == "__main__":
    sys.exit(main())
