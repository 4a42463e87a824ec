"""Stages 3 to 5 of the INT8 stage for one form: build the recipe's graph, judge it, decide what serves.

Takes the resolved recipe entry (tritonkit.int8.recipe.RecipeFile.resolved: this CPU class's own, or a donor's), the
form's `Gates` and the runtime variants that serve FP32 and INT8 here; returns an `Outcome` holding the form's report,
which the build writes once its last judgement is done (`write_records`, tritonkit.int8.report). The graph comes
from the one builder (tritonkit.int8.builder), from the recipe's committed quantization parameters where they apply
(no calibration pass); its judgement from tritonkit.int8.judge, which reuses the search's when the bytes are the ones
it judged. What serves:
- INT8 where every gate holds;
- FP32 under the INT8 name, loudly, where the search found nothing, where a donor class's recipe misses here, where
  only the speed gate misses on this machine, or where a CPU without native bf16 replays its class's candidate and
  it misses;
- otherwise the build fails ("failed"), naming the gate: a class's own committed recipe no longer holds here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from tritonkit import envinfo, paths
from tritonkit.int8 import judge, proof, report
from tritonkit.int8.builder import Builder
from tritonkit.int8.gates import Gates, for_entry
from tritonkit.int8.judge import Judgement
from tritonkit.int8.recipe import (
    FALLBACK,
    Entry,
    mark_recipe,
    params_origin,
    params_path,
    quant_params,
    recipe_digest,
    recipe_path,
    write_fp32_fallback,
)
from tritonkit.int8.records import Recipe
from tritonkit.int8.speed import BF16_COMPETITOR
from tritonkit.serving.runtimes import DEFAULT, usable_here


@dataclass
class Outcome:
    """One form's result of a build: the file written, "passed", "fp32-fallback" or "failed" (a committed recipe
    that misses a gate here), and the gates it missed."""

    form: str
    path: Path
    status: str
    missed: list[str]
    reason: str = ""  # why FP32 serves, for a fallback
    gates: Gates | None = None  # what it was judged by (the packed proof and the runtime choice reuse them)
    judgement: Judgement | None = None  # of the INT8 file written (None: FP32 serves, or up to date)
    report: dict | None = None  # what its report says but its header, floor and bounds (`write_records` adds them)
    entry: Entry | None = None  # the resolved recipe entry it replayed (None: up to date)
    int8_variant: str | None = None  # the runtime variant the INT8 file runs on here (replay_variants), decided once


def write_records(kind, outcomes: list[Outcome]) -> None:
    """What a build's replays leave on disk, written after its last judgement: each form's report, with the floor and
    bounds its gates hold then (the packed proof or the runtime choice may have measured a deferred floor), and this
    machine's proof of a donor class's served recipe (tritonkit.int8.proof). Up-to-date forms keep theirs."""
    for outcome in outcomes:
        if outcome.report is None:
            continue
        rep, gates = outcome.report, outcome.gates
        head = {"model": kind.EXPORT.name, "form": outcome.form, "created": rep["created"],
                "recipe_file": paths.rel(recipe_path(kind)), "env": envinfo.fingerprint(),
                "search_env": rep["search_env"], "search": report.search_summary(kind, outcome.form)}
        report.write(kind, outcome.form, {**head, **rep, "floor": gates.floor, "gates": gates.rows(kind)})
        if outcome.form == "served":
            _prove_here(kind, outcome)


def _prove_here(kind, outcome: Outcome) -> None:
    """Keep this machine's proof of a donor class's recipe; none where the class has its own entry, or where the
    replay failed."""
    donor = outcome.entry.borrowed_from
    if not donor or outcome.status == "failed":
        proof.forget(kind)
        return
    made = proof.write(kind, donor, outcome.status, outcome.reason, outcome.entry.recipe, outcome.int8_variant,
                       outcome.path)
    what = "INT8" if made.status == "passed" else "FP32"
    _log(f"{kind.NAME}: proof for this {made.cpu_class} CPU -> {paths.rel(proof.path(kind))}: the {donor} recipe, "
         f"judged here, serves {what} on this machine (`make serve`, `make demo`); committed views keep FP32")


def _log(msg: str) -> None:
    print(f"[int8] {msg}", flush=True)


def competitor(kind, entry: Entry, served: str) -> str:
    """The FP32 variant a replay's speed gate races: the one its recipe was searched against (`speed_against`),
    unless this CPU cannot run it (bf16 without native bf16), then `served`, the FP32 model's variant here."""
    against = entry.speed_against
    if against is None:
        if envinfo.has_bf16():
            _log(f"{kind.NAME}: this recipe was raced against FP32 on {served} only; here the INT8 name could serve "
                 f"the FP32 file on {BF16_COMPETITOR} instead (`python perf/bench_bf16_race.py {kind.NAME}` times "
                 "both; a search here races it, for the whole CPU class)")
        return served
    if against == BF16_COMPETITOR and not envinfo.has_bf16():
        return served
    return against


