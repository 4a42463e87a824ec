"""A search's accuracy steps (tritonkit.int8.search runs them in order): the starts, the committed candidate judged
first, the knob variants, the kind's prior float nodes, the sensitivity scan, and the refinements of a found
candidate (its trim, then its float MatMuls at a finer granularity). Functions over the search's context; each
takes what the step before it returned and returns what the next one takes."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import replace

from tritonkit.int8 import fallback, timing
from tritonkit.int8.context import KNOBS, SearchContext, Track, key, passed, prior_misses, priors_knobs
from tritonkit.int8.gates import distortion
from tritonkit.int8.records import Recipe
from tritonkit.int8.speed import describe as _speed
from tritonkit.int8.units import quantizable_nodes


def start(ctx: SearchContext) -> list[Track]:
    """The starting points (form × placement), each timed then scored on the sample, best first."""
    # TensorRT's form is placed on weighted ops' inputs only (the placement its explicit-quantization fuses).
    placements = ["inputs", "all"] if ctx.check_speed else ["inputs"]
    # The kind's prior start first (a stable sort: forms, then placements, as listed, break ties), so a budget
    # that cannot afford every start has measured the one that won before.
    starts = sorted((Recipe(form=f, placement=p) for f in ctx.forms for p in placements),
                    key=lambda r: prior_misses(ctx.spec, r, ("form", "placement")))
    ctx.plan.plan("start:sample", len(starts))
    tracks: list[Track] = []
    for r in starts:
        form, placement = r.form, r.placement
        # Starting points are only ranked: the sample is enough (the whole split costs 3x on big encoders).
        # Starts run until one gives a track, whatever the budget: a search reports at least that (a judged
        # committed candidate is that report; a build does not start a form without time for one,
        # pipeline.form_cut). A further start is an option that must leave the first track its time where that
        # track can meet the speed gate (on a large encoder the prior's track tells more than three more starts).
        viable = tracks and not tracks[0].slow
        # Timed before it is scored: a start too slow to keep is dropped without its accuracy.
        step = ctx.measure("start", f"form={form} placement={placement}", r, speed=True, evaluator=ctx.sample,
                           must=not tracks and not ctx.judged,
                           ahead=ctx.plan.after_start(len(ctx.units(tracks[0].recipe))) if viable else None,
                           drop_under=ctx.early_speed, decides=False)
        if step is None:
            continue
        if step.speedup is not None and (ctx.fastest is None or step.speedup > ctx.fastest[1]):
            ctx.fastest = (r, step.speedup)  # dropped or not: the speed ceiling times the fastest
        if ctx.check_speed and step.speedup is not None and step.speedup < ctx.early_speed:
            ctx.log(f"  dropped {form}/{placement}: x{step.speedup:.2f} before any unit is put back in float")
            continue
        tracks.append(Track(r, step.metrics, ctx.sample, ctx.check_speed and step.speedup is not None and
                            step.speedup < ctx.gates.speed.value))
    ctx.plan.plan("start:sample", 0)
    order = track_order(ctx, tracks)
    if len(order) > 1 and _track_key(ctx, order[0])[:2] == _track_key(ctx, order[1])[:2]:
        ctx.need_floor("the starts tie but for their distortion")  # which is first is a decision
        order = track_order(ctx, tracks)
    return order[: ctx.max_tracks]


def _track_key(ctx: SearchContext, t: Track) -> tuple:
    # Units put back in float only slow a graph down: a start already under the speed gate goes last, whatever
    # its accuracy (Lite0's uint8/inputs start ran 1.07x and took a whole budget; uint8/all ran 1.89x).
    # Then the kind's prior (what won on its shipped models), then the lowest distortion.
    return t.slow, prior_misses(ctx.spec, t.recipe, ("form", "placement")), ctx.rank(t.metrics)


def track_order(ctx: SearchContext, tracks: Sequence[Track]) -> list[Track]:
    """`tracks`, best first, against the bounds known now."""
    return sorted(tracks, key=lambda t: _track_key(ctx, t))


def committed_first(ctx: SearchContext) -> tuple[Recipe, dict] | None:
    """The committed candidate (the recipe, or the accurate candidate a speed gate rejected) judged before any
    start, whatever the budget: built from its parameters in seconds, on the whole validation split, then timed at
    the served batch sizes. A re-search (after a dependency change, on another machine of the class) so proves or
    drops what the last one found before it pays for a calibration: MPNet's candidate took a 45-minute search,
    whose 15-minute re-search otherwise has time for one start. (recipe, speed) where every accuracy gate holds,
    else None."""
    if ctx.committed is None:
        return None
    r = ctx.committed[0]
    if ctx.under_share(r, "committed"):
        return None
    ctx.judged = True
    step = ctx.measure("committed", "the committed candidate on all validation", r, must=True)
    if passed(step):
        return r, timing.time_candidate(ctx, r, "committed")
    if step is None or not ctx.holds("validation", step.metrics, "committed", margin=0.0):
        ctx.log(f"  committed {r.describe()} misses here: searching without it")
        return None
    # Within the margin only (another machine's FP32 file: Lite1's +39 here): its trim may hold with it.
    ctx.log(f"  committed {r.describe()} holds the gates here, not the margin: trimmed before it is dropped")
    ctx.trimmed.add(key(r))
    # Trimmed where its parent is served (timing.served_variant), which is decided first.
    trimmed = fallback.trim(ctx, r, later=ctx.plan.after_trim(len(granular_nodes(ctx, r))))
    if trimmed is None:
        ctx.log("  no trim of it holds with the margin: searching without it")
        return None
    ctx.trimmed.add(key(trimmed))
    return trimmed, timing.time_candidate(ctx, trimmed, "committed")


def prior_nodes(ctx: SearchContext, r: Recipe) -> list[str]:
    """The nodes of `r`'s prepared graph that the kind's SEARCH_PRIOR_FLOAT names: "family:<name>" units
    (tritonkit.int8.units.families) and regular expressions searched in node names."""
    patterns = getattr(ctx.spec, "SEARCH_PRIOR_FLOAT", ())
    if not patterns:
        return []
    units = ctx.units(r)
    nodes = quantizable_nodes(ctx.builder.prepare(r).path, ctx.spec.WEIGHT_OPS)
    named = {n for p in patterns if p.startswith("family:") for n in units.get(p, [])}
    named |= {n for p in patterns if not p.startswith("family:") for n in nodes if re.search(p, n)}
    return [n for n in nodes if n in named]


def prior_variant(ctx: SearchContext, scored: Sequence[Recipe], tried: Sequence[Recipe]) -> Recipe | None:
    """The next variant the prior float nodes go on, of a track's `scored` ones (best first, ranked when asked:
    trying one may have measured the floor), after those `tried`: the prior's own knobs, where measured, then the
    best; None after both. An all-INT8 score does not rank variants for a recipe whose worst units stay float: on
    all-MiniLM-L6-v2 itself (a new model's build, no bf16) the plain variant scored best at full INT8 and missed
    with the prior float nodes (cosine min 0.9836), where the shipped recipe is smoothing's."""
    prior = [v for v in scored if priors_knobs(ctx.spec, v)][:1]
    order = prior + [v for v in scored[:1] if v not in prior]
    return next((v for v in order if v not in tried), None) if len(tried) < len(order) else None


def prior_float(ctx: SearchContext, variant: Recipe) -> tuple[Recipe, dict] | None:
    """`variant` with the kind's prior float nodes (SEARCH_PRIOR_FLOAT: what its shipped models kept float),
    scored on the sample and, where it holds there, confirmed on the whole split and timed: (recipe, speed), else
    None. One candidate at a scan unit's price, where a large encoder's budget reaches no scan (MPNet's 19 units
    cost 12 minutes on 2 cores)."""
    nodes = prior_nodes(ctx, variant)
    if not nodes:
        return None
    r = replace(variant, float_nodes=nodes)
    if ctx.under_share(r, "prior"):
        return None
    step = ctx.measure("prior", f"the kind's {len(nodes)} prior float nodes", r, evaluator=ctx.sample, ahead=0.0)
    if not passed(step):
        return None
    # Untimed here: a confirmed candidate is timed at every served batch size next (timing.time_candidate).
    confirmed = ctx.measure("confirm", "the prior float nodes on all validation", r)
    if not passed(confirmed):
        return None
    return r, timing.time_candidate(ctx, r)


def knob_variants(ctx: SearchContext, track: Track) -> list[tuple[str, Recipe]]:
    """The track's knobs that matter for its graph: SmoothQuant alpha (MatMul models), bias correction or GPTQ
    weight rounding (conv models), the calibration method (where the feeds allow histograms)."""
    ops = set(ctx.spec.WEIGHT_OPS)
    out = [("as started", track.recipe)]
    if "MatMul" in ops:
        out += [(f"smooth_alpha={a}", replace(track.recipe, smooth_alpha=a)) for a in (0.5, 0.8)]
    if "Conv" in ops:
        out.append(("bias_correction", replace(track.recipe, bias_correction=True)))
        out.append(("weight_rounding=gptq", replace(track.recipe, weight_rounding="gptq")))
    methods = ctx.builder.methods()[1:]
    out += [(f"{name} + calibrate={m}", replace(r, calibrate_method=m, extra_options=x))
            for name, r in list(out) for m, x in methods]
    # The start (measured already) first, then the kind's prior knobs, then those nearest to them (fewest knobs
    # off the prior; a stable sort keeps the listed order among equals): a budget that ends early tried them.
    return sorted(out, key=lambda v: (v[0] != "as started", prior_misses(ctx.spec, v[1], KNOBS)))


def rank_units(ctx: SearchContext, track: Track) -> list[tuple[str, list[str], float]]:
    """[(unit, nodes, gain)]: the units that recover distortion most when left float first, measured one at a
    time on the sample in graph order (early layers first). Units the budget left unmeasured come after those
    that helped, in graph order; those that did not help come last."""
    from tqdm import tqdm

    from tritonkit.errors import QuantizationError

    units = ctx.units(track.recipe)
    ctx.plan.plan("unit:sample", len(units) + 1)
    t0 = time.perf_counter()
    measured: list[tuple[str, list[str], float]] = []

    def ranking() -> list[tuple[str, list[str], float]]:
        by_gain = sorted(measured, key=lambda m: -m[2])
        done = {u for u, _, _ in measured}
        rest = [(u, members, 0.0) for u, members in units.items() if u not in done]
        ctx.sensitivity.append({
            "recipe": track.recipe.describe(), "seconds": round(time.perf_counter() - t0, 1),
            "units": [{"unit": u, "nodes": len(m), "gain": round(g, 4)} for u, m, g in by_gain],
            "unmeasured": [u for u, _, _ in rest]})
        return [m for m in by_gain if m[2] > 0] + rest + [m for m in by_gain if m[2] <= 0]

    if not ctx.plan.fits("unit:sample", "unperturbed", ctx.plan.estimate("unit:sample"), ctx.plan.after_scan(1)):
        return ranking()
    base = distortion(ctx.rank_targets, ctx.sample.metrics(ctx.build(track.recipe), exact=ctx.exact))
    ctx.plan.took("unit:sample", time.perf_counter() - t0)
    for unit in tqdm(units, desc=f"sensitivity {track.recipe.describe()}", unit="unit", disable=not ctx.progress):
        # A scan cut short still orders the units it measured: the fallback gets the time it needs.
        if not ctx.plan.fits("unit:sample", unit, ctx.plan.estimate("unit:sample"),
                             ctx.plan.after_scan(len(measured) + 1)):
            ctx.log(f"  budget: sensitivity measured {len(measured)} of {len(units)} units (the rest in graph "
                    "order)")
            break
        t1 = time.perf_counter()
        try:
            model = ctx.build(replace(track.recipe, float_nodes=units[unit]))
        except QuantizationError:
            continue
        gain = base - distortion(ctx.rank_targets, ctx.sample.metrics(model, exact=ctx.exact))
        measured.append((unit, units[unit], gain))
        ctx.plan.took("unit:sample", time.perf_counter() - t1)
    return ranking()


def refine(ctx: SearchContext, timed: tuple[Recipe, dict], ranked=()) -> list[tuple[Recipe, dict]]:
    """A found candidate, (recipe, speed), refined: its float nodes put back in INT8 one by one where the gates
    allow (fallback.trim), then its float MatMuls at a finer granularity (`granular`). With a speed gate the trimmed
    recipe races its parent head to head and leads only where it beats it beyond the noise; without one (TensorRT's
    form) fewer float nodes lead. Returns [(recipe, speed)] for the speed gate and the test split to choose
    among, the parent kept as a candidate."""
    r = timed[0]
    if key(r) in ctx.trimmed:
        return granular(ctx, timed)
    ctx.trimmed.add(key(r))
    # What the trim leaves to the steps after it, reckoned before the hard rows' graph replaces r's in the builder.
    trimmed = fallback.trim(ctx, r, ranked, later=ctx.plan.after_trim(len(granular_nodes(ctx, r))))
    if trimmed is None:
        return granular(ctx, timed)
    if not ctx.check_speed:
        return [(trimmed, {}), timed]
    t0 = time.perf_counter()
    timing.served_variant(ctx, trimmed)
    parent, speed = timing.race_parent(ctx, r, [trimmed])
    ctx.plan.took("speed", time.perf_counter() - t0)
    faster = speed.get("over_parent_lo", 0.0) > 1.0
    ctx.log(f"  trimmed {trimmed.describe()}: speed {_speed(speed)}; x{speed.get('over_parent_lo', 0.0):.2f} "
            "and up over its parent head to head" + ("" if faster else ": not faster beyond the noise"))
    if not faster:
        return granular(ctx, timed)
    return [*granular(ctx, (trimmed, speed)), (r, parent)]


def granular(ctx: SearchContext, timed: tuple[Recipe, dict]) -> list[tuple[Recipe, dict]]:
    """A candidate that held every accuracy gate on the whole split, (recipe, speed), with its float MatMuls
    quantized at run time instead, by each scheme in turn (tritonkit.int8.granularity), where that holds every
    gate on the whole split and there is time to judge it. Those that hold race their parent head to head
    (timing.race_parent); one is offered only where it beats the parent beyond the noise at the slowest batch size.
    Returns [(recipe, speed)]: the parent (its speed from the race where a scheme is offered) and those, for the
    speed gate and the test split to choose among (the fastest holding wins). The served form's step before
    float; TensorRT's form runs only explicit Q/DQ, so it never takes one."""
    r = timed[0]
    schemes = granular_nodes(ctx, r)
    ctx.granular_tried.add(key(r))
    if not schemes:
        return [timed]
    held = []
    for name, nodes in schemes.items():
        g = r.with_dynamic(name, nodes)
        # An option: skipped alone where it cannot also leave its timing's time.
        step = ctx.measure("granular", f"{len(nodes)} {'run-time' if r.dynamic else 'float'} MatMuls as {name}", g,
                           ahead=ctx.plan.estimate("speed") or 0.0)
        if passed(step) and ctx.plan.fits("speed", g.describe(), ctx.plan.estimate("speed"), ahead=0.0):
            held.append(g)
    if not held:
        return [timed]
    t0 = time.perf_counter()
    for g in held:
        timing.served_variant(ctx, g)
    speeds = timing.race_parent(ctx, r, held)
    ctx.plan.took("speed", (time.perf_counter() - t0) / len(held))
    out = []
    for g, speed in zip(held, speeds[1:], strict=True):
        faster = speed.get("over_parent_lo", 0.0) > 1.0
        ctx.log(f"  granular {g.describe()}: speed {_speed(speed)} (INT8 on {timing.variants_of(ctx, g)[1]}); x"
                f"{speed.get('over_parent_lo', 0.0):.2f} and up over its parent head to head"
                + ("" if faster else ": not faster beyond the noise, not offered"))
        if faster:
            out.append((g, speed))
    # Offered schemes rank against the parent's time from the same race; else its own timing stands.
    return [(r, speeds[0]) if out else timed, *out]


def granular_nodes(ctx: SearchContext, r: Recipe) -> dict[str, list[str]]:
    """{scheme: the nodes it would run} for each scheme the finer-granularity step (`granular`) would try on
    `r`: `r`'s float nodes it can run; for a recipe already quantized at run time, each other scheme that can
    run all of its run-time nodes (a committed `nbits8-b32` meets `nbits8-b128`). Empty where that step does
    not run: no speed gate, or `r` was tried (a recipe found twice, committed then the prior, competes with
    its variants once). Answered once per recipe: each answer builds a graph, which the builder keeps only one of."""
    from tritonkit.int8 import granularity

    if not ctx.check_speed or key(r) in ctx.granular_tried:
        return {}
    if key(r) not in ctx.schemes:
        if r.dynamic:
            own, nodes = r.dynamic["scheme"], r.dynamic_nodes
            model = ctx.build(replace(r, dynamic={}))
            found = {name: nodes for name in granularity.SCHEMES
                     if name != own and granularity.eligible(model, nodes, name) == nodes}
        else:
            model = ctx.build(r)
            found = {name: granularity.eligible(model, r.float_nodes, name) for name in granularity.SCHEMES}
        ctx.schemes[key(r)] = {name: nodes for name, nodes in found.items() if nodes}
    return ctx.schemes[key(r)]
