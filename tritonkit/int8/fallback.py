"""A search's fallback: the most sensitive units back in float, cumulatively, until every gate holds on the
validation split; the shortest such prefix of the ranking, found by galloping then bisecting, is the fastest
candidate. Its trim then puts single nodes of those units back in INT8 where the gates allow. Functions over the
search's context (tritonkit.int8.context)."""

from __future__ import annotations

import time
from dataclasses import replace

from tritonkit.int8 import timing
from tritonkit.int8.context import SearchContext, passed
from tritonkit.int8.records import Recipe, Step
from tritonkit.int8.speed import describe as _speed
from tritonkit.serving.runtimes import DEFAULT

PATIENCE = 3  # fallback doublings of the float units without improvement before a knob variant is given up


class Prefixes:
    """One fallback's candidates: prefix k keeps the ranking's first k units float; each is scored on the search's
    validation sample at most once. A prefix the form rejects (every unit float: nothing left to quantize) ends the
    list, as every longer one would be rejected too."""

    def __init__(self, ctx: SearchContext, name: str, items: list[tuple[str, Recipe]]):
        self.ctx, self.name, self.items = ctx, name, items
        self.last = len(items) - 1
        self.scored: dict[int, Step | None] = {}

    def score(self, k: int, whole: bool = False) -> Step | None:
        unit, r = self.items[k]
        name = self.name
        change = name if not k else f"{name} +float {unit}" if k == 1 else f"{name} +{k} units float, to {unit}"
        if whole:
            return self.ctx.measure("fallback", change, r)
        if k not in self.scored:
            self.scored[k] = self.ctx.measure("fallback", change, r, evaluator=self.ctx.sample)
        return self.scored[k]

    def buildable(self, k: int) -> int:
        """The longest prefix up to k the form accepts."""
        while k > 0 and self.score(k) is None and not self.ctx.spent():
            self.last = k = k - 1
        return k


def fallback(ctx: SearchContext, name: str, start: Recipe, ranked, max_float: int | None = None) -> Recipe | None:
    """The shortest prefix of the sensitivity ranking that, kept in float, makes every gate hold (with the
    margin). Found on the validation sample by galloping (1, 2, 4, ... units float) and then bisecting, so a
    prefix of n units costs about 2 log2(n) candidates, not n; then confirmed on the whole validation split,
    adding units one at a time while it does not hold there yet.
    `max_float`: a candidate already passed with that many float nodes; one with as many cannot be faster, so
    only the longest prefix under it is tried first and, when that misses, nothing shorter is."""
    prefixes = Prefixes(ctx, name, _prefixes(ctx, name, start, ranked, max_float))
    bounds = _bracket(ctx, prefixes, max_float)
    if bounds is None:
        return None
    lo, hi = bounds  # the longest prefix that missed on the sample, the shortest that passed
    # A passing prefix is never lost to the budget: where bisecting no longer fits, the shortest one found so
    # far goes to confirmation, which the reserve was kept for.
    while hi - lo > 1 and not out_of_budget(ctx):
        mid = (lo + hi) // 2
        step = prefixes.score(mid)
        if step is None and ctx.spent():  # not started: the budget, not the graph, said no
            break
        lo, hi = (lo, mid) if passed(step) else (mid, hi)
    return _confirm(ctx, name, prefixes, hi)