@dataclass
class Built:
    """A replay's INT8 graph, written beside its destination (`tmp`) until the decision moves it there."""

    recipe: Recipe
    tmp: Path
    digest: str  # sha256 of the graph's bytes, as judged (tritonkit.int8.judge.digest_of)
    params: str  # where its quantization parameters came from, or why it was calibrated
    seconds: float


def build(kind, fp32: Path, form: str, entry: Entry, out: Path, progress: bool = True) -> Built:
    """Stage 3: the entry's recipe built by the one builder, from its committed quantization parameters where they
    apply (no calibration pass; those it calibrates are kept under build/ for the next build here)."""
    from tritonkit.int8.params import file_digest

    recipe = Recipe.from_json(entry.recipe)
    t0 = time.perf_counter()
    tmp = out.with_name(out.name.removesuffix(".onnx") + ".quant.onnx")
    fp32_digest = file_digest(fp32)
    given, why, source = quant_params(kind, form, entry.recipe, entry.borrowed_from, fp32, fp32_digest)
    builder = Builder(kind, fp32, committed=None if given is None else (recipe, given), progress=progress,
                      all_methods=False, name=f"{kind.NAME}-{form}")
    try:
        model = builder.build(recipe, check=True)
        digest = judge.digest_of(model)
        builder.write(recipe, tmp)
        if given is None:  # kept for the next build here; committing it makes every machine's replay skip calibration
            saved = builder.quant_params(recipe, recipe_digest(entry.recipe), params_origin(kind), fp32_digest)
            built = saved.save(params_path(kind, form, entry.borrowed_from, paths.BUILD_OUTPUTS / "int8-params"))
            _log(f"{kind.NAME}: calibrated ({why}); its parameters -> {paths.rel(built)}")
    finally:
        builder.close()
    return Built(recipe, tmp, digest, paths.rel(source) if given is not None else f"calibrated: {why}",
                 time.perf_counter() - t0)


def replay_variants(variants: tuple[str, str], entry: Entry) -> tuple[str, str]:
    """`variants` (FP32's and INT8's here) with INT8's the one its search timed it on (timing.int8_variant, where its
    gates held; bf16-free here where this CPU has none), so a replay's speed gate races what the search's did."""
    searched = entry.int8_variant
    if entry.borrowed_from or not searched:  # a donor's variant was timed on the donor's CPU, not here
        return variants
    return variants[0], usable_here(searched)


def replay(kind, fp32: Path, form: str, entry: Entry, out: Path, gates: Gates | None = None, progress: bool = True,
           speed_variants: tuple[str, str] = (DEFAULT, DEFAULT), known: Judgement | None = None,
           search_env: dict | None = None) -> Outcome:
    """Build `out` from `form`'s resolved recipe `entry` (`build`), judge it (tritonkit.int8.judge) and
    decide against `gates` (default: the entry's, tritonkit.int8.gates.for_entry; `decide`); FP32 goes there when the
    search found nothing. `speed_variants`: the runtime variants that serve FP32 and INT8 here (replay_variants and
    `competitor` pick what its speed gate races). `known`: this build's search's judgement of the graph it found,
    handed on in memory (used where the rebuilt bytes are the same). `search_env`: the recipe file's environment."""
    gates = gates or for_entry(kind, fp32, form, entry, log=_log)
    rep: dict = {"created": time.strftime("%Y-%m-%dT%H:%M:%S"), "search_env": search_env or {}}
    int8_variant = replay_variants(speed_variants, entry)[1]  # decided here once; the Outcome hands it on
    built = judged = variants = None
    if entry.recipe is not None:
        built = build(kind, fp32, form, entry, out, progress)
        variants = (competitor(kind, entry, speed_variants[0]), int8_variant) if form == "served" else None
        # The held-out test split is the proof here; the validation split chose the recipe, and its numbers are the
        # search's (recorded with the recipe): measuring it again would double a replay's time and prove nothing new.
        judged = judge.judge(kind, fp32, form, built.tmp, judge.exact_judgement(), variants, built.digest, log=_log,
                             known=known)
    return decide(kind, fp32, form, entry, out, gates, rep, built, judged, variants, int8_variant)


