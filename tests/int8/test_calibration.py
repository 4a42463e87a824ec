"""Calibration statistics collected once (tritonkit.int8.calibration): every method's ranges from one pass equal
what onnxruntime's own calibrators compute from one pass each, fed the same batches in the same chunks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from tritonkit.int8 import calibration


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.dw = torch.nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        x = torch.nn.functional.relu6(self.conv(x))
        x = torch.relu(self.dw(x))
        return self.fc(x.mean((2, 3)))


BATCHES = 9  # two full histogram chunks and a partial one


def _batches():
    rng = np.random.default_rng(3)
    # Later batches reach further out, so the histograms must widen (onnxruntime's re-binning path).
    return ({"x": (rng.standard_normal((4, 3, 12, 12)) * (1 + i / 2)).astype(np.float32)} for i in range(BATCHES))


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("calibration") / "net.onnx"
    torch.onnx.export(Net().eval(), (torch.zeros(1, 3, 12, 12),), str(path), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}}, opset_version=17, dynamo=False)
    return path


def _onnxruntime(graph, tmp_path, method: str, options: dict):
    """onnxruntime's calibrator of `method`, fed chunks of HISTOGRAM_CHUNK batches (the histogram kinds) or all."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator

    calibrator = create_calibrator(graph, calibration.all_op_types(), str(tmp_path / f"ort-{method}.onnx"),
                                   getattr(CalibrationMethod, method.capitalize() if method != "minmax" else "MinMax"),
                                   providers=["CPUExecutionProvider"], extra_options=options)
    batches = list(_batches())
    step = calibration.HISTOGRAM_CHUNK if method != "minmax" else len(batches)

    class Reader:
        def __init__(self, items):
            self.items = iter(items)

        def get_next(self):
            return next(self.items, None)

    for i in range(0, len(batches), step):
        calibrator.collect_data(Reader(batches[i : i + step]))
    return calibrator.compute_data()


def _same(ours, theirs):
    assert set(ours) == set(theirs)
    for name in theirs:
        a, b = ours[name].range_value, theirs[name].range_value
        for x, y in zip(a, b):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), (name, a, b)


def test_one_pass_gives_every_methods_ranges_as_onnxruntime_computes_them(graph, tmp_path):
    stats = calibration.collect(graph, _batches, tmp_path, ("minmax", "percentile", "entropy"), progress=False)
    assert stats.batches == BATCHES
    _same(stats.ranges("minmax"), _onnxruntime(graph, tmp_path, "minmax", {}))
    _same(stats.ranges("percentile"), _onnxruntime(graph, tmp_path, "percentile", {}))
    _same(stats.ranges("percentile", {"CalibPercentile": 99.9}),
          _onnxruntime(graph, tmp_path, "percentile", {"percentile": 99.9}))
    _same(stats.ranges("entropy"), _onnxruntime(graph, tmp_path, "entropy", {}))
    # A minmax-only pass (reductions inside the graph) gives the same minmax ranges as the full one.
    _same(calibration.collect(graph, _batches, tmp_path, ("minmax",), progress=False).ranges("minmax"),
          stats.ranges("minmax"))


def test_a_method_that_was_not_collected_is_refused_by_name(graph, tmp_path):
    from tritonkit.errors import QuantizationError

    stats = calibration.collect(graph, _batches, tmp_path, ("minmax",), max_batches=2, progress=False)
    assert stats.batches == 2
    with pytest.raises(QuantizationError, match="entropy"):
        stats.ranges("entropy")
    with pytest.raises(QuantizationError, match="CalibMaxIntermediateOutputs"):
        stats.ranges("minmax", {"CalibMaxIntermediateOutputs": 3})


def test_the_statistics_keep_no_view_of_onnxruntimes_buffers(graph, tmp_path):
    """One kept view of an onnxruntime output keeps its whole arena alive: MiniLM's minmax pass held 6 GB per
    graph after it returned, and a search that calibrated three graphs ran out of 24 GiB."""
    for methods in (("minmax",), ("minmax", "percentile")):
        stats = calibration.collect(graph, _batches, tmp_path, methods, max_batches=2, progress=False)
        kept = [a for d in (stats.minima, stats.maxima) for arrays in d.values() for a in arrays]
        assert kept and all(a.base is None and a.flags.owndata for a in kept), methods


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(self.norm(x))))


