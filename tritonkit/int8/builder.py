"""The one INT8 graph builder: a recipe's graph from its FP32 file, for the search and the replay alike.

Takes a search spec (calibration data, weight op types), the FP32 file and, optionally, a recipe's committed
quantization parameters (tritonkit.int8.params); returns Q/DQ graphs (`build`) and the parameters that rebuild them
(`quant_params`). Prepares once per transform set and calibrates once per (graph, method), in a `Workspace` that the
searches of one model share; built from given parameters it reads no calibration data, so a replay of a committed
recipe is the graph its search judged, byte for byte.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tritonkit.int8.calibration import all_op_types
from tritonkit.int8.params import QuantParams
from tritonkit.int8.records import Recipe, SearchSpec
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.tensors import Feeds
from tritonkit.int8.transforms import smoothable_tensors


class Workspace:
    """What searches of one model share: prepared graphs, calibrated ranges, the validation references. The
    TensorRT form's graphs and ranges are the served search's int8/inputs ones, so the second search calibrates
    nothing new."""

    def __init__(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="tritonkit-search-")
        self.prepared: dict[tuple, Any] = {}
        self.stats: dict[str, Any] = {}  # calibrated graph digest -> calibration.Statistics
        self.ranges: dict[tuple, Any] = {}
        self.digests: dict[Path, str] = {}
        self.val = None  # the validation split's Evaluator, once made

    def graphs_only(self) -> Workspace:
        """A workspace with this one's prepared graphs (a plain start's do not depend on the calibration data) but
        no ranges: a speed probe's, calibrated on a few batches, must never reach a search. Closed by this one."""
        other = Workspace.__new__(Workspace)
        other.tmp, other.prepared, other.digests = self.tmp, self.prepared, self.digests
        other.stats, other.ranges, other.val = {}, {}, None
        return other

    def close(self) -> None:
        self.tmp.cleanup()


# Calibration batches a speed probe's graphs read (timing.speed_probe): a graph's speed does not depend on its ranges.
PROBE_CALIBRATION_BATCHES = 2


class FewCalibrationBatches:
    """A search spec whose calibration reads PROBE_CALIBRATION_BATCHES batches: what a speed probe searches with."""

    def __init__(self, spec: SearchSpec):
        self._spec = spec

    def __getattr__(self, name: str):
        return getattr(self._spec, name)

    def calibration_batch_count(self) -> int:
        return min(PROBE_CALIBRATION_BATCHES, self._spec.calibration_batch_count())


def _opens_exactly(model) -> None:
    """Raises QuantizationError where onnxruntime's exact int8 path, which every served session off VNNI takes, cannot
    open `model`: on an AVX2 EPYC its s8-to-u8 weight rewrite refused a tiny encoder's uint8/all start (a LayerNorm
    weight's converted initializer added twice), which crashed the build rather than rejecting the candidate."""
    from tritonkit.errors import QuantizationError
    from tritonkit.int8 import evaluate

    try:
        evaluate.session(model, exact=True)
    except Exception as exc:  # onnxruntime raises its own RuntimeException types
        raise QuantizationError(f"onnxruntime's exact int8 path cannot open this graph: {str(exc)[-200:]}") from exc


