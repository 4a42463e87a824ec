"""A plan checked against ONNX Runtime FP32 (Polygraphy): on which feeds (the spec's validation grid plus one at each
profile's maximum shape) and how closely (tolerances from ONNX Runtime's own low-precision error)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonkit.errors import EngineError
from tritonkit.tensorrt.plans import BATCH_AXIS, Profile

# A plan may differ from ONNX Runtime FP32 by this many times what ONNX Runtime's own INT8/FP16 form of the same
# graph differs on the same inputs: TensorRT fuses and picks kernels of its own, so its rounding is not ORT's.
TOLERANCE_FACTOR = 2.0
# Below this the derived bound would be FP32 noise: an FP16 or INT8 plan cannot be held to it.
TOLERANCE_FLOOR = 1e-4


@dataclass
class OutputDiff:
    output: str
    sample: int
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    profile: str = ""

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol or self.max_rel <= self.rtol


def compare_outputs(reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]],
                    tolerances: Mapping[str, tuple[float, float]]) -> list[OutputDiff]:
    """Per sample and output: max abs/rel difference against (atol, rtol); worst first."""
    diffs = []
    for i, (ref, got) in enumerate(zip(reference, candidate)):
        for name, (atol, rtol) in tolerances.items():
            a, b = np.asarray(ref[name], np.float64), np.asarray(got[name], np.float64)
            if a.shape != b.shape:
                raise EngineError(f"output '{name}' sample {i}: shape {b.shape} != reference {a.shape}")
            abs_diff = np.abs(a - b)
            rel = abs_diff / np.maximum(np.abs(a), 1e-6)
            diffs.append(OutputDiff(name, i, float(abs_diff.max()), float(rel.max()), atol, rtol))
    return sorted(diffs, key=lambda d: (d.ok, -d.max_abs / max(d.atol, 1e-12)))


def check_diffs(diffs: Sequence[OutputDiff], what: str, show: int = 8) -> None:
    failures = [d for d in diffs if not d.ok]
    if failures:
        lines = "\n  ".join(
            f"{d.output} sample {d.sample}{' profile ' + d.profile if d.profile else ''}: "
            f"max|diff| {d.max_abs:.3g} (atol {d.atol}), max rel {d.max_rel:.3g} "
            f"(rtol {d.rtol})" for d in failures[:show]
        )
        raise EngineError(f"{what}: {len(failures)} of {len(diffs)} output checks out of tolerance; worst:\n  {lines}")


def run_polygraphy(runner_factories: Sequence, feeds: Iterable[Mapping[str, np.ndarray]]) -> list[list[dict]]:
    """Run every Polygraphy runner on the same feeds; returns per runner a list of output dicts."""
    from polygraphy.comparator import Comparator

    feeds = list(feeds)
    results = Comparator.run(list(runner_factories), data_loader=feeds)
    return [[dict(out) for out in outputs] for _, outputs in results]


def ort_runner(onnx_path: Path, name: str | None = None):
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(onnx_path), providers=["CPUExecutionProvider"]), name=name)


def fits(profile: Profile, feed: Mapping[str, np.ndarray]) -> bool:
    return all(all(lo <= n <= hi for lo, n, hi in zip(lo_s, feed[name].shape, hi_s))
               for name, (lo_s, _, hi_s) in profile.shapes.items() if name in feed)


def validate_plan(plan_path: Path, reference_onnx: Path, feeds: Sequence[Mapping[str, np.ndarray]],
                  tolerances: Mapping[str, tuple[float, float]], profiles: Sequence[Profile]) -> list[OutputDiff]:
    """Polygraphy: every profile of the plan, each on every feed that fits it, against ONNX Runtime on the same
    inputs; raises EngineError with the worst diffs."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    engine = EngineFromBytes(plan_path.read_bytes())
    (reference,) = run_polygraphy([ort_runner(reference_onnx, "onnxruntime")], feeds)
    diffs = []
    for index, profile in enumerate(profiles):
        chosen = [i for i, f in enumerate(feeds) if fits(profile, f)]
        (got,) = run_polygraphy([TrtRunner(engine, name=f"trt_{profile.name}", optimization_profile=index)],
                                [feeds[i] for i in chosen])
        for d in compare_outputs([reference[i] for i in chosen], got, tolerances):
            d.profile, d.sample = profile.name, chosen[d.sample]
            diffs.append(d)
    diffs.sort(key=lambda d: (d.ok, -d.max_abs / max(d.atol, 1e-12)))
    check_diffs(diffs, f"{plan_path.name} vs onnxruntime")
    return diffs


def validation_feeds(kind) -> list[dict[str, np.ndarray]]:
    """Every point of the spec's validation grid (real inputs), the longest lengths included."""
    return [dict(kind.EXPORT.sample_inputs(point).feeds) for point in kind.EXPORT.validation_grid]


def axis_maxima(feeds: Sequence[Mapping[str, np.ndarray]], dims: Mapping[str, Sequence[int | str]]) -> dict:
    """The largest size each named non-batch axis takes over the validation feeds."""
    out: dict[str, int] = {}
    for feed in feeds:
        for name, ds in dims.items():
            for axis, d in enumerate(ds):
                if isinstance(d, str) and d != BATCH_AXIS and name in feed:
                    out[d] = max(out.get(d, 1), int(feed[name].shape[axis]))
    return out


def extreme_feeds(feeds: Sequence[Mapping[str, np.ndarray]], profiles: Sequence[Profile]) -> list[dict]:
    """A feed at each profile's maximum shape: the real feed already at the longest non-batch sizes, its rows
    repeated up to the maximum batch. Raises when no feed reaches the longest sizes (none can be invented)."""
    out, seen = [], set()
    for profile in profiles:
        top = {name: shapes[2] for name, shapes in profile.shapes.items()}
        source = next((f for f in feeds if all(tuple(f[n].shape[1:]) == tuple(top[n][1:]) for n in top)), None)
        if source is None:
            raise EngineError(f"no validation feed reaches profile '{profile.name}' at its maximum {top}: add a "
                              f"grid point at the longest length so the plan is checked where it is served")
        key = tuple(sorted((n, tuple(s)) for n, s in top.items()))
        if key in seen:
            continue
        seen.add(key)
        batch = next(iter(top.values()))[0]
        rows = len(next(iter(source.values())))
        reps = -(-batch // rows)
        out.append({n: np.concatenate([source[n]] * reps)[:batch] for n in top})
    return out


def derive_tolerances(reference_onnx: Path, low_precision_onnx: Path, feeds: Sequence[Mapping[str, np.ndarray]],
                      outputs: Sequence[str], factor: float = TOLERANCE_FACTOR) -> dict[str, tuple[float, float]]:
    """(atol, 0) per output: `factor` times the largest absolute error of ONNX Runtime's low-precision form against
    its FP32 form on the same inputs (floored at TOLERANCE_FLOOR). No relative bound: near-zero outputs make the
    relative error unbounded (10^4 on the INT8 text encoder), and a check passes on either bound."""
    reference, low = run_polygraphy([ort_runner(reference_onnx, "fp32"), ort_runner(low_precision_onnx, "low")],
                                    feeds)
    out = {}
    for name in outputs:
        err = max(float(np.abs(np.asarray(r[name], np.float64) - np.asarray(g[name], np.float64)).max())
                  for r, g in zip(reference, low))
        out[name] = (max(factor * err, TOLERANCE_FLOOR), 0.0)
    return out
