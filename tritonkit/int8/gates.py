"""Stage 2 of the INT8 stage: the gates one form of one model is judged by, once per build.

Takes the kind, its FP32 file and the form (and, for a replay, the floor recorded with its recipe); returns `Gates`:
the half-precision floor (tritonkit.int8.floor) and, per split, the accuracy targets judged against it, plus the
served form's speed gate. The search, the replay's judgement, the packed proof and the runtime choice all read the
same record: a build measures the floor and sets the bounds once per form and hands them on.

A floor only loosens the kind's absolute bounds (`targets`) and never below its catastrophe bounds, so a build
measures it only when a judgement needs it (`Gates.holds`): metrics that hold the absolute bounds pass under any
floor, and metrics that miss a bound no floor loosens (`loosest`) fail under any. A 6-layer MiniLM's build
never needs its two floors (~144 s of half-precision passes on 2 cores). Until then the search ranks candidates by
the absolute bounds (tritonkit.int8.search), and a record that never needed its floor says so (`NOT_NEEDED`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonkit.kinds.gates import Target, missed

SPLITS = ("validation", "test")
# A strongly typed TensorRT network runs a Q/DQ graph's float nodes in FP32: at a quarter of INT8's tensor-core
# rate and half FP16's, an INT8 plan beats the FP16 plan only with over 2/3 of its multiply-accumulates in INT8.
MIN_TENSORRT_INT8_SHARE = 2 / 3
# The floor record of gates whose floor no judgement needed (beside "unavailable": none could be measured).
NOT_NEEDED = "not_needed"


# -- the gate rule: a kind's bounds judged against a floor, and how far metrics are from them ---------------------

def targets(kind, floor: Mapping[str, float] | None) -> list[Target]:
    """`kind.TARGETS` judged against `floor` (this split's half-precision metrics; None: absolute gates), plus the
    kind's catastrophe bounds on metrics the gates do not name."""
    slack: Mapping[str, float] = getattr(kind, "FLOOR_SLACK", {})
    bounds = {t.metric: t for t in getattr(kind, "CATASTROPHE", ())}
    out = []
    for t in kind.TARGETS:
        value = t.value
        if floor is not None and t.metric in floor and t.metric in slack:
            relative = floor[t.metric] - slack[t.metric] if t.op == ">=" else floor[t.metric] + slack[t.metric]
            value = min(value, relative) if t.op == ">=" else max(value, relative)
        if t.metric in bounds:
            value = max(value, bounds[t.metric].value) if t.op == ">=" else min(value, bounds[t.metric].value)
        out.append(dataclasses.replace(t, value=round(value, 6)))
    return out + [b for m, b in bounds.items() if m not in {t.metric for t in kind.TARGETS}]


def loosest(kind) -> list[Target]:
    """The bounds no floor loosens (`targets` under any floor): a gate on a metric without floor slack, the
    catastrophe bound of one with slack. Metrics that miss one of these miss the gates whatever the floor."""
    slack: Mapping[str, float] = getattr(kind, "FLOOR_SLACK", {})
    return [t for t in targets(kind, None) if t.metric not in slack] + \
        [b for b in getattr(kind, "CATASTROPHE", ()) if b.metric in slack]


def slack(target: Target, metrics: dict[str, float]) -> float:
    """Distance to a gate in units of its scale: >= 0 passes."""
    got = metrics.get(target.metric, float("-inf") if target.op == ">=" else float("inf"))
    gap = got - target.value if target.op == ">=" else target.value - got
    return gap / target_scale(target)


def target_scale(target: Target) -> float:
    """How much of a metric is 'one gate': the distance from the gate to perfect (1.0) for >= gates near 1."""
    if target.scale:
        return target.scale
    if target.op == ">=" and 0 < target.value < 1:
        return 1.0 - target.value
    return abs(target.value) or 1.0


def distortion(targets: Sequence[Target], metrics: dict[str, float]) -> float:
    """Continuous badness used to rank candidates and units: summed gate-normalised shortfall (not clipped, so it
    keeps ranking once every gate passes)."""
    return float(sum(-slack(t, metrics) for t in targets))


def passes(targets: Sequence[Target], metrics: dict[str, float], margin: float = 0.0) -> bool:
    # A gate at perfection (e.g. 100 % agreement) has no room for a margin.
    return all(slack(t, metrics) >= (margin if t.value < 1 else 0.0) for t in targets)


def summary(targets: Sequence[Target], metrics: dict[str, float]) -> str:
    return " ".join(f"{t.metric}={metrics.get(t.metric, float('nan')):.4f}" for t in targets)


@dataclass
class Gates:
    form: str
    floor: dict  # floor.measure's record: {"precision", "how", split: metrics}, {"precision", "unavailable"} or
    # {"precision", NOT_NEEDED: why} while it is deferred (and after, where no judgement needed it)
    targets: dict[str, list[Target]] = field(default_factory=dict)  # per split, the floor-judged bounds
    speed: Target | None = None  # INT8 against FP32 at the served batch sizes (served form only)
    # The bounds no floor loosens (`loosest`); a deferred floor's measurement, (floor, targets), until it runs.
    loosest: list[Target] = field(default_factory=list, repr=False)
    pending: Callable[[], tuple[dict, dict]] | None = field(default=None, repr=False, compare=False)

    @property
    def measured(self) -> bool:
        return "test" in self.floor

    @property
    def deferred(self) -> bool:
        return self.pending is not None

    def resolve(self) -> None:
        """Measure a deferred floor now; the bounds are judged against it from here on."""
        if self.pending is not None:
            self.floor, self.targets = self.pending()
            self.pending = None

    def unmeasured(self, why: str) -> None:
        """A form its build did not search (the budget or the speed probe cut it): the kind's own bounds stand, and
        the floor record says why none was measured."""
        if self.deferred:  # its bounds are the absolute ones until a floor is measured
            self.floor, self.pending = {"precision": self.floor["precision"], "unavailable": why}, None

    def decided(self, split: str, metrics: Mapping[str, float], margin: float = 0.0) -> bool | None:
        """Whether `metrics` hold `split`'s gates (with `margin`, `passes`) as far as the bounds known now
        tell: None where only the deferred floor can say."""
        if passes(self.targets[split], metrics, margin):
            return True
        if not self.deferred or not passes(self.loosest, metrics, margin):
            return False
        return None

    def holds(self, split: str, metrics: Mapping[str, float], margin: float = 0.0) -> bool:
        """Whether `metrics` hold `split`'s gates (with `margin`), measuring the deferred floor where only it can
        tell."""
        verdict = self.decided(split, metrics, margin)
        if verdict is None:
            self.resolve()
            verdict = passes(self.targets[split], metrics, margin)
        return verdict

    @property
    def min_int8_share(self) -> float:
        """The compute-share gate: the least share of the weighted multiply-accumulates an INT8 graph of this form
        keeps in INT8 (TensorRT's, whose speed is the GPU's; 0 for the served form, whose speed gate decides)."""
        return MIN_TENSORRT_INT8_SHARE if self.form == "tensorrt" else 0.0

    def verdict(self, test: Mapping[str, float], speed: Mapping[str, float], share: float) -> list[str]:
        """Every gate a built file misses: its test-split metrics ("test: ..."), its speed against FP32 (served
        form) and its INT8 share of the compute (TensorRT form). Empty: it serves."""
        miss = [f"test: {m}" for m in self.missed("test", test)]
        if self.speed is not None and not self.speed.met(speed):
            miss += missed([self.speed], dict(speed))
        if share < self.min_int8_share:  # GPU speed is not measurable here; compute is
            miss.append(f"int8_mac_share {share:.3f} < {self.min_int8_share:.3f}: the FP16 plan would be faster")
        return miss

    def missed(self, split: str, metrics: Mapping[str, float], margin: float = 0.0) -> list[str]:
        """What `metrics` miss of `split`'s gates with `margin` (empty: they hold; judged as `holds` judges)."""
        return [] if self.holds(split, metrics, margin) else self.lines(split, metrics, margin)

    def lines(self, split: str, metrics: Mapping[str, float], margin: float = 0.0) -> list[str]:
        """One line per gate of `split`, as known now, that `metrics` miss; else one for the `margin`, where only
        it misses."""
        lines = missed(self.targets[split], dict(metrics))
        if lines or passes(self.targets[split], metrics, margin):
            return lines
        return [f"within the {margin} margin of a gate: {summary(self.targets[split], dict(metrics))}"]

    def rows(self, kind) -> list[dict]:
        """One report row per gate: the absolute bound, each split's floor-judged bound, then the speed gate."""
        absolute = {t.metric: t.value for t in kind.TARGETS}
        rows = [{**asdict(t), "absolute": absolute.get(t.metric), "validation": t.value,
                 "test": self.targets["test"][i].value} for i, t in enumerate(self.targets["validation"])]
        return rows + ([asdict(self.speed)] if self.speed is not None else [])


def _targets(kind, floor: dict) -> dict[str, list[Target]]:
    from tritonkit.int8 import floor as floors

    return {split: targets(kind, floors.split_floor(floor, split)) for split in SPLITS}


def _make(kind, form: str, floor: dict, pending: Callable[[], tuple[dict, dict]] | None = None) -> Gates:

    return Gates(form, floor, _targets(kind, floor), kind.SPEED_TARGET if form == "served" else None,
                 loosest(kind), pending)


def absolute(kind, form: str, why: str = "not measured") -> Gates:
    """The kind's own bounds, no floor (a search cut before its floor, a spec made in memory)."""
    from tritonkit.int8 import floor as floors

    return _make(kind, form, {"precision": floors.PRECISION[form], "unavailable": why})


def of_floor(kind, form: str, floor: dict | None) -> Gates:
    """Gates judged against a floor record already in hand (a search's, a recipe's)."""
    return _make(kind, form, floor) if floor else absolute(kind, form)


def for_entry(kind, fp32: Path, form: str, entry, log: Callable[[str], None] = print) -> Gates:
    """The gates a recipe file's `entry` is judged by: its floor measured here where a judgement needs it
    (`for_form`); a fallback proves nothing against a floor, so the one its search recorded stands (a budget-cut
    search has none)."""
    if entry.recipe is not None:
        return for_form(kind, fp32, form, entry.floor, log=log)
    return of_floor(kind, form, entry.floor or None)


def deferrable(kind) -> bool:
    """Whether a build may wait for a judgement to need the floor: not where a gate sits at its metric's maximum
    (an image kind's every-sure-photo-agrees gate), which nearly every INT8 graph misses, so the floor would be
    measured at the first judgement anyway, inside the search's budget rather than before it, where
    pipeline.form_cut counts it."""
    return not any(t.op == ">=" and t.value >= 1.0 for t in kind.TARGETS)


def for_form(kind, fp32: Path, form: str, recorded: dict | None = None, log: Callable[[str], None] = print,
             defer: bool | None = None) -> Gates:
    """The gates of `form`, its floor measured on this machine (or found in the spec's floors file); where it cannot
    be measured here, the floor `recorded` with the recipe stands rather than absolute gates (the floor is the FP32
    graph's, not this CPU's). Once per process and FP32 file. A floor the floors file does not hold is measured only
    when a judgement needs it (`defer`, default `deferrable`)."""
    from tritonkit.int8 import floor as floors

    precision = floors.PRECISION[form]

    def measure() -> tuple[dict, dict]:
        half = floors.measure(kind, fp32, precision)
        if "unavailable" in half and "test" in (recorded or {}):
            log(f"{kind.NAME}: using the {recorded['precision']} floor recorded with the recipe "
                f"({half['unavailable']})")
            half = {**recorded, "recorded": f"measured where the recipe was searched; here: {half['unavailable']}"}
        if "unavailable" in half:
            log(f"{kind.NAME}: no {precision} floor for the {form} form: {half['unavailable']}; absolute gates")
        else:
            log(f"{kind.NAME}: {form} form's {precision} floor (test split): "
                + ", ".join(f"{t.metric} {half['test'].get(t.metric, float('nan')):.4f}" for t in kind.TARGETS))
        return half, _targets(kind, half)

    if (deferrable(kind) if defer is None else defer) and floors.recorded(kind, fp32, precision) is None:
        why = ("not needed: every judgement was decided by the absolute bounds (met, which no floor tightens, or "
               "a bound no floor loosens missed)")
        return _make(kind, form, {"precision": precision, NOT_NEEDED: why}, measure)
    floor, _ = measure()
    return _make(kind, form, floor)


def packed_proof(kind, fp32: Path, gates: Gates | None = None, log: Callable[[str], None] = print):
    """(judge, reference) that prove a served INT8 graph's packed form (the kind's `write_packed`): the served form's
    gates on the test split (`gates`: those the INT8 build judged with, not measured again) against the FP32
    graph's test-split outputs. `make build` and a revision's scratch build prove it the same way."""
    from tritonkit.int8 import evaluate

    gates = gates or for_form(kind, fp32, "served", log=log)
    return (lambda metrics: gates.missed("test", metrics)), evaluate.reference(kind, fp32, "test")


def main(argv: Sequence[str] | None = None) -> int:
    """Print each built model's floors and the gates they set, per form and split (markdown)."""
    import argparse
    import datetime

    from tritonkit import envinfo, kinds, paths
    from tritonkit.int8 import floor

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.gates", description=main.__doc__)
    parser.add_argument("names", nargs="*", help="model specs (default: every built one)")
    parser.add_argument("--compare-emulated", action="store_true",
                        help="on a CPU with native bf16: the emulated bf16 floor beside OpenVINO's native one, per "
                             "metric, against the kind's floor slack (exit 1 when outside it)")
    parser.add_argument("--activations", action="store_true",
                        help="with --compare-emulated: also the emulation rounding every activation between ops")
    args = parser.parse_args(argv)
    names = args.names or [n for n in kinds.names() if paths.model_file(kinds.get(n).FP32_MODEL).exists()]
    flags = " --compare-emulated" * args.compare_emulated + " --activations" * args.activations
    print(f"`python -m tritonkit.int8.gates{flags} {' '.join(args.names)}`".replace(" `", "`")
          + f", {datetime.date.today()}, {envinfo.cpu_model()}, CPU INT8 class {envinfo.int8_class()}, "
          f"bf16: {', '.join(envinfo.cpu_flags(wanted=envinfo.BF16_FLAGS)) or 'none'}\n")
    if args.compare_emulated:
        return floor.compare_emulated(names, args.activations)
    print("| model | form | floor | split | metric: absolute gate / floor / gate judged against it |")
    print("|---|---|---|---|---|")
    for name in names:
        kind = kinds.get(name)
        fp32 = paths.model_file(kind.FP32_MODEL)
        for form, precision in floor.PRECISION.items():
            half = floor.measure(kind, fp32, precision)
            for split in ("validation", "test"):
                got = floor.split_floor(half, split)
                bounds = {t.metric: t.value for t in targets(kind, got)}
                cells = "; ".join(f"{t.metric} {t.value} / {got[t.metric]:.4f} / {bounds[t.metric]:.4f}" if got
                                  else f"{t.metric} {t.value}" for t in kind.TARGETS)
                label = half.get("unavailable") or precision + (" emulated" if precision == "bf16" else "")
                print(f"| {name} | {form} | {label} | {split} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
