"""INT8 against FP32 speed, as the speed gate judges it: interleaved runs of both files on the variants that serve
them, with a bootstrap interval of the ratio (`speedup`), and the FP32 competitor a served INT8 file must beat here
(`fp32_competitor`)."""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from tritonkit.int8.evaluate import as_file
from tritonkit.int8.records import SearchSpec
from tritonkit.serving.runtimes import DEFAULT, open_variant

# The speed gate judges INT8 ÷ FP32 by a 95 % interval, not one median: rounds of `repeats` interleaved pairs are
# added until the interval lies wholly above or below the gate, or MAX_SPEED_ROUNDS rounds were spent.
SPEED_CONFIDENCE = 0.95
MAX_SPEED_ROUNDS = 5
BOOTSTRAP_RESAMPLES = 2000


def ratio_interval(fp32_s: Sequence[float], int8_s: Sequence[float],
                   confidence: float = SPEED_CONFIDENCE) -> tuple[float, float]:
    """A percentile-bootstrap interval of median(FP32 time) ÷ median(INT8 time) over paired samples (each pair
    resampled together: interleaved runs share the machine's moment). Seeded: the same samples give the same
    interval."""
    fp32, int8 = np.asarray(fp32_s, np.float64), np.asarray(int8_s, np.float64)
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(fp32), size=(BOOTSTRAP_RESAMPLES, len(fp32)))
    ratios = np.median(fp32[picks], axis=1) / np.median(int8[picks], axis=1)
    tail = (1 - confidence) / 2 * 100
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def speedup(spec: SearchSpec, fp32: Path, model, batches: Sequence[int], repeats: int = 7,
            min_sample_s: float = 0.02, variants: tuple[str, str] = (DEFAULT, DEFAULT),
            separate_from: float | None = None) -> dict[str, float]:
    """INT8 ÷ FP32 throughput per batch size, each file on the variant that serves it (`variants`: FP32's, INT8's;
    tritonkit.serving.runtimes.VARIANTS), single-instance threads as served, runs interleaved (median), with its
    interval (`ratio_interval`). With `separate_from` (the speed gate's bound), rounds are added until the interval
    lies wholly on one side of it or MAX_SPEED_ROUNDS are spent.

    Each sample loops a run until it lasts `min_sample_s`: a small model's single run takes tens of microseconds,
    where the timer and the scheduler decide the ratio."""
    with tempfile.TemporaryDirectory(prefix="tritonkit-speed-") as tmp:
        model = as_file(model, Path(tmp))  # a candidate built in memory: the runtimes open files
        sessions = {"fp32": open_variant(variants[0], fp32, spec.SERVE_THREADS),
                    "int8": open_variant(variants[1], model, spec.SERVE_THREADS)}
        return _timed(spec, sessions, batches, repeats, min_sample_s, separate_from)


# On a CPU with native bf16 the INT8 name may serve the FP32 file on OpenVINO bf16 instead (the runtime choice
# times it there when the search falls back): it computes the served form's floor, so it meets the floor-judged
# gates by construction, and on AMX it outran INT8 (docs/int8-search.md). INT8 must beat that, not FP32 in fp32.
BF16_COMPETITOR = "openvino-bf16"


def fp32_competitor(spec: SearchSpec, fp32: Path, served: str, min_gain: float, repeats: int = 3,
                    min_sample_s: float = 0.02, log=None) -> tuple[str, dict[str, float]]:
    """(variant, its timings) of the FP32 file as the INT8 name would serve it here when no INT8 holds: `served`
    (the FP32 model's variant), or BF16_COMPETITOR on a CPU with native bf16 where it is faster by `min_gain`
    (geometric mean over the served batch sizes, the runtime choice's rule). The served speed gate races it."""
    from tritonkit import envinfo

    if not envinfo.has_bf16() or served == BF16_COMPETITOR:
        return served, {}
    sessions = {"fp32": open_variant(served, fp32, spec.SERVE_THREADS),
                "int8": open_variant(BF16_COMPETITOR, fp32, spec.SERVE_THREADS)}  # _timed's keys: a, then b
    timed = _timed(spec, sessions, spec.SPEED_BATCHES, repeats, min_sample_s)
    gain = float(np.exp(np.mean([np.log(timed[f"speedup_batch{b}"]) for b in spec.SPEED_BATCHES])))
    chosen = BF16_COMPETITOR if gain >= min_gain else served
    if log is not None:
        log(f"  the FP32 file on {BF16_COMPETITOR} runs {gain:.2f}x its {served} speed here: the speed gate races "
            f"INT8 against FP32 on {chosen}")
    return chosen, {"bf16_vs_served": round(gain, 3), **{k.replace("speedup", "bf16_gain"): round(v, 3)
                                                           for k, v in timed.items() if k.startswith("speedup_batch")}}


