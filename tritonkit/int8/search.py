"""Accuracy-aware INT8 search: finds a model's quantization recipe with no person in the loop.

    python -m tritonkit.build <model> --search        (re-run after a model, data or dependency change)

For one activation form (the CPU-served one, or TensorRT's symmetric INT8) the search
1. measures the starting knobs (Q/DQ placement, activation form) on the *validation* split, then tries the knobs
   that matter one at a time, keeping what helps: SmoothQuant alpha for MatMul models, bias correction or GPTQ
   weight rounding for conv models, the calibration method where onnxruntime allows it (histogram calibrators
   need equal-shape feeds);
   Where the kind names what its shipped models kept float (SEARCH_PRIOR_FLOAT) and that set holds every gate
   here, it is the result: steps 2 and 3 could only find fewer float nodes, which those models did not keep;
2. ranks every quantizable unit (a node with a constant weight, or a block of them when a graph has many) by its
   sensitivity: how much the validation metrics recover when that unit alone stays float;
3. puts the most sensitive units back in float, cumulatively, until every gate holds on the validation split (with
   a margin): the shortest such prefix of the ranking, found by galloping then bisecting, is the fastest candidate;
4. measures INT8 against FP32 at the served batch sizes and keeps the fastest track that passes; then confirms the
   winner once on the *test* split, which played no part in any choice.
Calibration is done once per prepared graph and method; each candidate only re-quantizes with the same ranges
(seconds), so a search costs minutes. The outcome is a `Recipe` (data), committed beside the model's facts and
replayed by an ordinary build.

One runner (`run`) over one context (tritonkit.int8.context.SearchContext), in the order the steps take:

    committed_first ─▶ start ─▶ per track: knob variants ─▶ prior float ─▶ resample ─▶ rank_units ─▶ fallback
        ─▶ refine (trim, granular) ─▶ confirm on the test split ─▶ SearchResult
    (steps: tritonkit.int8.steps; fallback and trim: .fallback; timing, the speed ceiling and probe: .timing)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from tritonkit.int8 import fallback, steps, timing
from tritonkit.int8.context import MARGIN, SearchContext, Track, key, priors_knobs
from tritonkit.int8.gates import distortion
from tritonkit.int8.gates import summary as _summary
from tritonkit.int8.judge import digest_of
from tritonkit.int8.records import Recipe, SearchResult
from tritonkit.int8.speed import describe as _speed
from tritonkit.int8.units import quantizable_nodes
from tritonkit.kinds.gates import Target

__all__ = ["MARGIN", "Recipe", "SearchContext", "confirmation_order", "quantizable_nodes", "run"]


def run(ctx: SearchContext) -> SearchResult:
    """The search of `ctx`'s form, its steps in order (the module's docstring); the context is closed after."""
    try:
        return _run(ctx)
    finally:
        ctx.close()


def _run(ctx: SearchContext) -> SearchResult:
    plan, speed_gate = ctx.plan, ctx.gates.speed
    plan.start()
    t0 = plan.t0
    ctx.log(f"[search] {ctx.spec.NAME} ({ctx.form}): validation split, margin {ctx.margin} of each gate"
            + (f", budget {plan.budget_s / 60:.0f} min" if plan.budget_s else ""))
    failed: list[dict] = []
    ok: list[tuple[Recipe, dict]] = []
    slow: list[tuple[Recipe, dict]] = []  # met every accuracy gate, missed the speed gate
    first = steps.committed_first(ctx)
    if first is not None:  # trimmed first: the cheapest way to fewer float nodes (Lite1's +39 ran 1.00x bf16)
        _sort_by_speed(ctx, ok, slow, failed, steps.refine(ctx, first))
    tracks = steps.start(ctx)
    ceiling = None if ok else timing.speed_ceiling(ctx)
    if ceiling is not None:
        accurate = held_out(ctx, *max(slow, key=lambda rs: rs[1].get("int8_speedup", 0.0))) if slow else None
        return _result(ctx, None, {}, {}, ceiling[1], failed, t0, ceiling[0], accurate=accurate)
    for i in range(len(tracks)):
        track = tracks[i]
        # The first track always reports; another starts only with time left beyond the reserve.
        if i and not plan.fits("track", track.recipe.describe()):
            ctx.log(f"  budget spent: track {track.recipe.describe()} not searched")
            break
        found, ranked, scored = _track(ctx, track)
        if found is not None and (not ctx.check_speed or speed_gate.met(found[1])):
            # The scan and fallback would only look for fewer float nodes than the kind's shipped models kept:
            # a passing prior ends the search (a 6-layer MiniLM cut: 43 s of fallbacks found nothing shorter).
            ctx.log(f"  prior {found[0].describe()} holds every gate: the search ends with it (no scan)")
            _sort_by_speed(ctx, ok, slow, failed, steps.refine(ctx, found))
            break
        finals = _fallbacks(ctx, scored, ranked, found, ok, failed)
        if finals:  # the first passing candidate's float nodes back in INT8 where they hold, then finer
            finals[:1] = steps.refine(ctx, finals[0], ranked)
        _sort_by_speed(ctx, ok, slow, failed, finals)
        if ok:  # tracks run best first: the first that passes ends the search
            break
        tracks[i + 1:] = steps.track_order(ctx, tracks[i + 1:])  # against the floor, where this track measured it
    if not ok:
        return _none_passed(ctx, slow, failed, t0)
    return _confirm(ctx, ok, failed, t0)


def _track(ctx: SearchContext, track: Track):
    """One track up to its fallbacks: every knob variant at full INT8 on the sample (the best one orders the units
    for all of them), the kind's prior float nodes, and, where the prior does not end the search, the resample and
    the sensitivity scan. (found by the prior: (recipe, speed) or None, the ranked units, the scored variants)."""
    plan = ctx.plan
    scored = []
    variants = steps.knob_variants(ctx, track)
    plan.plan_track(len(ctx.units(track.recipe)), len(variants) - 1)  # "as started" was measured at the start
    plan.log_eta(f"variants of {track.recipe.describe()}")
    for name, variant in variants:
        if plan.stopped:
            break
        if variant == track.recipe and track.scored_on is ctx.sample:  # measured at the start
            scored.append((track.metrics, name, variant))
            continue
        # Variants are options: one that does not fit is skipped alone, and any but the prior's must leave the
        # rest of the track its time.
        step = ctx.measure("variant", name, variant, evaluator=ctx.sample, decides=False,
                           ahead=0.0 if priors_knobs(ctx.spec, variant) else plan.after_variants())
        if step is not None:
            scored.append((step.metrics, name, variant))
    scored.sort(key=lambda v: ctx.rank(v[0]))
    if scored:
        plan.plan_track(len(ctx.units(scored[0][2])), 0, len(scored))
    # What won on the kind's shipped models, before a scan the budget may not reach; it caps the fallbacks.
    found, tried = None, []
    while found is None:
        scored.sort(key=lambda v: ctx.rank(v[0]))  # the last try may have measured the floor
        variant = steps.prior_variant(ctx, [v for _, _, v in scored], tried)
        if variant is None:
            break
        tried.append(variant)
        found = steps.prior_float(ctx, variant)
    if found is not None and (not ctx.check_speed or ctx.gates.speed.met(found[1])):
        return found, [], scored
    # The scan ranks units by their distance to the gates, and the fallbacks judge: by the floor's bounds.
    ctx.need_floor("the sensitivity scan ranks by the gates")
    scored.sort(key=lambda v: ctx.rank(v[0]))
    # The sample also carries the whole split's worst rows, which decide worst-case gates. It must leave a scan
    # of one unit and its fallback.
    if scored and ctx.resample(scored[0][2], "the whole split's worst rows",
                               2 * (plan.estimate("unit:sample") or 0.0) + plan.after_scan(1)):
        plan.log_eta("sensitivity")
    ranked = steps.rank_units(ctx, Track(scored[0][2], scored[0][0])) if scored else []
    plan.log_eta("fallback")
    return found, ranked, scored


def _fallbacks(ctx: SearchContext, scored, ranked, found, ok, failed) -> list[tuple[Recipe, dict]]:
    """The best variants' fallbacks over the ranking, two passing candidates at most (with the prior's, where it
    held its accuracy gates): [(recipe, speed)]. A variant whose fallback finds nothing leaves its best step in
    `failed`."""
    finals = [found] if found is not None else []
    wall = None  # float nodes at this track's first wall: its variants share its speed, so stay under it
    for _, name, variant in scored[: ctx.max_variants]:
        if len(finals) >= 2:  # two passing candidates to compare speeds is enough
            break
        first, walls = len(ctx.steps), len(ctx.walls)
        caps = [len(r.float_nodes) for r, _ in (*finals, *ok)] + ([wall] if wall is not None else [])
        recipe = fallback.fallback(ctx, name, variant, ranked, min(caps) if caps else None)
        if wall is None and len(ctx.walls) > walls:
            wall = ctx.walls[-1]["float_nodes"]
        if recipe is None:
            # This fallback's own steps: variant names prefix one another ("x" and "x + calibrate=...") and
            # recur across tracks ("as started"), so matching by name repeated entries.
            best = min((s for s in ctx.steps[first:] if s.stage in ("fallback", "confirm")),
                       key=lambda s: s.distortion, default=None)
            if best is not None:
                failed.append({"recipe": best.recipe, "metrics": best.metrics, "speedup": best.speedup})
            continue
        # The first passing candidate is always timed (the reserve was kept for it): it is never lost.
        if ctx.check_speed and finals and not ctx.plan.fits("speed", recipe.describe(),
                                                            ctx.plan.estimate("speed")):
            break
        finals.append((recipe, timing.time_candidate(ctx, recipe)))
    return finals


def _none_passed(ctx: SearchContext, slow, failed, t0: float) -> SearchResult:
    """The result where no candidate met the accuracy and speed gates, saying why."""
    why, accurate = "no candidate met the accuracy and speed gates", None
    gate = ctx.gates.speed
    if slow:  # the accuracy gates held, at a price in float nodes the speed gate does not allow
        r, sp = max(slow, key=lambda rs: rs[1].get("int8_speedup", 0.0))
        accurate = held_out(ctx, r, sp)
        why += (f"; the fastest that met the accuracy gates ({r.describe()}) ran {_speed(sp)} on "
                f"{timing.variants_of(ctx, r)[1]} against FP32 on {ctx.speed_variants[0]}, not above the "
                f"{gate.value}x speed gate beyond the noise measured (95 % interval of the "
                f"slowest batch size {sp.get('int8_speedup_lo', 0):.2f}x and up)")
    if ctx.walls:
        w = ctx.walls[0]
        why += (f"; the speed gate ended {len(ctx.walls)} fallback(s) first: {w['recipe']} missed the "
                f"accuracy gates and already ran {_speed(w['speed'])} against FP32 on "
                f"{ctx.speed_variants[0]}, under the {gate.value}x gate, and more float "
                "units only slow a graph down")
    if ctx.min_int8_share:
        why += (f" with at least {ctx.min_int8_share:.0%} of the weighted multiply-accumulates in INT8 "
                "(below that the FP16 plan is faster)")
    if ctx.spent() or ctx.plan.cuts:
        why += f" within the search budget ({ctx.plan.budget_s / 60:.0f} min)"
    return _result(ctx, None, {}, {}, {}, failed, t0, why, accurate=accurate)


def _confirm(ctx: SearchContext, ok, failed, t0: float) -> SearchResult:
    """The passing candidates' looks at the held-out test split (confirmation_order): the first that holds it
    is the result."""
    looks = confirmation_order(ok, {key(r): ctx.split_metrics.get(key(r)) for r, _ in ok}, ctx.rank_targets)
    misses, why, first = [], [], None  # each look's miss (a report entry; the reason's part); the first look's
    for i, (recipe, speed) in enumerate(looks):
        if i and not ctx.plan.fits("test", f"second look: {recipe.describe()}", ctx.plan.estimate("test")):
            break
        model = ctx.build(recipe)
        # Measured when it was confirmed on the whole split (the same graph): not again, outside any budget.
        validation = ctx.split_metrics.get(key(recipe)) or ctx.val.metrics(model, exact=ctx.exact)
        ctx.log("[search] confirming on the test split" + (f" (second look, {recipe.describe()}: the most "
                                                           "accurate on validation)" if i else ""))
        test, ok_test = on_test(ctx, model)
        first = first or (validation, test)
        if ok_test:
            failed[:0] = misses
            return _result(ctx, recipe, validation, test, speed, failed, t0, "", chosen=recipe)
        missing = "; ".join(ctx.gates.lines("test", test))  # as on_test judged it
        misses.append({"recipe": recipe.describe(), "test": test, "accuracy": f"test split: {missing}"})
        why.append(f"{recipe.describe()}: {missing}")
    failed[:0] = misses[1:]  # the first look's miss is the result's own (chosen, test)
    return _result(ctx, None, first[0], first[1], looks[0][1], failed, t0, "test split: " + "; ".join(why),
                   chosen=looks[0][0])


def _sort_by_speed(ctx: SearchContext, ok: list, slow: list, failed: list, found: list[tuple[Recipe, dict]]) -> None:
    """Candidates that held every accuracy gate go to `ok`, or to `slow` (and `failed`) where the speed gate
    rejects them."""
    for r, s in found:
        if not ctx.check_speed or ctx.gates.speed.met(s):
            ok.append((r, s))
            continue
        slow.append((r, s))
        failed.append({"recipe": r.describe(), "accuracy": "passed (validation)", "speed": s,
                       "speedup": s.get("int8_speedup")})


def on_test(ctx: SearchContext, model) -> tuple[dict[str, float], bool]:
    """A chosen graph on the held-out test split, once (the reserve was kept for it): its metrics, and whether
    they meet the test split's gates."""
    from tritonkit.int8.evaluate import Evaluator

    t1 = time.perf_counter()
    test = Evaluator(ctx.spec, ctx.fp32, "test").metrics(model, exact=ctx.exact)
    ctx.plan.took("test", time.perf_counter() - t1)
    return test, ctx.holds("test", test, "test", 0.0)