class Builder:
    """`spec`'s INT8 graphs of `fp32`, from a search's `Recipe` or any `QuantRecipe`. `committed`: (recipe,
    QuantParams) built from its parameters, without a calibration pass; `exact`: a graph onnxruntime's exact int8
    path cannot open is rejected (QuantizationError); `all_methods`: a calibration pass collects every method the
    data allows (a search tries them), else only the recipe's; `took(kind, seconds)`: told of each calibration pass
    (a search's budget learns from it); `name`: what a `Recipe`'s graphs are named (onnx producer_name)."""

    def __init__(self, spec, fp32: Path, workspace: Workspace | None = None, committed=None, exact: bool = False,
                 progress: bool = True, took: Callable[[str, float], None] | None = None, all_methods: bool = True,
                 name: str = "searched"):
        self.spec, self.fp32, self.committed, self.exact, self.progress = spec, Path(fp32), committed, exact, progress
        self.name = name  # a Recipe's graphs carry it (producer_name): "<model>-<form>", the search's and replay's
        self.ws = workspace or Workspace()
        self.all_methods = all_methods
        self.setup_s = 0.0  # time spent preparing and calibrating graphs, kept apart from the steps' own
        self._took = took or (lambda kind, seconds: None)
        self._built: tuple[str, object] | None = None  # (recipe key, graph): the last recipe quantized

    def quant(self, r: Recipe | QuantRecipe) -> QuantRecipe:
        return r if isinstance(r, QuantRecipe) else r.to_quant(self.spec.WEIGHT_OPS, name=self.name)

    def prepared_key(self, r: Recipe | QuantRecipe) -> tuple:
        return prepared_key(self.quant(r))

    def _batches(self, q: QuantRecipe) -> int | None:
        return q.calibration_batches or self.spec.calibration_batch_count()

    def methods(self, r: Recipe | QuantRecipe | None = None) -> list[tuple[str, dict]]:
        """The calibration methods a pass collects: histogram calibrators concatenate every batch's tensors, so
        they need equal-shape calibration feeds."""
        if not self.all_methods and r is not None:
            return [(self.quant(r).calibrate_method, {})]
        shapes = {tuple(v.shape for v in b.values()) for b in self.spec.calibration_batches()}
        methods = [("minmax", {})]
        if len(shapes) == 1:  # (their statistics come from the same pass as minmax's: calibration.collect)
            methods += [("percentile", {"CalibPercentile": 99.999}), ("entropy", {})]
        return methods

    def prepare(self, r: Recipe | QuantRecipe):
        from tritonkit.int8.calibration import smooths_twins_graph
        from tritonkit.int8.transforms import prepare

        q = self.quant(r)
        key = prepared_key(q)
        if key not in self.ws.prepared:
            absmax, given = None, self.given(q)
            if given is None and smooths_twins_graph(q):  # its activations' maxima came with the unsmoothed pass
                twin = replace(q, smooth_alpha=None)
                self.calibrate(twin)
                absmax = self.ws.stats[self.digest(self.graph(twin))].channel_absmax
            work = Path(self.ws.tmp.name) / f"prep{len(self.ws.prepared)}"
            work.mkdir()
            t0 = time.perf_counter()
            self.ws.prepared[key] = prepare(self.fp32, q, self.spec.calibration_batches, work, self._batches(q),
                                            given, absmax=absmax)
            self.setup_s += time.perf_counter() - t0
        return self.ws.prepared[key]

    def graph(self, r: Recipe | QuantRecipe) -> Path:
        prepared = self.prepare(r)
        return prepared.base or prepared.path

    def _ranges(self, q: QuantRecipe):
        """The ranges of `q`'s graph before input isolation (what tritonkit.int8.params stores)."""
        from tritonkit.int8.calibration import collect, smoothed_from_twin

        prepared = self.prepare(q)
        graph = prepared.base or prepared.path
        # Keyed by the calibrated graph's content: placements whose graphs differ only by input isolation share it.
        digest = self.digest(graph)
        key = (digest, q.calibrate_method, json.dumps(q.extra_options))
        if key in self.ws.ranges:
            return self.ws.ranges[key]
        given = self.given(q)
        if given is not None and (q.calibrate_method, q.extra_options) == \
                (self.committed[0].calibrate_method, self.committed[0].extra_options):
            self.ws.ranges[key] = given.tensors_data()  # what a pass over the same data gives (test_params)
            return self.ws.ranges[key]
        if smoothed_from_twin(q):
            # SmoothQuant on the graph its twin calibrated (prepare did): that pass gives these ranges.
            twin = self.ws.stats[self.digest(self.graph(replace(q, smooth_alpha=None)))]
            self.ws.ranges[key] = twin.smoothed(prepared.smooth_scales).ranges(q.calibrate_method, q.extra_options)
            return self.ws.ranges[key]
        # A minmax pass first; the histogram methods' statistics (onnxruntime's collectors, the pass's costliest
        # part on long rows: most of a MiniLM reranker's 612 s first start) in one later pass, when a recipe
        # asks for one of them. Each method's ranges are computed from its statistics, whichever pass took them.
        stats = self.ws.stats.get(digest)
        wanted = [] if stats is None else [m for m, _ in self.methods(q) if m not in ("minmax", *stats.histograms)]
        if stats is None or (q.calibrate_method != "minmax" and wanted):
            histograms = q.calibrate_method != "minmax"
            # An unsmoothed graph's first pass also takes what SmoothQuant variants read (per-channel max |x|).
            channels = [] if stats is not None or q.smooth_alpha is not None or "MatMul" not in self.spec.WEIGHT_OPS \
                else list(smoothable_tensors(graph))
            methods = [m for m, _ in self.methods(q) if histograms or m == "minmax"] if stats is None else wanted
            t0 = time.perf_counter()
            setup = self.setup_s
            got = collect(graph, self.spec.calibration_batches, prepared.path.parent, methods, self._batches(q),
                          self.progress, desc=f"calibrate {q.name}", channels=channels)
            if stats is None:
                self.ws.stats[digest] = got
            else:
                stats.histograms.update(got.histograms)
            # Without the twin's preparing it may have triggered (a SmoothQuant graph reads its twin's pass).
            took = time.perf_counter() - t0 - (self.setup_s - setup)
            self._took("calibrate", took)
            self._took("forward", got.run_s)
            self.setup_s += took
        self.ws.ranges[key] = self.ws.stats[digest].ranges(q.calibrate_method, q.extra_options)
        return self.ws.ranges[key]

    def calibrate(self, r: Recipe | QuantRecipe):
        """`r`'s activation ranges, with input isolation's copies (what quantize_prepared takes)."""
        from tritonkit.int8.calibration import with_isolated_copies

        q = self.quant(r)
        return with_isolated_copies(self._ranges(q), self.prepare(q))

    def given(self, r: Recipe | QuantRecipe):
        """The committed parameters where `r` prepares the committed recipe's graph (the same transforms), else None."""
        if self.committed is None or self.prepared_key(r) != self.prepared_key(self.committed[0]):
            return None
        return self.committed[1]

    def quant_params(self, r: Recipe | QuantRecipe, recipe_digest: str, origin: str = "", source: str | None = None):
        """The quantization parameters (tritonkit.int8.params) of `r` as built here: a replay of the committed recipe
        then rebuilds the same graph without calibrating. `source`: the FP32 file's sha256, where known."""
        from tritonkit.int8 import params

        q = self.quant(r)
        return params.capture(self.prepare(q), self._ranges(q), q.calibrate_method,
                              source or params.file_digest(self.fp32), recipe_digest, origin)

    def digest(self, path: Path) -> str:
        import hashlib

        import onnx

        if path not in self.ws.digests:
            self.ws.digests[path] = hashlib.sha256(onnx.load(str(path)).SerializeToString()).hexdigest()
        return self.ws.digests[path]

    def build(self, r: Recipe | QuantRecipe, check: bool = False):
        """`r`'s INT8 graph. The last one is kept: a winner is scored, checked on its runtime, timed and tested in
        turn, and nothing downstream changes a graph (sessions and files are made from copies). `check`: onnx's
        full checker too (a search's candidates only feed onnxruntime, which checks them)."""
        from tritonkit.int8 import granularity
        from tritonkit.int8.quantize import quantize_prepared

        q = self.quant(r)
        dynamic = getattr(r, "dynamic", None) or {}
        key = json.dumps([asdict(q), dynamic], sort_keys=True)
        if self._built is None or self._built[0] != key:
            self._built = None  # the old graph's memory goes before the new one is made
            model = quantize_prepared(self.prepare(q), self.calibrate(q), q, getattr(r, "float_nodes", ()),
                                      check=check)
            if dynamic:  # from the weights alone: nothing calibrated, so a replay rebuilds the same bytes
                model = granularity.apply(model, dynamic["scheme"], dynamic["nodes"])
            if self.exact:
                _opens_exactly(model)
            self._built = (key, model)
        return self._built[1]

    def write(self, r: Recipe | QuantRecipe, out: Path, check: bool = False) -> Path:
        """`r`'s graph saved at `out`."""
        import onnx

        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(self.build(r, check), str(out))
        return out

    def close(self) -> None:
        self._built = None
        self.ws.close()