def race(spec: SearchSpec, fp32: tuple[str, Path], parent: tuple[str, object], rivals: Mapping[str, tuple[str, object]],
         batches: Sequence[int], repeats: int = 7, min_sample_s: float = 0.02, separate_from: float | None = None
         ) -> dict[str, dict[str, float]]:
    """A float-bearing candidate (`parent`) and the `rivals` that change it, each (variant, file or ModelProto),
    timed interleaved with the FP32 file in one run, so a rival is judged head to head with its parent, not by two
    ratios to FP32 from two runs. Returns, by name ("parent" and each rival's), `speedup`'s keys against FP32, and
    for each rival `over_parent*` keys: parent's time ÷ its time, with the interval, per batch size; `over_parent_lo`
    is the slowest batch size's lower bound. Rounds are added until every rival's interval against its parent lies
    off 1.0 (and, with `separate_from`, every file's against FP32 off that gate), or MAX_SPEED_ROUNDS are spent."""
    with tempfile.TemporaryDirectory(prefix="tritonkit-race-") as tmp:
        files = {"fp32": fp32, "parent": parent, **rivals}
        sessions = {}
        for k, (variant, model) in files.items():
            (Path(tmp) / k).mkdir()
            sessions[k] = open_variant(variant, as_file(model, Path(tmp) / k), spec.SERVE_THREADS)

        def settled(times: dict[str, list[float]]) -> bool:
            pairs = [(1.0, "parent", k) for k in rivals]
            pairs += [(separate_from, "fp32", k) for k in files if k != "fp32" and separate_from is not None]
            return all(not lo <= bound <= hi for bound, lo, hi in
                       ((b, *ratio_interval(times[base], times[k])) for b, base, k in pairs))

        out: dict[str, dict[str, float]] = {k: {} for k in files if k != "fp32"}
        for batch in batches:
            times = _samples(spec, sessions, batch, repeats, min_sample_s, settled)
            for k in out:
                out[k].update(_pair(batch, times["fp32"], times[k]))
                if k in rivals:
                    out[k].update(_pair(batch, times["parent"], times[k], "over_parent"))
        for k, speed in out.items():
            _summarise(speed)
            if k in rivals:
                speed["over_parent_lo"] = min(v for n, v in speed.items() if n.startswith("over_parent_lo_batch"))
        return out


def _samples(spec: SearchSpec, sessions: dict, batch: int, repeats: int, min_sample_s: float,
             settled: Callable[[dict[str, list[float]]], bool] | None = None) -> dict[str, list[float]]:
    """Seconds per run of each session at `batch`, interleaved: rounds of `repeats` until `settled(times)`."""
    names = {k: [s.runner.output_names[0]] for k, s in sessions.items()}
    feeds = spec.speed_feeds(batch)
    loops: dict[str, int] = {}
    for k, s in sessions.items():
        s.run(names[k], feeds)
        t0 = time.perf_counter()
        s.run(names[k], feeds)
        loops[k] = max(1, math.ceil(min_sample_s / max(time.perf_counter() - t0, 1e-6)))
    n = max(loops.values())  # the same loop count for all, so each sample costs them alike
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _round in range(MAX_SPEED_ROUNDS):
        for _ in range(repeats):
            for k, s in sessions.items():
                t0 = time.perf_counter()
                for _ in range(n):
                    s.run(names[k], feeds)
                times[k].append((time.perf_counter() - t0) / n)
        if settled is None or settled(times):
            break
    return times


def _pair(batch: int, base_s: Sequence[float], other_s: Sequence[float], key: str = "speedup") -> dict[str, float]:
    """One batch size's ratio base ÷ other (medians) and its interval; with `key` "speedup", both times in ms."""
    lo, hi = ratio_interval(base_s, other_s)
    base_ms, other_ms = (float(np.median(t)) * 1e3 for t in (base_s, other_s))
    out = {f"fp32_ms_batch{batch}": base_ms, f"int8_ms_batch{batch}": other_ms} if key == "speedup" else {}
    return {**out, f"{key}_batch{batch}": base_ms / other_ms, f"{key}_lo_batch{batch}": round(lo, 4),
            f"{key}_hi_batch{batch}": round(hi, 4), f"speed_samples_batch{batch}": len(other_s)}


def _summarise(out: dict[str, float]) -> dict[str, float]:
    out["int8_speedup"] = min(v for k, v in out.items() if k.startswith("speedup_batch"))
    # What the gate judges: the slowest batch size's lower bound (INT8 faster by more than the noise measured).
    out["int8_speedup_lo"] = min(v for k, v in out.items() if k.startswith("speedup_lo_batch"))
    return out


def _timed(spec: SearchSpec, sessions: dict, batches: Sequence[int], repeats: int, min_sample_s: float,
           separate_from: float | None = None) -> dict[str, float]:
    def settled(times: dict[str, list[float]]) -> bool:
        lo, hi = ratio_interval(times["fp32"], times["int8"])
        return separate_from is None or lo > separate_from or hi < separate_from

    out: dict[str, float] = {}
    for batch in batches:
        times = _samples(spec, sessions, batch, repeats, min_sample_s, settled)
        out.update(_pair(batch, times["fp32"], times["int8"]))
    return _summarise(out)


def describe(speed: dict[str, float]) -> str:
    def one(b: str, v: float) -> str:
        lo, hi = speed.get(f"speedup_lo_batch{b}"), speed.get(f"speedup_hi_batch{b}")
        return f"b{b}:x{v:.2f}" + (f" [{lo:.2f}, {hi:.2f}]" if lo is not None and hi is not None else "")
    return " ".join(one(k.removeprefix("speedup_batch"), v) for k, v in speed.items()
                    if k.startswith("speedup_batch")) or "-"