def held_out(ctx: SearchContext, r: Recipe, speed: dict[str, float]) -> dict | None:
    """The accurate candidate kept for CPUs that cannot run the FP32 competitor it lost to, once the test split
    holds it too (as a passing recipe must), else None. Logged either way."""
    test, held = on_test(ctx, ctx.build(r))
    ctx.log(f"  accurate candidate {r.describe()} on the test split: {_summary(ctx.targets['test'], test)}"
            + ("" if held else " (missed: not kept)"))
    if not held:
        return None
    return {"recipe": r.to_json(), "validation": ctx.split_metrics.get(key(r), {}), "test": test, "speed": speed,
            "int8_variant": timing.variants_of(ctx, r)[1]}


def _result(ctx: SearchContext, recipe, validation, test, speed, failed, t0, reason, chosen=None,
            accurate=None) -> SearchResult:
    # The judged graph's bytes: a replay that rebuilds them reuses this search's judgement (tritonkit.int8.judge).
    digest = digest_of(ctx.build(recipe)) if recipe else None
    cuts = ctx.plan.cuts
    if cuts:
        ctx.log(f"[search] the budget cut {len(cuts)} step(s), first {cuts[0]['stage']} "
                f"'{cuts[0]['what']}' at {cuts[0]['at_s']:.0f} s of {ctx.plan.budget_s:.0f} s")
    res = SearchResult(ctx.form, recipe, validation, test, speed, ctx.steps, ctx.sensitivity, failed,
                       round(time.perf_counter() - t0, 1), recipe is not None, reason, list(cuts),
                       list(ctx.walls), accurate,
                       timing.variants_of(ctx, recipe)[1] if recipe is not None and ctx.check_speed else None,
                       digest)
    if chosen is not None and recipe is None:
        res.best_failed.insert(0, {"recipe": chosen.describe(), "test": test})
    return res


def confirmation_order(ok: Sequence[tuple[Recipe, dict]], validation: Mapping[str, Mapping[str, float] | None],
                       targets: Sequence[Target]) -> list[tuple[Recipe, dict]]:
    """The candidates that may look at the held-out test split, in order, all named before the first look: the
    fastest (without a speed check, the fewest float units); should it miss, the one most accurate on the whole
    validation split (`validation`, by recipe key), where that is another and strictly more accurate. A worst-case
    gate can miss on the other split by more than any margin (docs/int8-search.md); two looks at most, so the test
    split stays a check, not a choice."""
    def badness(r: Recipe) -> float:
        metrics = validation.get(key(r))
        return distortion(targets, metrics) if metrics else float("inf")

    ranked = sorted(ok, key=lambda rs: (rs[1].get("int8_speedup", 0.0), -len(rs[0].float_nodes)), reverse=True)
    if not ranked:
        return []
    first = ranked[0]
    backup = min(ranked[1:], key=lambda rs: badness(rs[0]), default=None)
    if backup is None or not badness(backup[0]) < badness(first[0]):
        return [first]
    return [first, backup]
