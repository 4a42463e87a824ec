"""INT8 gates judged against the FP32 graph's own half-precision floor (tritonkit.int8.floor).

The rule is checked with numbers worked out here; the floor itself is measured for real on the search tests' tiny
model (tests.support.tiny_search: one outlier channel), whose INT8 passes only thanks to its floor when a layer may
stay float, and is far worse than its floor, so falls back, when the compute gate forbids that."""

from __future__ import annotations

import dataclasses
import json
from typing import ClassVar

import numpy as np
import onnx
import pytest
import torch
from onnx import helper, numpy_helper

from tests.support.tiny_search import TinySpec, export_tiny
from tritonkit import envinfo
from tritonkit.int8 import decide, evaluate, floor, gates, pages, recipe, report, search
from tritonkit.kinds.gates import Target


class Spec:
    TARGETS = (Target("a", ">=", 0.99), Target("b", ">=", 0.95), Target("loss", "<=", 0.1))
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"a": 0.01, "b": 0.02, "loss": 0.05}
    CATASTROPHE = (Target("a", ">=", 0.97), Target("c", ">=", 0.995))


def _values(targets) -> dict[str, float]:
    return {t.metric: t.value for t in targets}


def test_without_a_floor_the_absolute_gates_stand_plus_the_catastrophe_bounds():
    assert _values(gates.targets(Spec, None)) == {"a": 0.99, "b": 0.95, "loss": 0.1, "c": 0.995}


def test_a_floor_below_a_gate_loosens_it_by_the_slack_never_past_a_catastrophe_bound():
    got = _values(gates.targets(Spec, {"a": 0.975, "b": 0.90, "loss": 0.3}))
    assert got["a"] == 0.97  # 0.975 - 0.01 = 0.965 is below the catastrophe bound 0.97
    assert got["b"] == pytest.approx(0.88)  # 0.90 - 0.02
    assert got["loss"] == pytest.approx(0.35)  # "<=": the floor's 0.3 + 0.05
    assert got["c"] == 0.995  # no gate names it: the bound applies as it stands


def test_a_floor_above_a_gate_never_tightens_it():
    assert _values(gates.targets(Spec, {"a": 1.0, "b": 0.99, "loss": 0.0})) == _values(gates.targets(Spec, None))


def test_the_kinds_bounds_match_the_issue():
    """Text: cosine min >= 0.98 and mean >= 0.995 whatever the floor; image: >= 0.99 top-1 where FP32's margin is
    >= 0.1 and FP32's top-1 in the top five >= 0.995."""
    from tritonkit.kinds.image import ImageClassification
    from tritonkit.kinds.text import TextEmbedding

    class Text(TextEmbedding):
        TARGETS = (Target("cosine_min", ">=", 0.99), Target("cosine_mean", ">=", 0.996))

    class Image(ImageClassification):
        TARGETS = (Target("top1_agreement", ">=", 0.98),)

    assert _values(gates.targets(Text, {"cosine_min": 0.5, "cosine_mean": 0.5})) == {"cosine_min": 0.98,
                                                                                     "cosine_mean": 0.995}
    lite0_bf16 = {"top1_agreement": 0.933429}  # Lite0's measured bf16 floor, test split (docs/int8-search.md)
    assert _values(gates.targets(Image, lite0_bf16)) == {
        "top1_agreement": pytest.approx(0.913429), "top1_agreement_margin0.1": 0.99, "fp32_top1_in_int8_top5": 0.995}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("floor") / "tiny.onnx"
    export_tiny(path)
    return path


def _spec() -> TinySpec:
    """Absolute gates no reduced precision reaches, so only the floor can let INT8 pass."""
    spec = TinySpec()
    spec.TARGETS = (Target("cosine_min", ">=", 0.9999999), Target("cosine_mean", ">=", 0.9999999))
    spec.FLOOR_SLACK = {"cosine_min": 0.002, "cosine_mean": 0.0005}
    spec.CATASTROPHE = (Target("cosine_min", ">=", 0.98),)
    spec.SPEED_TARGET = Target("int8_speedup", ">=", 0.0)  # a tiny graph's timing is noise; not what is tested
    return spec