def prepared_key(q: QuantRecipe) -> tuple:
    """What a recipe's prepared graph depends on: recipes equal in it share one (Workspace.prepared). Its first
    four entries are the placement's and the transforms' (the planner reads them), then the rest prepare reads."""
    placement = json.dumps([q.op_types, q.quantize_outputs, q.isolate_inputs])
    return (placement, q.smooth_alpha, q.bias_correction, q.weight_rounding,
            json.dumps([q.merge_parallel_matmuls, q.preprocess, q.per_channel, q.calibration_batches,
                        q.exclude_patterns]))


def recipe_key(r: Recipe) -> str:
    return json.dumps(asdict(r), sort_keys=True)


# -- one graph, from a QuantRecipe and its calibration data (library callers, benchmarks) --------------------------

def quantize(
    model_path: Path,
    out_path: Path,
    recipe: QuantRecipe,
    batches: Callable[[], Iterable[Feeds]],
    total_batches: int | None = None,
    progress: bool = True,
) -> Path:
    """Static Q/DQ INT8 of `model_path` calibrated on `batches()`; returns `out_path` (checked by check_qdq)."""
    quantize_with_params(model_path, out_path, recipe, batches, total_batches, progress)
    return Path(out_path)


def quantize_with_params(model_path: Path, out_path: Path, recipe: QuantRecipe, batches: Callable[[], Iterable[Feeds]],
                         total_batches: int | None = None, progress: bool = True, given: QuantParams | None = None,
                         recipe_digest: str = "", origin: str = "", source: str | None = None) -> QuantParams:
    """`quantize`, from `given` parameters (no calibration data is read) or calibrating; returns the parameters
    used, which rebuild the same graph bytes (tritonkit.int8.params). The search's builder (tritonkit.int8.builder)
    builds it, so a one-off graph and a searched one are made alike. `source`: the sha256 of `model_path` when the
    caller already has it."""
    spec = _OneRecipe(recipe, batches, total_batches)
    builder = Builder(spec, model_path, committed=None if given is None else (recipe, given), progress=progress,
                      all_methods=False)
    try:
        builder.write(recipe, out_path, check=True)
        return builder.quant_params(recipe, recipe_digest, origin, source)
    finally:
        builder.close()


class _OneRecipe:
    """What the builder reads of a search spec, for one recipe and its calibration data."""

    def __init__(self, recipe: QuantRecipe, batches: Callable[[], Iterable[Feeds]], total: int | None):
        self.WEIGHT_OPS = tuple(recipe.op_types or all_op_types())
        self.calibration_batches, self._total = batches, total

    def calibration_batch_count(self) -> int | None:
        return self._total
