"""Activations quantized at run time (tritonkit.int8.granularity): the served search's step before float, on a small
MatMul model whose middle layer reads an outlier token that one static range per tensor cannot hold."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import onnx
import pytest

from tests.support.tiny_search import TinySpec
from tritonkit.int8 import context, granularity, search, steps, timing
from tritonkit.int8.builder import Builder
from tritonkit.int8.checks import artefact_int8_share
from tritonkit.int8.evaluate import session
from tritonkit.int8.records import Recipe
from tritonkit.kinds.gates import Target

WIDTH = 128  # a multiple of every scheme's block, so each can run the outlier layer


class MatMulSpec(TinySpec):
    """TinySpec's data as [rows, 4 tokens, 16]: a Linear on 3-D input exports as MatMul + Add."""

    WEIGHT_OPS = ("MatMul",)
    TARGETS = (Target("cosine_min", ">=", 0.99), Target("cosine_mean", ">=", 0.995))
    SPEED_TARGET = Target("int8_speedup", ">=", 0.0)  # this test is about accuracy and the choice, not a tiny speed

    def __init__(self):
        super().__init__()
        self.data = {k: np.repeat(v[:, None, :], 4, 1) * np.linspace(0.5, 1.5, 4, dtype=np.float32)[None, :, None]
                     for k, v in self.data.items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(path, the MatMul that reads the outlier, the attention-like activation x activation MatMul)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = torch.nn.Linear(16, WIDTH), torch.nn.Linear(WIDTH, WIDTH), \
                torch.nn.Linear(WIDTH, 8)
            # Token 0 of b's input x1000, undone on b's output (as delimiter tokens' outliers in BERT's encoders)
            self.register_buffer("s", torch.tensor([1000.0, 1.0, 1.0, 1.0]).reshape(1, 4, 1))

        def forward(self, x):
            h = torch.relu(self.a(x)) * self.s
            h = torch.relu(self.b(h) / self.s)
            return self.c(h @ (h.transpose(1, 2) @ h) / 100.0).mean(1)  # [rows, 8], as an embedding

    torch.manual_seed(0)
    net = Net().eval()
    path = tmp_path_factory.mktemp("granular") / "net.onnx"
    torch.onnx.export(net, (torch.zeros(2, 4, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, opset_version=17, dynamo=False)
    graph = onnx.load(str(path)).graph
    weights = {i.name for i in graph.initializer}
    matmuls = [n for n in graph.node if n.op_type == "MatMul"]
    b = next(n.name for n in matmuls if n.name == "/b/MatMul")
    activation = next(n.name for n in matmuls if n.input[1] not in weights)
    return path, b, activation


def _run(model_proto, feeds):
    return session(model_proto, 1, exact=True).run(None, feeds)[0]


def _cosine_min(ref, got):
    ref, got = ref.reshape(len(ref), -1), got.reshape(len(got), -1)
    return float(((ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))).min())


@pytest.mark.parametrize("scheme", list(granularity.SCHEMES))
def test_a_scheme_keeps_the_outlier_layer_accurate_where_a_static_range_cannot(model, scheme):
    path, outlier, activation = model
    spec = MatMulSpec()
    builder = Builder(spec, path, progress=False, all_methods=False)
    static = Recipe(form="uint8", placement="inputs")
    floated = replace(static, float_nodes=[outlier, activation])
    feeds = {"x": spec.data["validation"]}
    ref = _run(onnx.load(str(path)), feeds)
    # The float MatMul with a constant weight is eligible; the activation x activation product is not.
    assert granularity.eligible(builder.build(floated), floated.float_nodes, scheme) == [outlier]
    dynamic = floated.with_dynamic(scheme, [outlier])
    graph = builder.build(dynamic)
    op = "MatMulNBits" if scheme in granularity.BLOCKS else "MatMulInteger"
    assert [n.name for n in graph.graph.node if n.op_type == op] == [outlier]
    assert outlier not in {n.name for n in graph.graph.node if n.op_type == "MatMul"}
    all_int8 = _cosine_min(ref, _run(builder.build(static), feeds))
    float_b = _cosine_min(ref, _run(builder.build(floated), feeds))
    got = _cosine_min(ref, _run(graph, feeds))
    assert all_int8 < 0.99 <= got, (all_int8, got)  # the outlier layer at a static range loses; at run time, holds
    assert got > float_b - 0.005, (got, float_b)  # about what float gives
    builder.close()


@pytest.mark.parametrize("scheme", list(granularity.SCHEMES))
def test_a_dynamic_recipe_replays_the_same_bytes_from_its_parameters_and_counts_as_int8(model, scheme, tmp_path):
    from tritonkit.int8 import params

    path, outlier, activation = model
    spec = MatMulSpec()
    recipe = Recipe(form="uint8", placement="inputs", float_nodes=[outlier, activation]).with_dynamic(scheme,
                                                                                                     [outlier])
    searched = Builder(spec, path, progress=False, all_methods=False)
    first = searched.build(recipe).SerializeToString()
    saved = searched.quant_params(recipe, "digest").save(tmp_path / "p.npz")
    searched.close()

    committed = Recipe.from_json(json.loads(json.dumps(recipe.to_json())))
    assert committed == recipe

    class NoData(MatMulSpec):
        def calibration_batches(self):
            raise AssertionError("a replay from committed parameters reads no calibration data")

    replay = Builder(NoData(), path, committed=(committed, params.QuantParams.load(saved)), progress=False,
                     all_methods=False)
    out = replay.write(committed, tmp_path / "replayed.onnx")
    replay.close()
    assert out.read_bytes() == first
    share = artefact_int8_share(out, spec.WEIGHT_OPS)
    static_float = Builder(spec, path, progress=False, all_methods=False)
    plain = static_float.write(replace(recipe, dynamic={}), tmp_path / "float.onnx")
    static_float.close()
    assert share == 1.0 > artefact_int8_share(plain, spec.WEIGHT_OPS)  # the activation product carries no weight


def test_a_recipe_without_dynamic_nodes_is_committed_as_before():
    r = Recipe(form="uint8", placement="inputs", float_nodes=["a"])
    assert "dynamic" not in r.to_json() and Recipe.from_json(r.to_json()) == r
    assert r.describe().endswith("+1 float")
    d = Recipe(form="uint8", placement="inputs", float_nodes=["a", "b"]).with_dynamic("token-g4", ["a"])
    assert d.to_json()["dynamic"] == {"scheme": "token-g4", "nodes": ["a"]}
    assert d.describe().endswith("+1 float +1 token-g4")


def _scripted_speed(faster: str | None):
    """A candidate's speed as the gate would measure it, scripted: `faster` (a scheme, or None: float) wins."""

    def speed(ctx, r):
        name = r.dynamic.get("scheme")
        x = 2.0 if name == faster else 1.5 if name is None else 1.2
        return {"int8_speedup": x, "speedup_batch8": x, "speedup_lo_batch8": x, "speedup_hi_batch8": x,
                "int8_speedup_lo": x}

    return speed


def _scripted_race(faster: str | None, alike_to_fp32: bool = False):
    """timing.race_parent, scripted from the same table: the rivals' ratio over their parent is the two ratios'
    quotient. `alike_to_fp32`: every file's ratio to FP32 is the same (the schemes' look faster only head to head
    where they are)."""
    speed = _scripted_speed(faster)

    def race_parent(ctx, r, rivals):
        parent = speed(ctx, r)
        out = [parent]
        for g in rivals:
            s = dict(speed(ctx, g))
            s["over_parent_lo"] = s["int8_speedup"] / parent["int8_speedup"]
            if alike_to_fp32:
                s.update({k: v for k, v in parent.items() if k.startswith(("int8_speedup", "speedup"))})
            out.append(s)
        return out

    return race_parent


@pytest.mark.parametrize("faster", [*granularity.SCHEMES, None])
def test_the_served_search_keeps_a_finer_granularity_only_where_it_holds_and_is_faster(model, monkeypatch, faster):
    """A real search on the model (real quantization and accuracy on the validation and test splits); only the
    timing is scripted, so which candidate is faster is known."""
    path, outlier, _ = model
    monkeypatch.setattr(timing, "candidate_speed", _scripted_speed(faster))
    monkeypatch.setattr(timing, "race_parent", _scripted_race(faster))
    monkeypatch.setattr(timing, "speed_ceiling", lambda ctx, start=None: None)
    monkeypatch.setattr(context, "speedup", lambda *a, **k: {"int8_speedup": 1.5})  # the starts' quick timings
    s = search.SearchContext(MatMulSpec(), path, ["uint8"], check_speed=True, progress=False, log=lambda _m: None)
    result = search.run(s)
    granular = [st for st in result.steps if st.stage == "granular"]
    assert {st.change.split(" as ")[1] for st in granular} == set(granularity.SCHEMES)
    assert all(st.passed for st in granular), [(st.change, st.metrics) for st in granular]
    assert result.passed and outlier in result.recipe.float_nodes
    if faster is None:
        assert result.recipe.dynamic == {}
    else:
        assert result.recipe.dynamic == {"scheme": faster, "nodes": [outlier]}


def test_the_tensorrt_form_never_takes_a_runtime_quantized_node(model, monkeypatch):
    """TensorRT runs explicit symmetric Q/DQ only: its search (no speed gate) offers no scheme, where the served
    form's offers both for the same candidate."""
    path, outlier, activation = model
    r = Recipe(form="int8", placement="inputs", float_nodes=[outlier, activation])
    trt = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=False, progress=False, log=lambda _m: None)
    assert steps.granular(trt, (r, {})) == [(r, {})]
    served = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    monkeypatch.setattr(timing, "race_parent",
                        lambda ctx, parent, rivals: [{"int8_speedup": 1.0}] + [{"over_parent_lo": 1.1}] * len(rivals))
    offered = steps.granular(served, (r, {"int8_speedup": 0.9}))
    assert [g.dynamic.get("scheme") for g, _ in offered] == [None, *granularity.SCHEMES]
    assert offered[0] == (r, {"int8_speedup": 1.0})  # the parent ranks by its time in the same race


def test_a_scheme_is_offered_only_where_it_beats_its_parent_head_to_head(model, monkeypatch):
    """Both schemes hold, and (scripted) one beats its float parent in the race while the other does not; the one
    that does not is dropped, and where none is offered the parent keeps its own timing."""
    path, outlier, activation = model
    r = Recipe(form="int8", placement="inputs", float_nodes=[outlier, activation])
    served = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    winner = granularity.SCHEMES[1]
    monkeypatch.setattr(timing, "race_parent", _scripted_race(winner))
    assert [g.dynamic.get("scheme") for g, _ in steps.granular(served, (r, {"int8_speedup": 1.4}))] == [None, winner]
    # The same verdicts with every ratio to FP32 alike: the head-to-head interval decides, not two runs' ratios.
    again = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    monkeypatch.setattr(timing, "race_parent", _scripted_race(winner, alike_to_fp32=True))
    assert [g.dynamic.get("scheme") for g, _ in steps.granular(again, (r, {"int8_speedup": 1.4}))] == [None, winner]
    slower = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    monkeypatch.setattr(timing, "race_parent", _scripted_race(None))
    assert steps.granular(slower, (r, {"int8_speedup": 1.4})) == [(r, {"int8_speedup": 1.4})]


def test_a_recipe_quantized_at_run_time_meets_the_other_schemes_on_the_same_nodes(model, monkeypatch):
    """A committed recipe already quantized at run time (nbits8-b32) meets the other schemes on its run-time nodes,
    not on its remaining float nodes (the activation product no scheme runs); here (scripted) the coarser block
    beats it head to head and is offered beside it, token-g4 does not. Asked twice, it builds once."""
    path, outlier, activation = model
    r = Recipe(form="int8", placement="inputs", float_nodes=[outlier, activation]).with_dynamic(
        granularity.NBITS, [outlier])
    served = search.SearchContext(MatMulSpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    assert steps.granular_nodes(served, r) == {s: [outlier] for s in granularity.SCHEMES if s != granularity.NBITS}
    built = []
    served.build = lambda recipe, build=served.build: built.append(recipe) or build(recipe)
    steps.granular_nodes(served, r)  # the trim asks before the step does: the answer is not rebuilt
    assert built == []
    del served.build
    monkeypatch.setattr(timing, "race_parent", _scripted_race(granularity.NBITS_COARSE))
    offered = steps.granular(served, (r, {"int8_speedup": 1.2}))
    assert [g.dynamic["scheme"] for g, _ in offered] == [granularity.NBITS, granularity.NBITS_COARSE]
    assert offered[1][0] == r.with_dynamic(granularity.NBITS_COARSE, [outlier])
    assert steps.granular_nodes(served, r) == {}  # tried once


@pytest.mark.parametrize("scheme", sorted(granularity.BLOCKS))
def test_openvino_quantizes_a_matmul_nbits_file_by_the_groups_onnxruntime_judged(scheme, tmp_path):
    """The served runner sets OpenVINO's run-time activation groups to the file's block, so OpenVINO computes what
    the search judged on onnxruntime: its output tracks onnxruntime's exact one far closer than the same file with
    OpenVINO's activation quantization off (float activations x INT8 weights), on activations with an outlier
    channel (what makes the group size matter)."""
    pytest.importorskip("openvino")
    from onnx import TensorProto, helper, numpy_helper

    from tritonkit import envinfo
    from tritonkit.serving.runtimes import open_variant, openvino_core

    if not envinfo.openvino_quantizes_at_run_time():
        pytest.skip("OpenVINO quantizes activations at run time only on a VNNI CPU; this one has none")
    k, n = 2 * granularity.BLOCKS[scheme], 64
    rng = np.random.default_rng(0)
    w = rng.normal(size=(k, n)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(w, "w")])
    model = granularity.apply(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8),
                              scheme, ["mm"])
    path = tmp_path / "nbits.onnx"
    onnx.save(model, str(path))
    x = rng.normal(size=(16, k)).astype(np.float32)
    x[:, 5] *= 200.0  # one outlier channel, in the first group only
    judged = session(model, 1, exact=True).run(None, {"x": x})[0]
    served = open_variant("openvino", path, 1)
    assert served.runner.properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == granularity.BLOCKS[scheme]
    assert int(served.runner.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == granularity.BLOCKS[scheme]
    got = served.run(["y"], {"x": x})[0]
    props = {**served.runner.properties, "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    unquantized = openvino_core().compile_model(str(path), "CPU", props).create_infer_request().infer({"x": x})[0]
    off = np.abs(unquantized - judged).max()
    assert off > 0  # activation quantization changes the result, so the comparison below can tell
    assert np.abs(got - judged).max() < off / 4, (np.abs(got - judged).max(), off)


def test_a_race_times_the_parent_and_its_rivals_in_one_interleaved_run(model):
    """The real timing (tritonkit.int8.speed.race) on the small model: every file has its ratio to FP32, each rival
    its ratio over the parent, all from the same samples. Which is faster is not asserted (a benchmark's question)."""
    from tritonkit.int8.speed import race

    path, outlier, activation = model
    spec = MatMulSpec()
    builder = Builder(spec, path, progress=False, all_methods=False)
    parent = Recipe(form="int8", placement="inputs", float_nodes=[outlier, activation])
    rivals = {s: ("onnxruntime", builder.build(parent.with_dynamic(s, [outlier]))) for s in granularity.SCHEMES}
    raced = race(spec, ("onnxruntime", path), ("onnxruntime", builder.build(parent)), rivals, (1, 8), repeats=3,
                 min_sample_s=0.002)
    builder.close()
    assert set(raced) == {"parent", *granularity.SCHEMES}
    for name, speed in raced.items():
        for b in (1, 8):
            assert 0 < speed[f"speedup_lo_batch{b}"] <= speed[f"speedup_hi_batch{b}"]
            assert speed[f"fp32_ms_batch{b}"] == raced["parent"][f"fp32_ms_batch{b}"]  # one FP32 sample set
            if name != "parent":
                assert speed[f"over_parent_batch{b}"] == pytest.approx(
                    raced["parent"][f"int8_ms_batch{b}"] / speed[f"int8_ms_batch{b}"])
                assert speed[f"speed_samples_batch{b}"] == raced["parent"][f"speed_samples_batch{b}"]
        assert speed["int8_speedup"] == min(speed["speedup_batch1"], speed["speedup_batch8"])
        if name != "parent":
            assert speed["over_parent_lo"] == min(speed["over_parent_lo_batch1"], speed["over_parent_lo_batch8"])


def test_an_unknown_scheme_is_a_typed_error_naming_the_field():
    from tritonkit.errors import QuantizationError

    with pytest.raises(QuantizationError, match=r"dynamic\.scheme"):
        granularity.apply(onnx.ModelProto(), "per-tensor", ["a"])



@pytest.mark.parametrize("block", sorted(granularity.BLOCKS.values()))
def test_nbits_sums_int8_products_exactly_on_this_cpu(block):
    """The search judges the MatMulNBits schemes in the arithmetic its session computes on this CPU. onnxruntime's
    u8s8 GEMM without VNNI adds pairs of products in a saturating int16; were these kernels to, a judgement would
    hold on this class only. Activations at +-127 per block (their scale 1, codes exact) against weights at the code
    extremes: every pair sum is as large as int8 products get."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = 2 * block, 8
    w = np.where(np.arange(n) % 2, -1.0, 1.0).astype(np.float32)[None, :].repeat(k, 0)
    w[:, 2] = np.linspace(-1, 1, k)  # one column of mixed codes
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model = granularity.nbits(model, ["mm"], block)
    node = next(x for x in model.graph.node if x.op_type == "MatMulNBits")
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    codes = inits[node.input[1]].reshape(n, k).astype(np.float64) - 128  # 8-bit symmetric: zero point 128
    scales = inits[node.input[2]].reshape(n, k // block).astype(np.float64)
    w_deq = (codes * np.repeat(scales, block, 1)).T
    rng = np.random.default_rng(0)
    x = np.full((5, k), 127.0)
    x[1] = -127.0
    x[2, ::2] = -127.0
    x[3:] = rng.integers(-127, 128, (2, k))
    x[3:, :: block] = 127.0  # each block's max |x| is 127: scale 1, codes exact
    got = session(model, 1, exact=True).run(None, {"x": x.astype(np.float32)})[0]
    ref = x @ w_deq
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3 * np.abs(ref).max())