def _fp16_by_hand(path, x: np.ndarray) -> np.ndarray:
    """The tiny Gemm/ReLU stack with weights and every activation rounded to fp16, sums in fp32."""
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    h = x.astype(np.float16).astype(np.float32)
    gemms = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm"]
    for i, node in enumerate(gemms):
        w, b = (weights[n].astype(np.float16).astype(np.float32) for n in node.input[1:3])
        h = h @ (w.T if any(a.name == "transB" and a.i for a in node.attribute) else w) + b
        h = (np.maximum(h, 0) if i < len(gemms) - 1 else h).astype(np.float16).astype(np.float32)
    return h


def test_the_fp16_floor_is_the_graph_at_fp16(tiny):
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    ref = evaluate.run_batches(evaluate.session(tiny), spec.eval_batches("test"))
    mine = np.concatenate([_fp16_by_hand(tiny, b["x"]) for b in spec.eval_batches("test")])
    expected = spec.gate_metrics(ref, mine)
    assert half["test"]["cosine_min"] == pytest.approx(expected["cosine_min"], abs=2e-6)
    assert half["test"]["cosine_min"] < 1.0 - 1e-7  # fp16 is measurably not FP32 on the outlier channel


def _bf16(a) -> torch.Tensor:
    """torch's own round to nearest even to bf16, back in float64 (where sums of bf16 products lose nothing)."""
    return torch.as_tensor(np.array(a)).to(torch.bfloat16).double()


