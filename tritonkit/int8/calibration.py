"""Calibration: activation ranges of every quantizable tensor of a prepared graph over real batches.

One pass over the calibration batches per graph collects what every calibration method needs of every tensor
(`Statistics`: each batch's min and max, and the histograms of onnxruntime's percentile and entropy collectors);
each method's ranges are then computed from it in memory (`Statistics.ranges`); a SmoothQuant graph's min/max
ranges come from the pass of the graph before smoothing (`Statistics.smoothed`). onnxruntime's calibrators run the
graph once per method; a search that tries three methods on a graph calibrates it once. The tensors, the graph's
arithmetic (unoptimised, as onnxruntime's calibrators run it), the histogram bookkeeping (onnxruntime's own
HistogramCollector, fed the same chunks) and so the ranges are onnxruntime's: tests/int8/test_calibration.py
compares them with its calibrators. The histogram updates, most of an image model's pass, run on every core."""

from __future__ import annotations

import contextlib
import functools
import io
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tritonkit.errors import QuantizationError
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.tensors import Feeds
from tritonkit.int8.transforms import Prepared, channel_absmax

# Histogram methods: how onnxruntime's create_calibrator collects each by default (symmetric percentile histograms
# of |x| in 2048 bins; entropy and distribution histograms of x in 128 and 2048 bins).
HISTOGRAMS = {"percentile": dict(symmetric=True, num_bins=2048),
              "entropy": dict(symmetric=False, num_bins=128, num_quantized_bins=128),
              "distribution": dict(symmetric=False, num_bins=2048)}
METHODS = ("minmax", *HISTOGRAMS)
# Recipe extra_options that change how ranges are computed, not what is collected.
_RANGE_OPTIONS = {"CalibPercentile", "CalibMovingAverage"}
HISTOGRAM_CHUNK = 4  # calibration batches per histogram update, as the search has always fed onnxruntime's
# Graphs up to this size calibrate with onnxruntime's CPU arena (about twice as fast, the same ranges); a larger
# encoder's unoptimised graph would hold gigabytes per batch shape in it.
ARENA_MAX_BYTES = 256 * 2**20


@dataclass
class Statistics:
    """What every calibration method needs of every calibrated tensor of one graph, from one pass."""

    minima: dict[str, list[np.ndarray]] = field(default_factory=dict)  # tensor -> each batch's min, shape [1]
    maxima: dict[str, list[np.ndarray]] = field(default_factory=dict)
    histograms: dict[str, object] = field(default_factory=dict)  # method -> onnxruntime HistogramCollector
    channel_absmax: dict[str, np.ndarray] = field(default_factory=dict)  # tensor -> per-channel max |x| (SmoothQuant)
    # tensor -> each batch's per-channel min and max (last axis): a SmoothQuant variant's ranges (Statistics.smoothed)
    channel_minima: dict[str, list[np.ndarray]] = field(default_factory=dict)
    channel_maxima: dict[str, list[np.ndarray]] = field(default_factory=dict)
    batches: int = 0
    run_s: float = 0.0  # of the pass, the graph runs alone (a plain forward pass costs about this)

    def smoothed(self, scales: dict[str, np.ndarray]) -> Statistics:
        """The statistics of this graph smoothed with `scales` (tritonkit.int8.transforms.smooth: X * (1/s) feeds
        the MatMuls that read X), without a pass: each batch's min and max of a smoothed tensor are those of its
        channels times 1/s (float rounding is monotonic: bit for bit unless a smoothed MatMul runs upstream); every
        other tensor keeps its statistics (the MatMuls' outputs differ from the unsmoothed graph's in their last bits
        only). Min/max only: histograms
        are not carried over."""
        from tritonkit.int8.transforms import smoothed_name

        missing = sorted(set(scales) - set(self.channel_minima))
        if missing:
            raise QuantizationError(f"no per-channel statistics for the smoothed tensors {missing[:3]}: calibrate "
                                    "the smoothed graph")
        minima, maxima = dict(self.minima), dict(self.maxima)
        for name, s in scales.items():
            inv = (1.0 / np.asarray(s, np.float32)).astype(np.float32)  # the graph's own initializer
            minima[smoothed_name(name)] = [np.array([np.min(lo * inv)], np.float32) for lo in self.channel_minima[name]]
            maxima[smoothed_name(name)] = [np.array([np.max(hi * inv)], np.float32) for hi in self.channel_maxima[name]]
        return Statistics(minima, maxima, batches=self.batches)

    def ranges(self, method: str, extra_options: dict | None = None):
        """onnxruntime TensorsData of `method` ("minmax", "percentile", "entropy", "distribution")."""
        from onnxruntime.quantization.calibrate import CalibrationMethod, TensorsData

        options = extra_options or {}
        unknown = sorted(k for k in options if k.startswith("Calib") and k not in _RANGE_OPTIONS)
        if unknown:
            raise QuantizationError(f"calibration extra_options {unknown} are not supported (known: "
                                    f"{', '.join(sorted(_RANGE_OPTIONS))})")
        if method == "minmax":
            # onnxruntime's MinMax calibrator: per-batch ReduceMin/ReduceMax, then the min (or mean) over batches.
            pick = (np.nanmean, np.nanmean) if options.get("CalibMovingAverage") else (np.nanmin, np.nanmax)
            return TensorsData(CalibrationMethod.MinMax, {
                name: (pick[0](self.minima[name], axis=0), pick[1](self.maxima[name], axis=0)) for name in self.minima})
        if method not in self.histograms:
            raise QuantizationError(f"calibrate_method '{method}' was not collected (collected: minmax, "
                                    f"{', '.join(self.histograms)}); known: {', '.join(METHODS)}")
        collector = self.histograms[method]
        if method == "percentile":
            collector.percentile = options.get("CalibPercentile", 99.999)
        with contextlib.redirect_stdout(io.StringIO()):  # onnxruntime prints per call
            result = collector.compute_collection_result()
        return TensorsData(getattr(CalibrationMethod, method.capitalize()), result)