def decide(kind, fp32: Path, form: str, entry: Entry, out: Path, gates: Gates, rep: dict, built: Built | None = None,
           judged: Judgement | None = None, variants: tuple[str, str] | None = None,
           int8_variant: str | None = None) -> Outcome:
    """Stage 5: what serves under the INT8 name, from the built graph's judgement against the form's gates; its
    report in the Outcome (`rep`: what it says besides). No graph built: the search found nothing, FP32 serves."""
    from tritonkit.int8.checks import artefact_int8_share, quantized_ops

    borrowed, here, candidate = entry.borrowed_from, envinfo.int8_class(), entry.without_bf16
    if borrowed:
        rep["recipe_cpu"] = f"searched on a {borrowed} CPU; this one is {here}"
    if candidate:
        rep["recipe_cpu"] = (f"the {here} search's accurate candidate, which lost its speed race to FP32 on "
                             f"{BF16_COMPETITOR} there; this CPU has no native bf16")

    def fall_back(reason: str) -> Outcome:
        write_fp32_fallback(fp32, out, reason)
        report.loud(f"{kind.NAME}: no INT8 candidate met every gate ({reason}); {paths.rel(out)} is the FP32 model, "
                    f"served under the INT8 model's name")
        return Outcome(form, out, FALLBACK, [], reason, gates,
                       report={**rep, "status": FALLBACK, "passed": False, "served": "fp32", "reason": reason},
                       entry=entry, int8_variant=int8_variant)

    if built is None:
        return fall_back(entry.reason)
    tmp, recipe = built.tmp, built.recipe
    rep["quantization_parameters"] = built.params
    metrics = {"test": judged.test, "validation": entry.validation or {}}
    speed = judged.speed
    share = artefact_int8_share(tmp, kind.WEIGHT_OPS)
    miss = gates.verdict(metrics["test"], speed, share)
    # Accuracy is the class's, speed this machine's (two CPUs of one class differ, e.g. with and without AMX): a
    # served recipe that misses only its speed gate here serves FP32, loudly, rather than failing the build.
    slow_here = form == "served" and not any(m.startswith("test: ") for m in miss)
    # borrowed: no recipe was ever searched for this CPU's kernels; a candidate: its class served FP32 all along
    if miss and (borrowed or slow_here or candidate):
        tmp.unlink()
        rep.update(recipe=entry.recipe, recipe_summary=recipe.describe(), validation=metrics["validation"],
                   test=metrics["test"], speed=speed, missed_here=miss)
        if borrowed:
            return fall_back(f"the served recipe was searched on a {borrowed} CPU and misses here, on a "
                             f"{here} CPU ({'; '.join(miss)}); search this CPU's with "
                             f"`make int8-search MODEL={kind.NAME} FORM=served` and commit it")
        rep["speed_variants"] = list(variants or ())
        if candidate:
            return fall_back(f"the {here} search's accurate candidate, replayed for a CPU without native bf16, "
                             f"misses here ({'; '.join(miss)}); FP32 serves")
        return fall_back(f"the served recipe holds its accuracy gates here but not its speed gate against FP32 on "
                         f"{variants[0]} ({'; '.join(miss)}): FP32 serves faster on this machine")
    mark_recipe(tmp, entry.recipe)
    tmp.replace(out)
    rep.update(status="passed" if not miss else "failed", passed=not miss, served="int8", missed=miss,
               recipe=entry.recipe, recipe_summary=recipe.describe(), validation=metrics["validation"],
               test=metrics["test"], speed=speed, speed_variants=list(variants) if speed else None,
               int8_mac_share=round(share, 4), quantized_ops=quantized_ops(out), quantize_s=round(built.seconds, 1),
               judged_by=judged.by, sha256=built.digest)
    return Outcome(form, out, rep["status"], miss, "", gates, judged, rep, entry, int8_variant)
