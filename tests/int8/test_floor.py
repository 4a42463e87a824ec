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

from tests.support.tiny_search import TinySpec, export_tiny
from tritonkit import envinfo
from tritonkit.int8 import evaluate, floor, pages, recipe, search
from tritonkit.kinds.gates import Target


class Spec:
    TARGETS = (Target("a", ">=", 0.99), Target("b", ">=", 0.95), Target("loss", "<=", 0.1))
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"a": 0.01, "b": 0.02, "loss": 0.05}
    CATASTROPHE = (Target("a", ">=", 0.97), Target("c", ">=", 0.995))


def _values(targets) -> dict[str, float]:
    return {t.metric: t.value for t in targets}


def test_without_a_floor_the_absolute_gates_stand_plus_the_catastrophe_bounds():
    assert _values(floor.targets(Spec, None)) == {"a": 0.99, "b": 0.95, "loss": 0.1, "c": 0.995}


def test_a_floor_below_a_gate_loosens_it_by_the_slack_never_past_a_catastrophe_bound():
    got = _values(floor.targets(Spec, {"a": 0.975, "b": 0.90, "loss": 0.3}))
    assert got["a"] == 0.97  # 0.975 - 0.01 = 0.965 is below the catastrophe bound 0.97
    assert got["b"] == pytest.approx(0.88)  # 0.90 - 0.02
    assert got["loss"] == pytest.approx(0.35)  # "<=": the floor's 0.3 + 0.05
    assert got["c"] == 0.995  # no gate names it: the bound applies as it stands


def test_a_floor_above_a_gate_never_tightens_it():
    assert _values(floor.targets(Spec, {"a": 1.0, "b": 0.99, "loss": 0.0})) == _values(floor.targets(Spec, None))


def test_the_kinds_bounds_match_the_issue():
    """Text: cosine min >= 0.98 and mean >= 0.995 whatever the floor; image: >= 0.99 top-1 where FP32's margin is
    >= 0.1 and FP32's top-1 in the top five >= 0.995."""
    from tritonkit.kinds.image import ImageClassification
    from tritonkit.kinds.text import TextEmbedding

    class Text(TextEmbedding):
        TARGETS = (Target("cosine_min", ">=", 0.99), Target("cosine_mean", ">=", 0.996))

    class Image(ImageClassification):
        TARGETS = (Target("top1_agreement", ">=", 0.98),)

    assert _values(floor.targets(Text, {"cosine_min": 0.5, "cosine_mean": 0.5})) == {"cosine_min": 0.98,
                                                                                     "cosine_mean": 0.995}
    lite0_bf16 = {"top1_agreement": 0.933429}  # Lite0's measured bf16 floor, test split (docs/int8-search.md)
    assert _values(floor.targets(Image, lite0_bf16)) == {
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


def test_the_bf16_floor_is_coarser_than_fp16(tiny):
    if not envinfo.has_bf16():
        print(f"skipped: no native bf16 on this CPU ({envinfo.cpu_model()})")
        pytest.skip("no native bf16 on this CPU: the served form has no floor here, absolute gates decide")
    spec = _spec()
    bf16, fp16 = floor.measure(spec, tiny, "bf16"), floor.measure(spec, tiny, "fp16")
    # 8 bits of mantissa against 11: bf16's worst row is further from FP32.
    assert bf16["test"]["cosine_min"] < fp16["test"]["cosine_min"]


def test_int8_within_the_slack_of_its_floor_passes_where_the_absolute_gate_cannot(tiny):
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    quiet = {"check_speed": False, "progress": False, "log": lambda _m: None}
    assert not search.Search(spec, tiny, ["int8"], min_int8_share=0, **quiet).run().passed  # absolute: unreachable
    result = search.Search(spec, tiny, ["int8"], min_int8_share=0, floor=half, **quiet).run()
    assert result.passed and result.recipe.float_nodes
    bound = half["test"]["cosine_min"] - spec.FLOOR_SLACK["cosine_min"]
    assert bound <= result.test["cosine_min"] < spec.TARGETS[0].value


def test_int8_worse_than_its_floor_falls_back_and_says_so(tiny, tmp_path, monkeypatch):
    """With two thirds of the compute required in INT8 the outlier layer must be quantized: far under its floor, so
    no recipe, and the build serves FP32 under the INT8 name with the floor in its report."""
    import onnxruntime as ort

    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    result = search.Search(spec, tiny, ["int8"], check_speed=False, progress=False, log=lambda _m: None,
                           floor=half).run()
    bound = half["validation"]["cosine_min"] - spec.FLOOR_SLACK["cosine_min"]
    assert not result.passed and result.recipe is None and result.best_failed
    assert all(f["metrics"].get("cosine_min", 1.0) < bound for f in result.best_failed if f.get("metrics"))

    spec.EXPORT = type("Export", (), {"name": "tiny"})
    monkeypatch.setattr(recipe, "REPORTS", tmp_path)
    monkeypatch.setitem(floor.PRECISION, "served", "fp16")  # the fp16 floor runs on any CPU
    out = tmp_path / "served.onnx"
    entry = {"recipe": None, "status": recipe.FALLBACK, "reason": result.reason}
    outcome = recipe.replay(spec, tiny, "served", {"served": entry}, out, progress=False)
    assert outcome.status == recipe.FALLBACK
    meta = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert meta[recipe.PRECISION_KEY].startswith("fp32-fallback")
    report = json.loads(recipe.report_path(spec).read_text())
    assert report["floor"]["test"] == half["test"]


def test_a_replayed_report_shows_floor_bound_and_result_side_by_side(tiny, tmp_path, monkeypatch):
    spec = _spec()
    half = floor.measure(spec, tiny, "fp16")
    found = search.Search(spec, tiny, ["int8"], check_speed=False, progress=False, log=lambda _m: None,
                          min_int8_share=0, floor=half).run().recipe
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    monkeypatch.setattr(recipe, "REPORTS", tmp_path)
    monkeypatch.setitem(floor.PRECISION, "served", "fp16")
    entry = {"recipe": dataclasses.asdict(found), "status": "passed"}
    outcome = recipe.replay(spec, tiny, "served", {"served": entry}, tmp_path / "served.onnx", progress=False)
    assert outcome.status == "passed", outcome.missed
    report = json.loads(recipe.report_path(spec).read_text())
    gate = next(g for g in report["gates"] if g["metric"] == "cosine_min")
    assert gate["absolute"] == 0.9999999
    assert gate["test"] == pytest.approx(half["test"]["cosine_min"] - 0.002, abs=1e-6)
    page = pages.render_markdown(report)
    assert "floor val / test" in page and f"{half['test']['cosine_min']:.4f}" in page