def collect(graph_path: Path, batches: Callable[[], Iterable[Feeds]], workdir: Path,
            methods: Sequence[str] = ("minmax",), max_batches: int | None = None, progress: bool = True,
            desc: str = "calibrate", channels: Sequence[str] = ()) -> Statistics:
    """One pass of `graph_path` over the calibration batches, collecting `methods`' statistics (minmax always) and
    the per-channel max |x| of the `channels` tensors (what SmoothQuant reads: its variants then need no pass)."""
    import onnx
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import HistogramCalibrater, HistogramCollector, MinMaxCalibrater
    from tqdm import tqdm

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise QuantizationError(f"unknown calibrate_method {unknown} (known: {', '.join(METHODS)})")
    histograms = [m for m in methods if m in HISTOGRAMS]
    # onnxruntime's own augmentation: the MinMax one (reductions in the graph: little memory) when no histogram is
    # wanted, else the histogram one (every calibrated tensor is an output).
    calibrator = (HistogramCalibrater if histograms else MinMaxCalibrater)(
        Path(graph_path), all_op_types(), augmented_model_path=str(Path(workdir) / "augmented.onnx"))
    calibrator.augment_graph()
    outputs_before = {o.name for o in calibrator.model.graph.output}
    extra = [c for c in channels if c not in outputs_before]
    if extra:
        calibrator.model.graph.output.extend(onnx.helper.make_tensor_value_info(c, onnx.TensorProto.FLOAT, None)
                                             for c in extra)
        onnx.save(calibrator.model, calibrator.augmented_model_path)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as onnxruntime's calibrators
    options.enable_cpu_mem_arena = Path(graph_path).stat().st_size <= ARENA_MAX_BYTES
    session = ort.InferenceSession(calibrator.augmented_model_path, sess_options=options,
                                   providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    inputs = {i.name for i in session.get_inputs()}
    graph_inputs = [i.name for i in onnx.load(str(graph_path), load_external_data=False).graph.input]
    stats = Statistics()
    if histograms:
        stats.histograms = {m: HistogramCollector(method=m, percentile=99.999, scenario="same",
                                                  **{"num_quantized_bins": 128, **HISTOGRAMS[m]}) for m in histograms}
        tensors = calibrator.tensors_to_calibrate
    else:  # ReduceMin/ReduceMax output pairs, named <tensor>_ReduceMin / <tensor>_ReduceMax
        at = {n: i for i, n in enumerate(outputs)}
        pairs = [(n.removesuffix("_ReduceMin"), i, at[n.removesuffix("_ReduceMin") + "_ReduceMax"])
                 for i, n in enumerate(outputs) if i >= calibrator.num_model_outputs and n.endswith("_ReduceMin")]
    del calibrator
    chunk: list[dict[str, np.ndarray]] = []
    bar = tqdm(total=max_batches, desc=desc, unit="batch", disable=not progress)
    channel_at = {c: outputs.index(c) for c in channels}
    for feeds in _limited(batches(), max_batches):
        t0 = time.perf_counter()
        got = session.run(None, {k: v for k, v in feeds.items() if k in graph_inputs})
        stats.run_s += time.perf_counter() - t0
        stats.batches += 1
        bar.update(1)
        for name, i in channel_at.items():
            seen = stats.channel_absmax.get(name)
            stats.channel_absmax[name] = channel_absmax([got[i]] if seen is None else [got[i], seen[None]])
            flat = got[i].reshape(-1, got[i].shape[-1])
            stats.channel_minima.setdefault(name, []).append(flat.min(0))
            stats.channel_maxima.setdefault(name, []).append(flat.max(0))
        if not histograms:
            # Copies: onnxruntime's outputs can be views of its arena, and one kept view keeps the whole arena (GBs
            # for a text encoder's shapes) alive for as long as the statistics are.
            for name, lo, hi in pairs:
                stats.minima.setdefault(name, []).append(got[lo].copy())
                stats.maxima.setdefault(name, []).append(got[hi].copy())
            continue
        # A graph output that is also an input comes back as the feed's own buffer (onnxruntime issue 21922).
        values = {n: (v.copy() if n in inputs else v) for n, v in zip(outputs, got) if n in tensors}
        for name, v in values.items():
            stats.minima.setdefault(name, []).append(np.array([np.nanmin(v)], v.dtype))
            stats.maxima.setdefault(name, []).append(np.array([np.nanmax(v)], v.dtype))
        chunk.append(values)
        if len(chunk) == HISTOGRAM_CHUNK:
            _update(stats, chunk)
            chunk = []
    bar.close()
    if chunk:
        _update(stats, chunk)
    if not stats.batches:
        raise QuantizationError("calibration: the calibration data yielded no batch")
    return stats


def _update(stats: Statistics, chunk: list[dict[str, np.ndarray]]) -> None:
    """Feed one chunk of batches to every histogram collector, as onnxruntime's calibrator feeds one collect_data
    call (each tensor's arrays of the chunk together). Each (tensor, collector) state is its own, and numpy's sorts
    and ufuncs release the GIL, so the updates run on every core: about half the pass on 2 cores, the same ranges."""
    names = sorted(chunk[0], key=lambda name: -chunk[0][name].size)  # the largest first: an even finish
    with contextlib.redirect_stdout(io.StringIO()):  # onnxruntime prints per call
        jobs = [_pool().submit(collector.collect, {name: [values[name] for values in chunk]})
                for name in names for collector in stats.histograms.values()]
        for job in jobs:
            job.result()


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(len(os.sched_getaffinity(0)), thread_name_prefix="tritonkit-histograms")


def _limited(it: Iterable[Feeds], n: int | None) -> Iterator[Feeds]:
    for i, feeds in enumerate(it):
        if n is not None and i >= n:
            return
        yield feeds


def smooths_twins_graph(recipe) -> bool:
    """Whether SmoothQuant of `recipe` (a QuantRecipe or a search's Recipe) reads the graph its unsmoothed twin
    calibrates: no weight rounding or bias correction runs before it."""
    return recipe.smooth_alpha is not None and recipe.weight_rounding == "nearest" and not recipe.bias_correction


def smoothed_from_twin(recipe) -> bool:
    """Whether `recipe`'s ranges come from its unsmoothed twin's pass (Statistics.smoothed) rather than a pass of
    their own: it smooths its twin's graph (smooths_twins_graph) and takes min/max ranges. The search and a replay
    that calibrates both follow it, so they build the same bytes."""
    return smooths_twins_graph(recipe) and recipe.calibrate_method == "minmax"


def calibrate(
    prepared: Prepared,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    workdir: Path,
    total_batches: int | None = None,
    progress: bool = True,
):
    """Activation ranges (onnxruntime TensorsData) of every quantizable tensor: one calibration serves any
    exclusion set and both activation forms, so a search quantizes many times per calibration. The graph before
    input isolation is calibrated (an isolated copy's range is its source's), so both placements can share it."""
    return with_isolated_copies(base_ranges(prepared, recipe, batches, workdir, total_batches, progress), prepared)


def base_ranges(prepared: Prepared, recipe: QuantRecipe, batches: Callable[[], Iterable[Feeds]], workdir: Path,
                total_batches: int | None = None, progress: bool = True):
    """The ranges of the graph before input isolation (what tritonkit.int8.params stores)."""
    stats = collect(prepared.base or prepared.path, batches, workdir, (recipe.calibrate_method,),
                    recipe.calibration_batches or total_batches, progress, desc=f"calibrate {recipe.name}")
    return stats.ranges(recipe.calibrate_method, recipe.extra_options)


def with_isolated_copies(ranges, prepared: Prepared):
    """`ranges` plus one entry per input copy of `prepared`'s isolation (a copy's range is its source's)."""
    from onnxruntime.quantization.calibrate import TensorsData

    copies = {copy: ranges[tensor] for copy, tensor in prepared.copies.items() if tensor in ranges}
    if not copies:
        return ranges
    return TensorsData(ranges.calibration_method, {**ranges.data, **copies})


def all_op_types() -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
