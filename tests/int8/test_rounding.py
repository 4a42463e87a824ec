"""GPTQ weight rounding (tritonkit.int8.rounding) on a small conv net it has never seen: lower output error than
round-to-nearest on the data it measured, weights onnxruntime's quantizer turns into exactly the same integers,
and float (excluded) layers keep their original weights."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from tritonkit.int8.calibration import calibrate
from tritonkit.int8.quantize import quantize_prepared
from tritonkit.int8.rounding import QMAX, gptq, round_weights
from tritonkit.int8.settings import QuantRecipe
from tritonkit.int8.transforms import prepare


class Net(torch.nn.Module):
    """Stem conv, depthwise 3x3, pointwise 1x1, grouped conv, then a Linear over pooled features: every layout
    round_weights handles."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pw = torch.nn.Conv2d(16, 32, 1)
        self.grouped = torch.nn.Conv2d(32, 32, 3, padding=2, dilation=2, groups=4)
        self.fc = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(self.dw(x))
        x = torch.relu(self.pw(x))
        x = torch.relu(self.grouped(x))
        return self.fc(x.mean((2, 3)))


def _batches(seed: int, n: int = 4):
    rng = np.random.default_rng(seed)
    return lambda: ({"x": rng.standard_normal((8, 3, 32, 32)).astype(np.float32) + 0.5} for _ in range(n))


@pytest.fixture(scope="module")
def net(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("rounding") / "net.onnx"
    torch.onnx.export(Net().eval(), (torch.zeros(1, 3, 32, 32),), str(path), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}}, opset_version=17, dynamo=False)
    return path


def _weights(path) -> dict[str, np.ndarray]:
    model = onnx.load(str(path))
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if len(i.dims) >= 2}


def _nearest(w: np.ndarray, axis_last: bool = False) -> np.ndarray:
    m = w.T if axis_last else w
    s = np.abs(m).reshape(m.shape[0], -1).max(1).reshape([-1] + [1] * (m.ndim - 1)) / QMAX
    out = np.clip(np.round(m / s), -QMAX, QMAX) * s
    return out.T if axis_last else out


def test_gptq_has_lower_output_error_than_nearest_on_the_data_it_measured():
    rng = np.random.default_rng(1)
    # Correlated inputs with unequal scales: where compensating one column's error in the others pays off.
    x = rng.standard_normal((4096, 48)) @ rng.standard_normal((48, 48)) * rng.uniform(0.1, 3.0, 48)
    w = rng.standard_normal((24, 48))
    codes, scale, kept = gptq(w[None], (x.T @ x / len(x))[None])
    q = codes * scale[:, :, None]
    near = _nearest(w)
    assert kept.all()
    assert np.allclose(np.abs(q[0] / (np.abs(w).max(1, keepdims=True) / QMAX)).max(1), QMAX)
    codes = q[0] / (np.abs(w).max(1, keepdims=True) / QMAX)
    assert np.allclose(codes, np.round(codes), atol=1e-6)  # on the int8 grid
    err_gptq = np.linalg.norm(x @ (q[0] - w).T)
    err_near = np.linalg.norm(x @ (near - w).T)
    assert err_gptq < 0.8 * err_near, (err_gptq, err_near)