def test_the_pass_also_takes_what_smoothquant_reads(tmp_path):
    """The unsmoothed graph's calibration pass collects each smoothable activation's per-channel max |x|, so the
    SmoothQuant variants of a search need no pass of their own."""
    import onnxruntime as ort

    from tritonkit.int8 import transforms
    from tritonkit.int8.transforms import smoothable_tensors

    torch.manual_seed(0)
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(Encoder().eval(), (torch.zeros(2, 5, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, opset_version=17, dynamo=False)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((2, 5, 16)) * np.linspace(0.1, 9, 16)).astype(np.float32) for _ in range(5)]
    names = smoothable_tensors(path)
    assert len(names) == 2
    stats = calibration.collect(path, lambda: ({"x": d} for d in data), tmp_path, ("minmax",), progress=False,
                                channels=names)
    # Independently: the activations as plain graph outputs, their per-channel max |x| over every batch.
    import onnx

    model = onnx.load(str(path))
    model.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for name in names:
        outs = [session.run([name], {"x": d})[0] for d in data]
        want = np.max([np.abs(o.reshape(-1, o.shape[-1])).max(0) for o in outs], axis=0)
        np.testing.assert_allclose(stats.channel_absmax[name], want, rtol=1e-5)

    def no_data():
        raise AssertionError("SmoothQuant read calibration data")

    out, scales = transforms.smooth(path, tmp_path / "smoothed.onnx", {"MatMul"}, no_data, 0.5,
                                    absmax=stats.channel_absmax)
    assert set(scales) == set(names) and out.exists()


def test_a_smoothed_graphs_ranges_come_from_its_twins_pass(tmp_path):
    """SmoothQuant's Mul(X, 1/s) scales each channel by a positive constant: the smoothed tensor's min and max are
    its channels' times 1/s, and every other tensor is the same function. One pass of the unsmoothed graph gives the
    smoothed graph's ranges (its own pass costs 150 s on all-mpnet-base-v2). Bit for bit where no smoothed MatMul
    runs first; past one, its rescaled weights move the last bits (1 ulp on an AVX2 EPYC)."""
    from tritonkit.int8 import transforms
    from tritonkit.int8.transforms import smoothable_tensors, smoothed_name

    torch.manual_seed(0)
    path = tmp_path / "encoder.onnx"
    torch.onnx.export(Encoder().eval(), (torch.zeros(2, 5, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, opset_version=17, dynamo=False)
    rng = np.random.default_rng(0)
    data = [(rng.standard_normal((2, 5, 16)) * np.linspace(0.1, 9, 16) + 0.5).astype(np.float32) for _ in range(5)]

    def batches():
        return ({"x": d} for d in data)

    twin = calibration.collect(path, batches, tmp_path, ("minmax",), progress=False, channels=smoothable_tensors(path))
    smoothed, scales = transforms.smooth(path, tmp_path / "smoothed.onnx", {"MatMul"}, batches, 0.8,
                                         absmax=twin.channel_absmax)
    (tmp_path / "own").mkdir()
    own = calibration.collect(smoothed, batches, tmp_path / "own", ("minmax",), progress=False)
    order = [o for n in onnx.load(str(smoothed)).graph.node for o in n.output]
    first = min((smoothed_name(t) for t in scales), key=order.index)  # upstream of every smoothed MatMul
    for options in ({}, {"CalibMovingAverage": True}):
        derived, fresh = twin.smoothed(scales).ranges("minmax", options), own.ranges("minmax", options)
        assert set(derived) == set(fresh)
        for name in fresh:
            got, want = (np.asarray(r[name].range_value) for r in (derived, fresh))
            if name == first:
                assert np.array_equal(got, want), (name, got, want)
            elif name in {smoothed_name(t) for t in scales}:
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, err_msg=name)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
    # Not a copy of the unsmoothed ranges: smoothing moved them.
    name = smoothed_name(next(iter(scales)))
    assert not np.allclose(np.asarray(own.ranges("minmax")[name].range_value),
                           np.asarray(twin.ranges("minmax")[next(iter(scales))].range_value))
