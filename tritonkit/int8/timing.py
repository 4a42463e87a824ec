"""A search's speed steps (tritonkit.int8.search): where a candidate's INT8 graph is timed (the runtime variant it
holds its gates on), timing it against FP32 as the speed gate judges it, racing it against its parent, and the
speed ceiling and probe that end a search no recipe could win. Functions over the search's context."""

from __future__ import annotations

import time
from collections.abc import Sequence

from tritonkit.int8.context import SearchContext, key, prior_misses
from tritonkit.int8.gates import summary as _summary
from tritonkit.int8.records import ProbeTimings, Recipe
from tritonkit.int8.speed import describe as _speed
from tritonkit.int8.speed import race, speedup
from tritonkit.serving.runtimes import DEFAULT


def int8_variant(ctx: SearchContext, r: Recipe) -> str:
    """The variant the speed gate times `r`'s INT8 graph on: the INT8 model's (speed_variants[1]) where `r` holds
    the validation gates run so, with the search's margin, else ONNX Runtime, where the search judged it. The
    runtime choice serves INT8 only where its gates hold: MPNet's 36 prior float nodes held under ONNX Runtime,
    passed the gate timed on OpenVINO bf16, then missed there on the test split (float nodes in bf16; cosine
    min 0.9893 < 0.99; without the margin they held on validation) and served on OpenVINO f32, slower than FP32."""
    variant = ctx.speed_variants[1]
    if variant == DEFAULT:
        return variant

    def missed(metrics: dict[str, float]) -> list[str]:
        return [] if ctx.holds("validation", metrics, "speed") else ctx.gates.lines("validation", metrics, ctx.margin)

    metrics, problems = ctx.val.served_problems(ctx.build(r), variant, missed, ctx.spec.SERVE_THREADS, ctx.exact)
    if not problems:
        ctx.log(f"  {r.describe()} holds run as {variant}: {_summary(ctx.targets['validation'], metrics)}")
        return variant
    ctx.log(f"  {r.describe()} misses run as {variant} ({'; '.join(problems)}): timed on {DEFAULT}")
    return DEFAULT


def served_variant(ctx: SearchContext, r: Recipe) -> str:
    """int8_variant of `r`, decided once per recipe: the variant its INT8 graph is timed on and its trim's returns
    are judged on."""
    if key(r) not in ctx.int8_variants:
        ctx.int8_variants[key(r)] = int8_variant(ctx, r)
    return ctx.int8_variants[key(r)]


def variants_of(ctx: SearchContext, r: Recipe) -> tuple[str, str]:
    """(FP32's, INT8's) variants `r` is timed on: INT8's as int8_variant chose it, else the INT8 model's."""
    return ctx.speed_variants[0], ctx.int8_variants.get(key(r), ctx.speed_variants[1])


def candidate_speed(ctx: SearchContext, r: Recipe) -> dict[str, float]:
    """A candidate that holds every accuracy gate, timed as the gate judges it: every served batch size."""
    return speedup(ctx.spec, ctx.fp32, ctx.build(r), ctx.spec.SPEED_BATCHES, variants=variants_of(ctx, r),
                   separate_from=ctx.gates.speed.value)


def time_candidate(ctx: SearchContext, r: Recipe, what: str = "candidate") -> dict[str, float]:
    """A candidate that held every accuracy gate on the whole split, timed as the speed gate judges it (nothing
    to time without one), the time kept as a speed step's."""
    t0 = time.perf_counter()
    speed = {}
    if ctx.check_speed:
        served_variant(ctx, r)
        speed = candidate_speed(ctx, r)
    ctx.plan.took("speed", time.perf_counter() - t0)
    ctx.log(f"  {what} {r.describe()}: speed {_speed(speed)}"
            + (f" (INT8 on {variants_of(ctx, r)[1]})" if ctx.check_speed else ""))
    return speed


def race_parent(ctx: SearchContext, r: Recipe, rivals: Sequence[Recipe]) -> list[dict[str, float]]:
    """`r` and its `rivals` timed interleaved with FP32 in one run (tritonkit.int8.speed.race): [r's speed,
    each rival's], the rivals' with their ratio over `r` (`over_parent*`)."""
    fp32_variant, parent_variant = variants_of(ctx, r)
    names = [f"rival{i}" for i in range(len(rivals))]
    raced = race(ctx.spec, (fp32_variant, ctx.fp32), (parent_variant, ctx.build(r)),
                 {n: (variants_of(ctx, g)[1], ctx.build(g)) for n, g in zip(names, rivals, strict=True)},
                 ctx.spec.SPEED_BATCHES, separate_from=ctx.gates.speed.value)
    return [raced["parent"], *(raced[n] for n in names)]


def prefix_speed(ctx: SearchContext, r: Recipe, batch: int) -> dict[str, float]:
    """`r` timed against FP32 at `batch` (a wall's), until its interval lies on one side of the gate."""
    return speedup(ctx.spec, ctx.fp32, ctx.build(r), [batch], repeats=3, variants=ctx.speed_variants,
                   separate_from=ctx.gates.speed.value)