def _prefixes(ctx: SearchContext, name: str, start: Recipe, ranked, max_float: int | None
              ) -> list[tuple[str, Recipe]]:
    """[(unit, recipe)]: `start`, then each next unit of the ranking added to the float nodes."""
    # Past half the units in float a CPU form cannot meet its speed gate; a form without one (TensorRT's,
    # whose speed is the GPU's) may go down the whole ranking.
    budget = ranked[: max(1, len(ranked) // 2)] if ctx.check_speed else ranked
    prefixes: list[tuple[str, Recipe]] = [("", start)]
    for unit, members, _gain in budget:
        r = prefixes[-1][1]
        if set(members) <= set(r.float_nodes):
            continue  # already float through a family
        r = replace(r, float_nodes=[*r.float_nodes, *(m for m in members if m not in r.float_nodes)])
        if max_float is not None and len(r.float_nodes) >= max_float:
            break
        if ctx.min_int8_share and ctx.int8_share(r) < ctx.min_int8_share:
            ctx.log(f"  {name}: prefixes stop before {unit}: under {ctx.min_int8_share:.0%} of the "
                    "multiply-accumulates would stay INT8")
            break
        prefixes.append((unit, r))
    return prefixes


def out_of_budget(ctx: SearchContext) -> bool:
    if ctx.spent():
        if not ctx.plan.stopped:  # past the deadline, nothing cut yet: the cuts say where it stopped
            ctx.plan.fits("fallback", "the rest of this fallback")
        ctx.log(f"  stopped: the search budget ({ctx.plan.budget_s / 60:.0f} min) is spent")
    return ctx.spent()


def _bracket(ctx: SearchContext, prefixes: Prefixes, max_float: int | None) -> tuple[int, int] | None:
    """(lo, hi): prefix lo missed on the sample (-1: none did), prefix hi passed; None: none passes."""
    if passed(prefixes.score(0)):
        return -1, 0
    if max_float is None:
        return _gallop(ctx, prefixes)
    if out_of_budget(ctx):
        return None
    if prefixes.buildable(prefixes.last) == 0 or not passed(prefixes.score(prefixes.last)):
        ctx.log(f"  stopped: no candidate under {max_float} float nodes passes")
        return None
    return 0, prefixes.last


def _gallop(ctx: SearchContext, prefixes: Prefixes) -> tuple[int, int] | None:
    """Prefixes 1, 2, 4, ... until one passes, giving up after PATIENCE doublings that do not lower the
    distortion."""
    first = prefixes.scored[0]
    lo, k, best, stale = 0, 1, first.distortion if first else float("inf"), 0
    while lo < prefixes.last:
        k = prefixes.buildable(min(k, prefixes.last))
        if k > lo and passed(prefixes.scored.get(k)):
            return lo, k  # whatever the budget: a passing prefix goes on to confirmation (fallback)
        if out_of_budget(ctx) or k <= lo:
            return None
        step = prefixes.scored[k]
        if _at_wall(ctx, prefixes.items[k][1]):
            return None
        lo = k
        best, stale = (step.distortion, 0) if step.distortion < best - 1e-9 else (best, stale + 1)
        if stale >= PATIENCE:
            ctx.log(f"  stopped: no improvement in {PATIENCE} doublings of the float units")
            return None
        k *= 2
    return None


def _at_wall(ctx: SearchContext, r: Recipe) -> bool:
    """Whether `r`, a prefix that missed accuracy, already runs under the speed gate: its 95 % interval wholly
    below it at a served batch size. Longer prefixes put more units in float and only slow the graph down, and
    shorter ones are less accurate (the gallop's premise): this ranking holds no recipe, and its fallback ends.
    Without a speed gate, or when the timing does not fit the budget, the gallop goes on. Timed where the fastest
    start led least (the largest batch size before the ceiling)."""
    if not ctx.check_speed or not ctx.plan.fits("wall", r.describe(), ctx.plan.estimate("wall") or
                                                ctx.plan.estimate("speed"), ahead=0.0):
        return False
    t0 = time.perf_counter()
    batch = ctx.tight_batch or ctx.spec.SPEED_BATCHES[-1]
    speed = timing.prefix_speed(ctx, r, batch)
    ctx.plan.took("wall", time.perf_counter() - t0)
    if speed[f"speedup_hi_batch{batch}"] >= ctx.gates.speed.value:
        return False
    ctx.walls.append({"recipe": r.describe(), "float_nodes": len(r.float_nodes), "batch": batch,
                      "speed": {k: round(v, 4) for k, v in speed.items()}})
    ctx.log(f"  stopped: {r.describe()} missed accuracy and already runs {_speed(speed)}, under the "
            f"{ctx.gates.speed.value}x speed gate: longer prefixes are only slower")
    return True


def _confirm(ctx: SearchContext, name: str, prefixes: Prefixes, hi: int) -> Recipe | None:
    """Prefix `hi` passed on the sample: the whole validation split decides, adding units while it misses."""
    recipe = prefixes.items[hi][1]
    step = ctx.measure("confirm", f"{name} on all validation", recipe, speed=True)
    if passed(step):
        return recipe
    if ctx.check_speed and step is not None and step.speedup is not None and step.speedup < ctx.early_speed:
        ctx.log("  stopped: the speed gate no longer holds")
        return None
    for k in range(hi + 1, prefixes.last + 1):
        if out_of_budget(ctx):
            return None
        if passed(prefixes.score(k, whole=True)):
            return prefixes.items[k][1]
    return None


def trim(ctx: SearchContext, r: Recipe, ranked=(), later: float = 0.0) -> Recipe | None:
    """`r` (it held every gate on the whole validation split, or a committed one at least without the margin) with
    its float nodes put back in INT8 one at a time, each kept where every gate still holds on the sample, which
    screens at the gates themselves; the whole split decides with the margin. The fallback puts whole units
    in float (a large graph's are blocks: an MBConv's expand, depthwise and project convs), where one node of a
    unit may be all that needs float. Least sensitive first: by its unit's gain in `ranked`, then the rest last
    added first (a fallback adds units most sensitive first, so a recipe's float nodes run from the most to the
    least sensitive); run-time quantized nodes stay as they are. Each step is an option the budget may skip,
    leaving `later` seconds to the steps after the trim (Plan.after_trim). Returns the trimmed recipe the whole
    split confirms (where all the returns miss there, the longest run of them in the order they were kept that
    holds, bisected), else None."""
    gain: dict[str, float] = {}
    for _unit, members, g in ranked:
        for m in members:
            gain[m] = min(gain.get(m, g), g)
    dynamic = set(r.dynamic_nodes)
    nodes = [n for n in r.float_nodes if n not in dynamic]
    order = sorted(nodes, key=lambda n: (n not in gain, gain.get(n, 0.0), -nodes.index(n)))
    # The sample with the rows a trim hurts most: on a plain sample MiniLM's 15 returns held (cosine min 0.992)
    # and missed on the whole split (0.962).
    ctx.resample(replace(r, float_nodes=[n for n in r.float_nodes if n in dynamic]), "the rows a trim hurts most",
                 ahead=0.0)
    ctx.plan.plan("trim:sample", len(order))
    # Returns are judged where r itself is served: a parent that misses in bf16 is timed on ONNX Runtime.
    served = timing.served_variant(ctx, r) if ctx.check_speed else DEFAULT
    current, back = r, []
    for i, node in enumerate(order):
        candidate = replace(current, float_nodes=[n for n in current.float_nodes if n != node])
        # At the gates: with the margin Lite1's committed +39 kept 9 returns, without it 25, whose whole split
        # then held the margin (top-1 0.9323, 1.22x FP32 on OpenVINO bf16 against 1.14x).
        step = ctx.measure("trim", f"{node} back in INT8", candidate, evaluator=ctx.sample, ahead=later, margin=0.0)
        ctx.plan.plan("trim:sample", len(order) - i - 1)
        if step is None and ctx.spent():
            break
        if passed(step) and _holds_served(ctx, candidate, served):
            current = candidate
            back.append(node)
    ctx.plan.plan("trim:sample", 0)
    if not back:
        return None

    def returned(k: int) -> Recipe:  # the first k returns, in the order they were kept
        return replace(r, float_nodes=[n for n in r.float_nodes if n not in back[:k]])

    if passed(ctx.measure("confirm", f"{len(back)} of {len(nodes)} float nodes back in INT8, on all validation",
                          current)):
        return current
    lo, hi = 0, len(back)  # all the returns missed on the whole split; none of them is where r stands
    while hi - lo > 1:
        mid = (lo + hi) // 2
        step = ctx.measure("trim", f"the first {mid} of them, on all validation", returned(mid), ahead=0.0)
        if step is None:
            break
        lo, hi = (mid, hi) if passed(step) else (lo, mid)
    if lo:
        return returned(lo)
    ctx.log(f"  trimmed {r.describe()} missed on the whole split: it stands as it was")
    return None


def _holds_served(ctx: SearchContext, r: Recipe, variant: str) -> bool:
    """Whether `r` holds every gate on the sample also run as `variant` serves it (its parent's runtime; nothing
    more to check on ONNX Runtime's): a return that holds in exact int32 arithmetic can miss in OpenVINO bf16,
    where Lite1's 25 returns took top-1 from 0.9323 to 0.9076, under its 0.9214 gate."""
    if variant == DEFAULT:
        return True
    _, problems = ctx.sample.served_problems(
        ctx.build(r), variant, lambda m: ctx.gates.missed("validation", m), ctx.spec.SERVE_THREADS, ctx.exact)
    if problems:
        ctx.log(f"  {'':<11} {'':<42} misses run as {variant}: {'; '.join(problems)}")
    return not problems
