"""Stage 2 of the INT8 stage: the gates one form of one model is judged by, once per build.

Takes the kind, its FP32 file and the form (and, for a replay, the floor recorded with its recipe); returns `Gates`:
the half-precision floor (tritonkit.int8.floor) and, per split, the accuracy targets judged against it, plus the
served form's speed gate. The search, the replay's judgement, the packed proof and the runtime choice all read the
same record: a build measures the floor and sets the bounds once per form and hands them on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonkit.kinds.gates import Target

SPLITS = ("validation", "test")
# A strongly typed TensorRT network runs a Q/DQ graph's float nodes in FP32: at a quarter of INT8's tensor-core
# rate and half FP16's, an INT8 plan beats the FP16 plan only with over 2/3 of its multiply-accumulates in INT8.
MIN_TENSORRT_INT8_SHARE = 2 / 3


@dataclass(frozen=True)
class Gates:
    form: str
    floor: dict  # floor.measure's record: {"precision", "how", split: metrics} or {"precision", "unavailable"}
    targets: dict[str, list[Target]] = field(default_factory=dict)  # per split, the floor-judged bounds
    speed: Target | None = None  # INT8 against FP32 at the served batch sizes (served form only)

    @property
    def measured(self) -> bool:
        return "test" in self.floor

    def rows(self, kind) -> list[dict]:
        """One report row per gate: the absolute bound, each split's floor-judged bound, then the speed gate."""
        absolute = {t.metric: t.value for t in kind.TARGETS}
        rows = [{**asdict(t), "absolute": absolute.get(t.metric), "validation": t.value,
                 "test": self.targets["test"][i].value} for i, t in enumerate(self.targets["validation"])]
        return rows + ([asdict(self.speed)] if self.speed is not None else [])


def _make(kind, form: str, floor: dict) -> Gates:
    from tritonkit.int8 import floor as floors

    targets = {split: floors.targets(kind, floors.split_floor(floor, split)) for split in SPLITS}
    return Gates(form, floor, targets, kind.SPEED_TARGET if form == "served" else None)


def absolute(kind, form: str, why: str = "not measured") -> Gates:
    """The kind's own bounds, no floor (a search cut before its floor, a spec made in memory)."""
    from tritonkit.int8 import floor as floors

    return _make(kind, form, {"precision": floors.PRECISION[form], "unavailable": why})


def of_floor(kind, form: str, floor: dict | None) -> Gates:
    """Gates judged against a floor record already in hand (a search's, a recipe's)."""
    return _make(kind, form, floor) if floor else absolute(kind, form)


def for_entry(kind, fp32: Path, form: str, entry: dict, log: Callable[[str], None] = print) -> Gates:
    """The gates a recipe file's `entry` is judged by: its floor measured here (`for_form`); a fallback proves
    nothing against a floor, so the one its search recorded stands (a budget-cut search has none)."""
    if entry.get("recipe") is not None:
        return for_form(kind, fp32, form, entry.get("floor"), log=log)
    return of_floor(kind, form, entry.get("floor") or None)



def for_form(kind, fp32: Path, form: str, recorded: dict | None = None, log: Callable[[str], None] = print) -> Gates:
    """The gates of `form`, its floor measured on this machine (or found in the spec's floors file); where it cannot
    be measured here, the floor `recorded` with the recipe stands rather than absolute gates (the floor is the FP32
    graph's, not this CPU's). Once per process and FP32 file."""
    from tritonkit.int8 import floor as floors

    half = floors.measure(kind, fp32, floors.PRECISION[form])
    if "unavailable" in half and "test" in (recorded or {}):
        log(f"{kind.NAME}: using the {recorded['precision']} floor recorded with the recipe ({half['unavailable']})")
        half = {**recorded, "recorded": f"measured where the recipe was searched; here: {half['unavailable']}"}
    if "unavailable" in half:
        log(f"{kind.NAME}: no {half['precision']} floor for the {form} form: {half['unavailable']}; absolute gates")
    else:
        log(f"{kind.NAME}: {form} form's {half['precision']} floor (test split): "
            + ", ".join(f"{t.metric} {half['test'].get(t.metric, float('nan')):.4f}" for t in kind.TARGETS))
    return _make(kind, form, half)