def speed_ceiling(ctx: SearchContext, start: Recipe | None = None) -> tuple[str, dict] | None:
    """(why, its timings) when no recipe can meet the speed gate, else None. The fastest start (or `start`) has
    every unit in INT8, and units put back in float only slow a graph down: where its 95 % interval at some served
    batch size lies wholly under the gate, every candidate's would, so nothing is searched (MiniLM and MPNet
    against the FP32 file on OpenVINO bf16 on an AMX CPU). Timed at every served batch size, as the gate is,
    unless it is the start the speed probe timed so (its graph had other ranges, the same ops)."""
    if not ctx.check_speed or (ctx.fastest is None and start is None):
        return None
    r, gate = start or ctx.fastest[0], ctx.gates.speed.value
    if ctx.probed.cleared is not None and key(r) == key(ctx.probed.cleared):
        speed = ctx.probed.ceiling
        how = f"ran {_speed(speed)} in the speed probe: not timed again"
    else:
        t1 = time.perf_counter()
        speed = speedup(ctx.spec, ctx.fp32, ctx.build(r), ctx.spec.SPEED_BATCHES, variants=ctx.speed_variants,
                        separate_from=gate)
        ctx.plan.took("speed", time.perf_counter() - t1)
        how = f"runs {_speed(speed)} against FP32 on {ctx.speed_variants[0]}"
    under = [b for b in ctx.spec.SPEED_BATCHES if speed[f"speedup_hi_batch{b}"] < gate]
    ctx.tight_batch = min(ctx.spec.SPEED_BATCHES, key=lambda b: speed[f"speedup_hi_batch{b}"])
    ctx.ceiling_timed = speed
    ctx.log(f"[search] speed ceiling: {r.describe()} (every unit INT8) {how}")
    if not under:
        return None
    b = under[0]
    cut = sum(c["stage"] == "start:sample" for c in ctx.plan.cuts)  # a faster form may be among them
    which = f"no recipe of the starts measured ({cut} cut by the budget)" if cut else "no recipe"
    return (f"{which} can meet the speed gate: the fastest start, {r.describe()} with every unit INT8, runs "
            f"{_speed(speed)} against FP32 on {ctx.speed_variants[0]}; at batch {b} its 95 % interval tops out "
            f"at {speed[f'speedup_hi_batch{b}']:.2f}x, under the {gate}x gate, and units put back in float only "
            "slow a graph down"), speed


def speed_probe(ctx: SearchContext) -> tuple[str, dict] | None:
    """speed_ceiling before any floor, calibration or scoring: the starts built (from the few calibration batches
    of a FewCalibrationBatches spec) and timed at the largest served batch size, the kind's prior first
    (probe_order); the first over the gate there is timed at every batch size, and ends the probe where it clears
    the gate at each; else the fastest is. (why, its timings) where even that cannot meet the speed gate: nothing
    need be measured for accuracy (MPNet-sized encoders against FP32 in bf16 on an AMX CPU). What it timed is left
    in ctx.probed, which the search does not time again."""
    from tritonkit.errors import QuantizationError

    gate, timed = ctx.gates.speed.value, None  # timed: (start, its ceiling) timed at every batch size
    quick: dict[str, float] = {}
    ctx.probed = ProbeTimings(quick)  # filled as the starts are timed
    for r in probe_order(ctx):
        try:
            model = ctx.build(r)
        except QuantizationError as exc:
            ctx.log(f"  probe       {r.describe():<42} rejected: {exc}")
            continue
        sp = speedup(ctx.spec, ctx.fp32, model, ctx.spec.SPEED_BATCHES[-1:], repeats=3,
                     variants=ctx.speed_variants)["int8_speedup"]
        ctx.log(f"  probe       {r.describe():<42} speed x{sp:.2f} (batch {ctx.spec.SPEED_BATCHES[-1]})")
        quick[key(r)] = sp
        if ctx.fastest is None or sp > ctx.fastest[1]:
            ctx.fastest = (r, sp)
        if sp >= gate and timed is None:
            # One start over the gate at every batch size ends the probe, whatever the others run (MPNet without
            # bf16: the prior's start ran 3.0x, and three more starts took ~110 s to show nothing more).
            timed = (r, speed_ceiling(ctx, r))
            if timed[1] is None:
                ctx.log(f"  probe       {r.describe()} can meet the speed gate: the other starts not probed")
                ctx.probed = ProbeTimings(quick, r, ctx.ceiling_timed)
                return None
    if timed is not None and timed[0] == ctx.fastest[0]:
        return timed[1]
    return speed_ceiling(ctx)


def probe_order(ctx: SearchContext) -> list[Recipe]:
    """Every start, the kind's prior's form and placement first: what won on the shipped models is likeliest
    to clear the speed gate and end the probe."""
    starts = [Recipe(form=f, placement=p) for f in ctx.forms for p in ("inputs", "all")]
    return sorted(starts, key=lambda r: prior_misses(ctx.spec, r, ("form", "placement")))
