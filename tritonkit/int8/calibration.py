"""Calibration: activation ranges of every quantizable tensor of a prepared graph over real batches
(onnxruntime's calibrators), computed once per graph and calibration method and shared by every exclusion set
and both activation forms."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from onnxruntime.quantization import CalibrationDataReader

from tritonkit.errors import QuantizationError
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.tensors import Feeds
from tritonkit.int8.transforms import Prepared


class BatchReader(CalibrationDataReader):
    """onnxruntime CalibrationDataReader over a callable of real feed batches, with a tqdm progress bar."""

    def __init__(
        self,
        batches: Callable[[], Iterable[Feeds]],
        total: int | None = None,
        desc: str = "calibrate",
        input_names: list[str] | None = None,
        progress: bool = True,
    ):
        from tqdm import tqdm

        self._make = batches
        self._iter: Iterator[Feeds] | None = None
        self._bar = tqdm(total=total, desc=desc, unit="batch", disable=not progress)
        self._input_names = input_names
        self._count = 0

    def get_next(self) -> Feeds | None:
        if self._iter is None:
            self._iter = iter(self._make())
        if self._bar.total is not None and self._count >= self._bar.total:
            self._bar.close()
            return None
        feeds = next(self._iter, None)
        if feeds is None:
            self._bar.close()
            return None
        self._count += 1
        self._bar.update(1)
        if self._input_names is not None:
            feeds = {k: v for k, v in feeds.items() if k in self._input_names}
        return feeds

    def rewind(self) -> None:
        self._iter, self._count = None, 0


def _method(name: str):
    from onnxruntime.quantization import CalibrationMethod

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "distribution": CalibrationMethod.Distribution,
    }
    if name not in methods:
        raise QuantizationError(f"unknown calibrate_method '{name}' (known: {', '.join(methods)})")
    return methods[name]


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
    import onnx
    from onnxruntime.quantization.calibrate import create_calibrator

    graph_path = prepared.base or prepared.path
    input_names = [i.name for i in onnx.load(str(graph_path), load_external_data=False).graph.input]
    reader = BatchReader(batches, total=recipe.calibration_batches or total_batches,
                         desc=f"calibrate {recipe.name}", input_names=input_names, progress=progress)
    keys = {"CalibPercentile": "percentile", "CalibMovingAverage": "moving_average",
            "CalibMaxIntermediateOutputs": "max_intermediate_outputs"}
    options = {key: recipe.extra_options[name] for name, key in keys.items() if name in recipe.extra_options}
    calibrator = create_calibrator(
        Path(graph_path),
        all_op_types(),
        augmented_model_path=str(Path(workdir) / f"augmented-{recipe.calibrate_method}.onnx"),
        calibrate_method=_method(recipe.calibrate_method),
        providers=["CPUExecutionProvider"],
        extra_options=options,
    )
    if Path(graph_path).stat().st_size > ARENA_MAX_BYTES:
        _without_arena(calibrator)
    if recipe.calibrate_method == "minmax":
        calibrator.collect_data(reader)
    else:
        # Histogram calibrators keep every batch's activations until collect_data returns: feed a few at a time
        # (the histograms merge across calls) so memory stays at a few batches, not the whole calibration set.
        while True:
            chunk = [f for f in (reader.get_next() for _ in range(HISTOGRAM_CHUNK)) if f is not None]
            if chunk:
                calibrator.collect_data(_ListReader(chunk))
            if len(chunk) < HISTOGRAM_CHUNK:
                break
    ranges = calibrator.compute_data()
    del calibrator
    return with_isolated_copies(ranges, prepared)


def with_isolated_copies(ranges, prepared: Prepared):
    """`ranges` plus one entry per input copy of `prepared`'s isolation (a copy's range is its source's)."""
    from onnxruntime.quantization.calibrate import TensorsData

    copies = {copy: ranges[tensor] for copy, tensor in prepared.copies.items() if tensor in ranges}
    if not copies:
        return ranges
    return TensorsData(ranges.calibration_method, {**ranges.data, **copies})


# Graphs up to this size calibrate with onnxruntime's CPU arena (about twice as fast, the same ranges); a larger
# encoder's unoptimised graph would hold gigabytes per batch shape in it.
ARENA_MAX_BYTES = 256 * 2**20


def _without_arena(calibrator) -> None:
    """The calibrator's session without ORT's CPU arena, which keeps its peak for every new batch shape; the
    unoptimised calibration graph of a large encoder peaks at gigabytes per shape."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # as the calibrator's own
    options.enable_cpu_mem_arena = False
    calibrator.infer_session = ort.InferenceSession(calibrator.augmented_model_path, sess_options=options,
                                                    providers=["CPUExecutionProvider"])


HISTOGRAM_CHUNK = 4  # calibration batches per histogram-collection pass


class _ListReader(CalibrationDataReader):
    def __init__(self, batches: list):
        self.batches = iter(batches)

    def get_next(self):
        return next(self.batches, None)


def all_op_types() -> list[str]:
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return sorted(set(QLinearOpsRegistry) | set(QDQRegistry))