def _model(nodes, inputs, outputs, initializers) -> onnx.ModelProto:
    tensors = [numpy_helper.from_array(v, k) for k, v in initializers.items()]
    graph = helper.make_graph(nodes, "g", inputs, outputs, tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _run(model: onnx.ModelProto, **feeds) -> np.ndarray:
    return evaluate.session(model).run(None, feeds)[0]


def test_the_emulated_bf16_graph_computes_what_bf16_dot_products_with_fp32_sums_compute():
    """Conv, Gemm and MatMul read bf16-rounded data and weights; biases are added unrounded, as oneDNN adds them to
    the fp32 accumulator; the ReLU between them changes nothing (its output is rounded as the Gemm's input)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    w = {"wc": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),
         "bc": rng.uniform(0.2, 0.4, 4).astype(np.float32),
         "wm": rng.standard_normal((256, 10)).astype(np.float32) / 8,
         "wg": rng.standard_normal((10, 5)).astype(np.float32),
         "bg": rng.uniform(20, 40, 5).astype(np.float32)}  # bf16 would move these by up to 0.06
    f = onnx.TensorProto.FLOAT
    model = _model([helper.make_node("Conv", ["x", "wc", "bc"], ["c"], pads=[1, 1, 1, 1]),
                    helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["flat"]),
                    helper.make_node("MatMul", ["flat", "wm"], ["m"]),
                    helper.make_node("Gemm", ["m", "wg", "bg"], ["y"])],
                   [helper.make_tensor_value_info("x", f, [2, 3, 8, 8])],
                   [helper.make_tensor_value_info("y", f, None)], w)
    got = _run(floor.emulate_bf16(model), x=x)

    conv = torch.nn.functional.conv2d(_bf16(x), _bf16(w["wc"]), torch.as_tensor(w["bc"]).double(), padding=1)
    matmul = _bf16(torch.relu(conv).flatten(1).float()) @ _bf16(w["wm"])
    product = _bf16(matmul.float()) @ _bf16(w["wg"])
    expected = (product + torch.as_tensor(w["bg"]).double()).numpy()
    fp32 = _run(model, x=x)
    tolerance = 1e-5 * np.abs(expected).max()  # fp32 sums in another order
    assert np.abs(got - expected).max() < tolerance
    assert np.abs(fp32 - expected).max() > 30 * tolerance  # the rounding is there: FP32 is far off it
    rounded_bias = (product + _bf16(w["bg"])).numpy()
    assert np.abs(rounded_bias - expected).max() > 10 * tolerance  # a rounded bias would have been seen


def test_emulating_every_activation_rounds_each_tensor_between_ops_up_to_the_last_bf16_op():
    """With `activations`, every float tensor a node passes on is rounded except on the tail after the last MatMul
    (OpenVINO's fp32 tail): here the Softmax reads the MatMul's rounded output and computes in fp32."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    w = {"w1": rng.standard_normal((16, 16)).astype(np.float32), "b": rng.uniform(0.2, 0.4, 16).astype(np.float32),
         "w2": rng.standard_normal((16, 6)).astype(np.float32) / 4}
    f = onnx.TensorProto.FLOAT
    model = _model([helper.make_node("MatMul", ["x", "w1"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
                    helper.make_node("Tanh", ["a"], ["t"]), helper.make_node("MatMul", ["t", "w2"], ["l"]),
                    helper.make_node("Softmax", ["l"], ["p"], axis=-1), helper.make_node("Mul", ["p", "p"], ["y"])],
                   [helper.make_tensor_value_info("x", f, [3, 16])], [helper.make_tensor_value_info("y", f, None)], w)
    got = _run(floor.emulate_bf16(model, activations=True), x=x)

    def bf(t: torch.Tensor) -> torch.Tensor:
        return _bf16(t.float())
    m = bf(_bf16(x) @ _bf16(w["w1"]))
    t = bf(torch.tanh(bf(m + torch.as_tensor(w["b"]).double())))
    p = torch.softmax(bf(t @ _bf16(w["w2"])), -1)  # the tail: no rounding after the last MatMul's output
    expected = (p * p).numpy()
    only_ops = _run(floor.emulate_bf16(model), x=x)
    tolerance = 1e-5 * np.abs(expected).max()
    assert np.abs(got - expected).max() < tolerance
    assert np.abs(only_ops - expected).max() > 10 * tolerance  # the activations' rounding is measurably there


def _bf16_by_hand(path, x: np.ndarray) -> np.ndarray:
    """The tiny Gemm/ReLU stack as bf16 dot products: data and weights rounded to bf16, biases and sums in fp32."""
    weights = {i.name: onnx.numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}
    gemms = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm"]
    h = torch.as_tensor(x)
    for i, node in enumerate(gemms):
        w = weights[node.input[1]]
        w = w.T if any(a.name == "transB" and a.i for a in node.attribute) else w
        h = (_bf16(h) @ _bf16(w) + torch.as_tensor(np.array(weights[node.input[2]])).double()).float()
        h = torch.relu(h) if i < len(gemms) - 1 else h
    return h.numpy()


def test_a_cpu_without_native_bf16_measures_the_bf16_floor_by_emulation(tiny, monkeypatch):
    monkeypatch.setattr(envinfo, "has_bf16", lambda: False)
    spec = _spec()
    assert "unavailable" in floor.measure(spec, tiny, "bf16", native=True)  # no runtime computes bf16 here
    half = floor.measure(spec, tiny, "bf16")
    assert "unavailable" not in half and "emulated" in half["how"]
    ref = evaluate.run_batches(evaluate.session(tiny), spec.eval_batches("test"))
    mine = np.concatenate([_bf16_by_hand(tiny, b["x"]) for b in spec.eval_batches("test")])
    expected = spec.gate_metrics(ref, mine)
    assert half["test"]["cosine_min"] == pytest.approx(expected["cosine_min"], abs=2e-6)
    # 8 bits of mantissa against 11: bf16's worst row is further from FP32 than fp16's.
    assert half["test"]["cosine_min"] < floor.measure(spec, tiny, "fp16")["test"]["cosine_min"]


def test_emulated_and_fp16_floor_keys_name_no_cpu_and_a_native_ones_does(tiny, monkeypatch):
    spec, env = _spec(), envinfo.fingerprint()
    kinds = (("bf16", False), ("bf16", True), ("fp16", False))
    before = {(p, n): floor.key(spec, tiny, p, ("test",), n) for p, n in kinds}
    # Flags no real CPU reports, so the faked CPU differs from this one whatever this one is.
    monkeypatch.setattr(envinfo, "fingerprint", lambda: {**env, "cpu_int8_features": ["not_a_flag"]})
    monkeypatch.setattr(envinfo, "cpu_flags", lambda wanted=(): ["not_a_flag"])
    after = {(p, n): floor.key(spec, tiny, p, ("test",), n) for p, n in before}
    assert after[("bf16", False)] == before[("bf16", False)]
    assert after[("bf16", True)] != before[("bf16", True)]
    assert after[("fp16", False)] == before[("fp16", False)]  # the converted graph on onnxruntime: no CPU either
    assert floor.key(spec, tiny, "bf16", ("validation", "test")) != before[("bf16", False)]


def test_the_emulated_bf16_floor_matches_openvinos_native_bf16_on_the_tiny_model(tiny):
    """Where the CPU has bf16, the emulation and OpenVINO's bf16 agree within the slack the floor is used with."""
    if not envinfo.has_bf16():
        print(f"skipped: no native bf16 on this CPU ({envinfo.cpu_model()})")
        pytest.skip("no native bf16 on this CPU to compare the emulation with")
    spec = _spec()
    native, emulated = floor.measure(spec, tiny, "bf16", native=True), floor.measure(spec, tiny, "bf16")
    assert "native bf16" in native["how"]
    for split in ("validation", "test"):
        for metric, slack in spec.FLOOR_SLACK.items():
            assert abs(emulated[split][metric] - native[split][metric]) <= slack, (split, metric)


def test_int8_within_the_slack_of_its_floor_passes_where_the_absolute_gate_cannot(tiny):
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    quiet = {"check_speed": False, "progress": False, "log": lambda _m: None}
    # absolute: unreachable
    assert not search.run(search.SearchContext(spec, tiny, ["int8"], min_int8_share=0, **quiet)).passed
    result = search.run(search.SearchContext(spec, tiny, ["int8"], min_int8_share=0,
                                             gates=gates.of_floor(spec, "tensorrt", half), **quiet))
    assert result.passed and result.recipe.float_nodes
    bound = half["test"]["cosine_min"] - spec.FLOOR_SLACK["cosine_min"]
    assert bound <= result.test["cosine_min"] < spec.TARGETS[0].value


def test_int8_worse_than_its_floor_falls_back_and_says_so(tiny, tmp_path, monkeypatch):
    """With two thirds of the compute required in INT8 the outlier layer must be quantized: far under its floor, so
    no recipe, and the build serves FP32 under the INT8 name with the floor in its report."""
    import onnxruntime as ort

    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    result = search.run(search.SearchContext(spec, tiny, ["int8"], check_speed=False, progress=False,
                                             log=lambda _m: None, gates=gates.of_floor(spec, "tensorrt", half)))
    bound = half["validation"]["cosine_min"] - spec.FLOOR_SLACK["cosine_min"]
    assert not result.passed and result.recipe is None and result.best_failed
    assert all(f["metrics"].get("cosine_min", 1.0) < bound for f in result.best_failed if f.get("metrics"))

    spec.EXPORT = type("Export", (), {"name": "tiny"})
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    monkeypatch.setitem(floor.PRECISION, "served", "fp16")  # the fp16 floor runs on any CPU
    out = tmp_path / "served.onnx"
    # As pipeline.search_forms records it: a fallback's replay reports the floor its search measured, and measures none.
    entry = recipe.Entry(None, recipe.FALLBACK, result.reason, floor=half)
    outcome = decide.replay(spec, tiny, "served", entry, out, progress=False)
    decide.write_records(spec, [outcome])
    assert outcome.status == recipe.FALLBACK
    meta = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert meta[recipe.PRECISION_KEY].startswith("fp32-fallback")
    rep = json.loads(report.report_path(spec).read_text())
    assert rep["floor"]["test"] == half["test"]


def test_a_replayed_report_shows_floor_bound_and_result_side_by_side(tiny, tmp_path, monkeypatch):
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    found = search.run(search.SearchContext(spec, tiny, ["int8"], check_speed=False, progress=False,
                                            log=lambda _m: None, min_int8_share=0,
                                            gates=gates.of_floor(spec, "tensorrt", half))).recipe
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    monkeypatch.setitem(floor.PRECISION, "served", "fp16")
    entry = recipe.Entry(dataclasses.asdict(found), "passed")
    outcome = decide.replay(spec, tiny, "served", entry, tmp_path / "served.onnx", progress=False)
    decide.write_records(spec, [outcome])
    assert outcome.status == "passed", outcome.missed
    rep = json.loads(report.report_path(spec).read_text())
    gate = next(g for g in rep["gates"] if g["metric"] == "cosine_min")
    assert gate["absolute"] == 0.9999999
    assert gate["test"] == pytest.approx(half["test"]["cosine_min"] - 0.002, abs=1e-6)
    page = pages.render_markdown(rep)
    assert "floor val / test" in page and f"{half['test']['cosine_min']:.4f}" in page


def test_a_replay_that_only_this_machines_fp32_outruns_serves_fp32_loudly_not_a_failed_build(tiny, tmp_path,
                                                                                             monkeypatch):
    """Accuracy is proven per CPU class, speed per machine: a recipe that holds its accuracy gates but not the speed
    gate here (an unreachable 1000x) serves the FP32 graph under its name, saying why, and the build goes on."""
    from tests.support.int8_support import assert_fp32_fallback

    spec = _spec()
    found = search.run(search.SearchContext(spec, tiny, ["int8"], check_speed=False, progress=False,
                                            log=lambda _m: None, min_int8_share=0,
                                            gates=gates.of_floor(spec, "tensorrt", floor.measure(spec, tiny, "fp16")))
                       ).recipe
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1000.0)
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    monkeypatch.setitem(floor.PRECISION, "served", "fp16")
    entry = recipe.Entry(dataclasses.asdict(found), "passed")
    out = tmp_path / "served.onnx"
    outcome = decide.replay(spec, tiny, "served", entry, out, progress=False)
    decide.write_records(spec, [outcome])
    assert outcome.status == recipe.FALLBACK
    assert_fp32_fallback(out, tiny)
    rep = json.loads(report.report_path(spec).read_text())
    assert "holds its accuracy gates here but not its speed gate" in rep["reason"], rep["reason"]
    assert rep["missed_here"] and all(m.startswith("int8_speedup_lo") for m in rep["missed_here"])


def test_a_committed_floor_stands_for_an_fp32_export_that_differs_in_its_last_bits(tmp_path):
    """A fresh clone on another CPU exports Lite0's FP32 graph with other last bits: its committed floors (found by
    what they are measured from, floor.source) are reused, nothing is measured and the floors file is not
    rewritten."""
    import json

    from tritonkit import kinds
    from tritonkit.int8 import floor as floor_module

    for name in ("text_embedding", "image_classification"):
        kind = kinds.get(name)
        committed = floor_module.record_path(kind).read_text()
        records = {r["floor"]["precision"]: r["floor"] for r in json.loads(committed).values()}
        other = tmp_path / f"{name}.onnx"
        other.write_bytes(b"an FP32 export whose bytes are not the measured graph's")
        for precision in ("bf16", "fp16"):
            assert floor_module.measure(kind, other, precision) == records[precision]
        assert floor_module.record_path(kind).read_text() == committed