def test_rounded_weights_are_what_the_quantizer_stores_and_cut_output_error(net, tmp_path):
    result = round_weights(net, tmp_path / "rounded.onnx", None, _batches(0))
    assert len(result.rounded) == 5 and result.nearest_rows == 0
    rounded = _weights(result.path)
    original = _weights(net)
    for name in result.rounded:
        assert not np.array_equal(rounded[name], original[name]), name

    recipe = QuantRecipe("gptq", op_types=["Conv", "Gemm"], weight_rounding="gptq", activation_type="int8")
    (work := tmp_path / "work").mkdir()
    prepared = prepare(net, recipe, _batches(0), work)
    ranges = calibrate(prepared, recipe, _batches(0), work, progress=False)
    qdq = quantize_prepared(prepared, ranges, recipe)
    # Every weight the quantizer stored dequantizes to the rounded float weight: same scale, same integers.
    inits = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}
    pre = _weights(prepared.path)
    stored = 0
    for node in qdq.graph.node:
        if node.op_type != "DequantizeLinear" or inits.get(node.input[0]) is None:
            continue
        q = inits[node.input[0]]
        if q.ndim < 2:
            continue
        scale = inits[node.input[1]]
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        shape = [1] * q.ndim
        shape[axis] = -1
        source = node.input[0].removesuffix("_quantized")
        np.testing.assert_allclose(q * scale.reshape(shape), pre[source], rtol=1e-6, atol=1e-9)
        stored += 1
    assert stored == 5

    # On fresh data, the rounded weights' output is closer to FP32 than round-to-nearest's.
    feeds = next(_batches(7, 1)())
    ref = ort.InferenceSession(str(net)).run(None, feeds)[0]
    model = onnx.load(str(net))
    for init in model.graph.initializer:
        if len(init.dims) >= 2:
            w = numpy_helper.to_array(init)
            init.CopyFrom(numpy_helper.from_array(_nearest(w, axis_last=False).astype(w.dtype), init.name))
    near = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    got = ort.InferenceSession(str(result.path)).run(None, feeds)[0]
    assert np.abs(got - ref).mean() < np.abs(near - ref).mean()


def test_a_float_layer_keeps_its_original_weights(net, tmp_path):
    recipe = QuantRecipe("gptq", op_types=["Conv", "Gemm"], weight_rounding="gptq", activation_type="int8")
    prepared = prepare(net, recipe, _batches(0), tmp_path)
    ranges = calibrate(prepared, recipe, _batches(0), tmp_path, progress=False)
    dw = next(n for n in onnx.load(str(prepared.path)).graph.node
              if n.op_type == "Conv" and any(a.name == "group" and a.i == 16 for a in n.attribute))
    qdq = quantize_prepared(prepared, ranges, recipe, excluded=[dw.name])
    weight = {i.name: numpy_helper.to_array(i) for i in qdq.graph.initializer}[dw.input[1]]
    np.testing.assert_array_equal(weight, prepared.original_weights[dw.input[1]])
    assert not np.array_equal(weight, _weights(prepared.path)[dw.input[1]])


def test_unknown_rounding_is_refused(net, tmp_path):
    from tritonkit.errors import QuantizationError

    with pytest.raises(QuantizationError, match="weight_rounding"):
        prepare(net, QuantRecipe("x", weight_rounding="adaround"), _batches(0), tmp_path)


def test_a_replayed_recipe_rounds_what_the_search_rounded(net, tmp_path):
    """The search prepares once without float nodes and excludes per candidate; a build replays the recipe with its
    float nodes named up front. Both must store the same int8 weights, or a passing recipe fails its replay."""
    recipe = QuantRecipe("gptq", op_types=["Conv", "Gemm"], weight_rounding="gptq", activation_type="int8")
    (a := tmp_path / "search").mkdir()
    prepared = prepare(net, recipe, _batches(0), a)
    dw = next(n.name for n in onnx.load(str(prepared.path)).graph.node
              if n.op_type == "Conv" and any(at.name == "group" and at.i == 16 for at in n.attribute))
    searched = quantize_prepared(prepared, calibrate(prepared, recipe, _batches(0), a, progress=False), recipe,
                                 excluded=[dw])
    (b := tmp_path / "replay").mkdir()
    named = QuantRecipe("gptq", op_types=["Conv", "Gemm"], weight_rounding="gptq", activation_type="int8",
                        nodes_to_exclude=[dw])
    replayed_prep = prepare(net, named, _batches(0), b)
    replayed = quantize_prepared(replayed_prep, calibrate(replayed_prep, named, _batches(0), b, progress=False),
                                 named)
    one = {i.name: numpy_helper.to_array(i) for i in searched.graph.initializer}
    two = {i.name: numpy_helper.to_array(i) for i in replayed.graph.initializer}
    assert one.keys() == two.keys()
    for name in one:
        np.testing.assert_array_equal(one[name], two[name], err_msg=name)
