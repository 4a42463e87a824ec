"""The INT8 search on a small model it has never seen: it must find the sensitive layer by measurement alone."""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.support.tiny_search import TinySpec, export_tiny
from tritonkit.int8 import context, decide, evaluate, fallback, gates, pages, pipeline, report, search, steps, timing
from tritonkit.int8.budget import AFTER_SEARCH_SHARE, SERVED_SHARE, START_PASSES, Budget
from tritonkit.int8.builder import FewCalibrationBatches, Workspace
from tritonkit.int8.checks import check_qdq
from tritonkit.int8.gates import distortion, passes
from tritonkit.int8.planner import RESERVED
from tritonkit.int8.records import Step
from tritonkit.int8.speed import BF16_COMPETITOR, fp32_competitor
from tritonkit.int8.units import group_units
from tritonkit.kinds.gates import Target
from tritonkit.serving.runtimes import DEFAULT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    sensitive = export_tiny(path)
    return path, sensitive


def test_search_finds_the_sensitive_layer_by_measurement(tiny):
    path, sensitive = tiny
    spec = TinySpec()
    # The sensitive layer is 73 % of this model's compute, which the TensorRT form's compute gate would refuse to
    # leave float: the measurement is under test here, so that gate is off.
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                             log=lambda _m: None, min_int8_share=0.0))
    first = result.steps[0]
    assert first.stage == "start" and not first.passed, "every layer in int8 should miss the gate"
    assert result.passed, result.reason
    assert sensitive in result.recipe.float_nodes
    assert len(result.recipe.float_nodes) < 3, "the search kept everything float"
    # The ranking put the outlier layer first.
    assert result.sensitivity[0]["units"][0]["unit"] == sensitive
    # Confirmed on the test split, which no choice used: the spec's gates, measured again here.
    assert all(t.met(result.test) for t in spec.TARGETS)
    assert result.test["cosine_min"] >= 0.999


def test_recipe_replays_to_a_symmetric_qdq_graph(tiny, tmp_path):
    from tritonkit.int8.builder import quantize

    path, sensitive = tiny
    spec = TinySpec()
    recipe = search.Recipe(form="int8", placement="inputs", float_nodes=[sensitive])
    out = quantize(path, tmp_path / "q.onnx", recipe.to_quant(spec.WEIGHT_OPS), spec.calibration_batches,
                   spec.calibration_batch_count(), progress=False)
    model = onnx.load(str(out))
    check_qdq(model, "int8", per_channel=True)
    quantized = {n.name for n in model.graph.node if n.op_type == "Gemm"
                 and any(i.endswith("DequantizeLinear_Output") for i in n.input)}
    assert sensitive not in quantized and len(quantized) == 2
    metrics = evaluate.Evaluator(spec, path, "test").metrics(out)
    assert metrics["cosine_min"] >= 0.999


def test_nothing_passes_means_no_recipe(tiny):
    path, _ = tiny
    spec = TinySpec()
    spec.TARGETS = [Target("cosine_min", ">=", 1.0 + 1e-9)]  # unreachable: even float is not above 1
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                             log=lambda _m: None))
    assert not result.passed and result.recipe is None and result.best_failed
    # One entry per failed fallback, each the best of its own steps: none repeats another.
    recipes = [f["recipe"] for f in result.best_failed]
    assert len(recipes) == len(set(recipes)), recipes


def test_a_spent_budget_stops_the_search_and_says_so(tiny):
    path, _ = tiny
    logs: list[str] = []
    result = search.run(search.SearchContext(TinySpec(), path, ["int8"], check_speed=False, budget=Budget.of(1e-6),
                                             progress=False, log=logs.append))
    # The starting points are always measured; past the budget nothing is added, and the reason names it.
    assert not result.passed and "budget" in result.reason
    assert [s.stage for s in result.steps] == ["start"]
    assert result.cuts and result.cuts[0]["what"] == "as started + calibrate=percentile", result.cuts
    assert any("budget" in line for line in logs)


def test_a_second_form_reuses_the_first_ones_calibration(tiny, monkeypatch):
    path, _ = tiny
    calls: list[tuple] = []
    from tritonkit.int8 import calibration

    original = calibration.collect

    def counting(graph, *args, **kwargs):
        calls.append(graph)
        return original(graph, *args, **kwargs)

    monkeypatch.setattr(calibration, "collect", counting)
    workspace = Workspace()
    try:
        first = search.run(search.SearchContext(TinySpec(), path, ["int8"], check_speed=False, progress=False,
                                                log=lambda _m: None, workspace=workspace))
        after_first = len(calls)
        second = search.run(search.SearchContext(TinySpec(), path, ["int8"], check_speed=False, progress=False,
                                                 log=lambda _m: None, workspace=workspace))
        assert Path(workspace.tmp.name).exists(), "a search closed the workspace it was lent"
    finally:
        workspace.close()
    # Per calibrated graph a minmax pass, and one pass for every histogram method the variants tried on it.
    methods = {s.recipe.split("-")[2] for s in first.steps if s.recipe}
    assert len(methods) > 2, methods
    assert all(calls.count(g) <= 2 for g in calls), "a graph was calibrated more than twice"
    assert after_first >= 1 and len(calls) == after_first, "the second search calibrated again"
    assert second.recipe == first.recipe


def test_both_placements_share_one_calibration(tiny, monkeypatch):
    """`inputs` and `all` differ only by input isolation: one calibration serves both."""
    path, _ = tiny
    calls: list[Path] = []
    from tritonkit.int8 import calibration

    original = calibration.collect

    def counting(graph, *args, **kwargs):
        calls.append(graph)
        return original(graph, *args, **kwargs)

    monkeypatch.setattr(calibration, "collect", counting)
    s = search.SearchContext(TinySpec(), path, ["int8"], check_speed=True, progress=False, log=lambda _m: None)
    steps.start(s)
    assert len(s.ws.prepared) == 2 and len(calls) == 1, calls


def test_a_candidate_is_quantized_once_for_its_scoring_checks_timing_and_test(tiny, monkeypatch):
    """A candidate that holds its gates is scored, checked on its runtime, timed and tested in turn: one graph for
    all of them (MPNet's quantization takes tens of seconds), and a different recipe gets its own."""
    from tritonkit.int8 import quantize

    path, _ = tiny
    quantized: list[object] = []
    original = quantize.quantize_prepared

    def counting(*args, **kwargs):
        quantized.append(args[2:4])
        return original(*args, **kwargs)

    monkeypatch.setattr(quantize, "quantize_prepared", counting)
    spec = TinySpec()
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1e-3)  # any speed passes: the graphs are under test
    s = search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False, log=lambda _m: None,
                             min_int8_share=0.0)
    asked: list[str] = []
    build = s.build
    s.build = lambda r: (asked.append(context.key(r)), build(r))[1]
    result = search.run(s)
    assert result.passed, result.reason
    assert len(asked) > len(quantized), "no graph was reused"
    runs = [k for i, k in enumerate(asked) if i == 0 or asked[i - 1] != k]  # consecutive asks of one recipe
    assert len(runs) == len(quantized), "a recipe asked for again at once was quantized again"
    assert s.build(result.recipe) is s.build(result.recipe)


def test_a_second_look_at_the_test_split_goes_to_the_most_accurate_candidate_named_before_the_first():
    """The fastest looks first; the most accurate other candidate on the whole validation split (distortion: the
    summed shortfall against the gates, which keeps ranking past them) looks second, only if strictly more
    accurate; no third look."""
    targets = [Target("cosine_min", ">=", 0.99)]
    fast = search.Recipe("uint8", "inputs", float_nodes=["a", "b"])
    mid = search.Recipe("uint8", "inputs", float_nodes=["a", "b", "c", "d"])
    safe = search.Recipe("uint8", "inputs", float_nodes=[f"n{i}" for i in range(12)])
    ok = [(safe, {"int8_speedup": 1.53}), (fast, {"int8_speedup": 1.74}), (mid, {"int8_speedup": 1.60})]
    validation = {context.key(fast): {"cosine_min": 0.9945}, context.key(mid): {"cosine_min": 0.9960},
                  context.key(safe): {"cosine_min": 0.9983}}
    assert [r for r, _ in search.confirmation_order(ok, validation, targets)] == [fast, safe]
    validation[context.key(safe)] = validation[context.key(mid)] = {"cosine_min": 0.9945}  # none more accurate
    assert [r for r, _ in search.confirmation_order(ok, validation, targets)] == [fast]
    assert [r for r, _ in search.confirmation_order(ok[1:2], validation, targets)] == [fast]
    # Without a speed check (no speed-ups) the fewest float units look first.
    plain = [(safe, {}), (mid, {}), (fast, {})]
    validation[context.key(safe)] = {"cosine_min": 0.9983}
    assert [r for r, _ in search.confirmation_order(plain, validation, targets)] == [fast, safe]


def test_a_candidate_that_misses_the_test_split_hands_the_second_look_to_the_most_accurate(tiny, tmp_path,
                                                                                           monkeypatch):
    """A real search on the tiny model with a committed candidate that keeps all but one layer float (accurate, but
    more float units than what the search then finds), its first look at the test split declared a miss: the
    second look goes to the committed one, which then serves; the report keeps the first look's miss."""
    from tritonkit.int8.builder import quantize_with_params

    path, sensitive = tiny
    spec = TinySpec()
    nodes = search.quantizable_nodes(path, spec.WEIGHT_OPS)
    committed = search.Recipe(form="int8", placement="inputs", float_nodes=[n for n in nodes if n != nodes[-1]])
    assert sensitive in committed.float_nodes and len(committed.float_nodes) > 1
    params = quantize_with_params(path, tmp_path / "committed.onnx", committed.to_quant(spec.WEIGHT_OPS),
                                  spec.calibration_batches, spec.calibration_batch_count(), progress=False)
    s = search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False, log=lambda _m: None,
                             min_int8_share=0.0, committed=(committed, params))
    looked: list[object] = []
    measure = search.on_test

    def first_misses(ctx, model):
        test, held = measure(ctx, model)
        looked.append(model)
        return test, held and len(looked) > 1

    monkeypatch.setattr(search, "on_test", first_misses)
    result = search.run(s)
    assert len(looked) == 2, "no second look"
    assert result.passed and result.recipe == committed, result.reason
    first = result.best_failed[0]
    assert first["accuracy"].startswith("test split") and first["recipe"] != committed.describe()


def test_an_isolated_copy_gets_its_sources_range(tmp_path):
    """Calibrating the graph before isolation and copying ranges = calibrating the isolated graph itself."""
    import torch

    from tritonkit.int8 import calibration, transforms

    class Branch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

        def forward(self, x):
            h = torch.relu(self.a(x))
            return self.b(h) + h.sum(-1, keepdim=True)  # h feeds a quantized Gemm and a float ReduceSum

    torch.manual_seed(0)
    path = tmp_path / "branch.onnx"
    torch.onnx.export(Branch().eval(), (torch.zeros(4, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    spec = TinySpec()
    recipe = search.Recipe(form="int8", placement="inputs").to_quant(spec.WEIGHT_OPS)
    prepared = transforms.prepare(path, recipe, spec.calibration_batches, tmp_path, spec.calibration_batch_count())
    shared = calibration.calibrate(prepared, recipe, spec.calibration_batches, tmp_path, progress=False)
    direct = calibration.calibrate(transforms.Prepared(prepared.path), recipe, spec.calibration_batches, tmp_path,
                                   progress=False)
    copies = [k for k in direct if k.endswith("_qinput")]
    assert copies, "the branch was not isolated"
    for name in direct:
        assert np.allclose(np.array(shared[name].range_value), np.array(direct[name].range_value)), name


def test_scoring_and_units():
    gates = [Target("a", ">=", 0.99), Target("b", "<=", 0.1)]
    assert passes(gates, {"a": 0.995, "b": 0.05})
    assert not passes(gates, {"a": 0.995, "b": 0.2})
    assert not passes(gates, {"a": 0.9905, "b": 0.05}, margin=0.1)
    assert distortion(gates, {"a": 0.98, "b": 0.1}) > distortion(gates, {"a": 0.99, "b": 0.1})
    nodes = [f"/m/_blocks.{i}/conv{j}/Conv" for i in range(3) for j in range(2)] + ["/m/_fc/Gemm"]
    assert group_units(nodes, 10) == {n: [n] for n in nodes}
    grouped = group_units(nodes, 4)
    assert grouped["m/_blocks.1"] == ["/m/_blocks.1/conv0/Conv", "/m/_blocks.1/conv1/Conv"]
    assert grouped["/m/_fc/Gemm"] == ["/m/_fc/Gemm"]
    assert grouped["role:m/_blocks.*/conv1/Conv"] == [f"/m/_blocks.{i}/conv1/Conv" for i in range(3)]
    assert len(grouped) == 3 + 1 + 2  # blocks, the unindexed head, roles across blocks


@pytest.mark.parametrize("form,placement", [("uint8", "all"), ("int8", "inputs")])
def test_requantizing_a_prepared_graph_reuses_its_scales_and_builds_the_same_graph(tiny, tmp_path, form, placement):
    from tritonkit.int8 import calibration, quantize, transforms

    path, sensitive = tiny
    spec = TinySpec()
    recipe = search.Recipe(form=form, placement=placement).to_quant(spec.WEIGHT_OPS)
    prepared = transforms.prepare(path, recipe, spec.calibration_batches, tmp_path, spec.calibration_batch_count())
    ranges = calibration.calibrate(prepared, recipe, spec.calibration_batches, tmp_path, progress=False)
    for excluded in ([], [sensitive], []):
        cached = quantize.quantize_prepared(prepared, ranges, recipe, excluded)
        fresh = quantize.quantize_prepared(replace(prepared), ranges, recipe, excluded)  # an empty cache
        assert cached.SerializeToString() == fresh.SerializeToString(), excluded
    (params,) = prepared.initializer_params.values()
    assert len(params) >= 3, "the three Gemm weights' scales were not kept"


def test_a_replay_builds_the_graph_the_search_measured_when_a_merged_matmul_stays_float(tmp_path, monkeypatch):
    """The search prepares (merges Q/K/V, smooths) with no node excluded and keeps its float nodes out of
    quantization only, so a float node can be a merged MatMul that the FP32 graph does not have. Both take a
    SmoothQuant graph's ranges from one pass of the graph before smoothing."""
    import onnxruntime as ort
    import torch

    from tritonkit.int8 import calibration
    from tritonkit.int8.builder import quantize

    passes: list[Path] = []
    original = calibration.collect

    def counting(graph, *args, **kwargs):
        passes.append(Path(graph))
        return original(graph, *args, **kwargs)

    monkeypatch.setattr(calibration, "collect", counting)

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(16, 16) for _ in range(3))
            self.o = torch.nn.Linear(16, 16)

        def forward(self, x):
            a = torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), dim=-1)
            return self.o(a @ self.v(x))

    torch.manual_seed(0)
    path = tmp_path / "attn.onnx"
    torch.onnx.export(Attention().eval(), (torch.zeros(2, 5, 16),), str(path), input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b", 1: "s"}, "y": {0: "b", 1: "s"}},
                      opset_version=17, dynamo=False)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((64, 5, 16)).astype(np.float32)

    class Spec(TinySpec):
        WEIGHT_OPS = ("MatMul",)

        def calibration_batches(self):
            return iter([{"x": data[i : i + 8]} for i in range(0, 64, 8)])

        def calibration_batch_count(self):
            return 8

    spec = Spec()
    s = search.SearchContext(spec, path, ["uint8"], check_speed=False, progress=False, log=lambda _m: None)
    start = search.Recipe(form="uint8", placement="inputs", smooth_alpha=0.5)
    merged = [n for n in search.quantizable_nodes(s.builder.prepare(start).path, spec.WEIGHT_OPS) if "_merged3" in n]
    assert len(merged) == 1, "Q/K/V were not merged"
    recipe = replace(start, float_nodes=merged)
    measured = s.build(recipe)
    assert len(passes) == 1 and "smoothed" not in passes[0].name, passes  # the unsmoothed graph's pass only
    # ... and the budget knows it: a further candidate on it is estimated without a pass.
    s.plan.durations = {"fallback:sample": [1.0], "calibrate": [100.0]}
    assert s.step_estimate("fallback:sample", replace(recipe, float_nodes=[])) == 1.0
    replayed = quantize(path, tmp_path / "q.onnx", recipe.to_quant(spec.WEIGHT_OPS), spec.calibration_batches,
                        spec.calibration_batch_count(), progress=False)
    x = {"x": data[:8]}
    run = [ort.InferenceSession(m.SerializeToString() if hasattr(m, "SerializeToString") else str(m),
                                providers=["CPUExecutionProvider"]).run(None, x)[0] for m in (measured, replayed)]
    np.testing.assert_array_equal(run[0], run[1])
    # The same scales and zero points, bit for bit (outputs alone can round alike from ranges a bit apart).
    inits = [{i.name: onnx.numpy_helper.to_array(i) for i in m.graph.initializer}
             for m in (measured, onnx.load(str(replayed)))]
    assert inits[0].keys() == inits[1].keys()
    assert all(np.array_equal(inits[0][k], inits[1][k]) for k in inits[0])


class _CountedSearch(search.SearchContext):
    """The fallback's prefix search on its own: a candidate passes once its first `need` units are float (the
    metric the real search measures is replaced by that rule, so the number of candidates tried is exact)."""

    def __init__(self, need: int, passes_whole: bool = True, reject_from: int | None = None,
                 units: int | None = None, slow_from: int | None = None):
        super().__init__(TinySpec(), Path("unused.onnx"), ["int8"], check_speed=slow_from is not None,
                         progress=False, log=lambda _m: None)
        self.need, self.passes_whole, self.reject_from, self.tried = need, passes_whole, reject_from, []
        self.slow_from = slow_from  # from this many float units on, a candidate runs under the speed gate
        self.units = units  # every unit one equal share of the compute; None: compute is not counted
        self._sample = self.ws.val = object()  # the two evaluators are only told apart, never run here

    def int8_share(self, r):
        return 1.0 if self.units is None else 1.0 - len(r.float_nodes) / self.units

    def measure(self, stage, change, r, speed=False, evaluator=None):
        n = len(r.float_nodes)
        self.tried.append((stage, n))
        if self.reject_from is not None and n >= self.reject_from:
            return None  # as the quantizer rejects a graph with nothing left in INT8
        whole = evaluator is None
        passed = n >= self.need + (0 if self.passes_whole or not whole else 2)
        step = Step(stage, change, r.describe(), {}, float(max(self.need - n, 0)), passed)
        self.steps.append(step)
        return step

    def prefix_speed(self, r):  # timing.prefix_speed, where a test routes it here (_counted_walls)
        self.tried.append(("wall", len(r.float_nodes)))
        x = 0.5 if len(r.float_nodes) >= self.slow_from else 1.5
        return {"speedup_batch8": x, "speedup_lo_batch8": x - 0.1, "speedup_hi_batch8": x + 0.1}


def _counted_walls(monkeypatch) -> None:
    """A _CountedSearch's walls timed by its own prefix_speed (the wall's batch size is the fallback's)."""
    monkeypatch.setattr(timing, "prefix_speed", lambda ctx, r, batch: ctx.prefix_speed(r))


def _units(n: int):
    return [(f"u{i}", [f"n{i}"], 1.0 / (i + 1)) for i in range(n)]


@pytest.mark.parametrize("need", [1, 2, 5, 13, 40])
def test_fallback_finds_the_shortest_passing_prefix_in_log_steps(need):
    s = _CountedSearch(need)
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(40))
    assert r is not None and r.float_nodes == [f"n{i}" for i in range(need)]
    sample = [n for stage, n in s.tried if stage == "fallback"]
    assert len(sample) <= 2 * math.ceil(math.log2(need)) + 2, sample  # gallop + bisect, not one unit at a time
    assert s.tried[-1] == ("confirm", need)


def test_fallback_adds_units_on_the_whole_split_when_the_sample_was_lucky():
    s = _CountedSearch(6, passes_whole=False)
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(20))
    assert r is not None and len(r.float_nodes) == 8
    assert s.tried[-3:] == [("confirm", 6), ("fallback", 7), ("fallback", 8)]


def test_a_prefix_that_passed_on_the_sample_is_confirmed_when_the_budget_ends_the_bisection(monkeypatch):
    """all_mpnet_base_v2, 34-minute search: +8 units passed on the sample with 35 s left besides the reserve, the
    bisection's next step did not fit, and the search ended with no candidate. The reserve is for confirming it."""

    def spent(ctx):
        return any(stage == "fallback" and n >= ctx.need for stage, n in ctx.tried)

    monkeypatch.setattr(fallback, "out_of_budget", spent)
    s = _CountedSearch(5)
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(40))
    assert r is not None and len(r.float_nodes) == 8, s.tried  # gallop 0, 1, 2, 4, 8: 8 passed
    assert s.tried[-1] == ("confirm", 8)


def test_fallback_steps_back_from_a_prefix_the_quantizer_rejects():
    s = _CountedSearch(34, reject_from=36)  # 36 units: all of them float, nothing left to quantize
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(36))
    assert r is not None and len(r.float_nodes) == 34
    assert ("fallback", 36) in s.tried and ("fallback", 35) in s.tried


def test_fallback_under_a_passing_candidate_tries_its_longest_prefix_first():
    s = _CountedSearch(9)
    assert fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(20), max_float=9) is None
    assert s.tried == [("fallback", 0), ("fallback", 8)]  # one look under the cap, nothing shorter
    s = _CountedSearch(5)
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(20), max_float=9)
    assert r is not None and len(r.float_nodes) == 5


def test_a_fallback_ends_at_the_first_prefix_that_misses_accuracy_and_runs_under_the_speed_gate(monkeypatch):
    """Float units only slow a graph down: once a prefix that misses accuracy is timed under the speed gate, no
    longer prefix can pass, and the track's other variants are tried once, at their longest prefix under it."""
    _counted_walls(monkeypatch)
    s = _CountedSearch(30, slow_from=5)  # accuracy needs 30 units float; from 5 on the graph is too slow
    assert fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(80)) is None
    assert [n for stage, n in s.tried if stage == "fallback"] == [0, 1, 2, 4, 8]
    assert [n for stage, n in s.tried if stage == "wall"] == [1, 2, 4, 8]
    assert [w["float_nodes"] for w in s.walls] == [8] and s.walls[0]["batch"] == 8
    s.tried.clear()
    assert fallback.fallback(s, "w", search.Recipe(form="int8", placement="inputs"), _units(80), max_float=8) is None
    assert s.tried == [("fallback", 0), ("fallback", 7)]
    # A wall past what accuracy needs ends nothing: the shortest passing prefix is found as before.
    s = _CountedSearch(5, slow_from=20)
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(80))
    assert r is not None and len(r.float_nodes) == 5 and not s.walls


def test_a_search_whose_fallbacks_hit_the_speed_gate_says_so(tiny, monkeypatch):
    path, _ = tiny
    spec = TinySpec()
    spec.TARGETS = [Target("cosine_min", ">=", 1.0 + 1e-9)]  # unreachable: every prefix misses accuracy
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1e-3)  # every start passes the real speed ceiling

    def walled(ctx, r, batch):  # every prefix with a unit float runs under the gate
        return {"speedup_batch8": 5e-4, "speedup_lo_batch8": 4e-4, "speedup_hi_batch8": 6e-4}

    monkeypatch.setattr(timing, "prefix_speed", walled)
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False,
                                             log=lambda _m: None, min_int8_share=0.0))
    assert not result.passed and result.walls, result.reason
    assert "the speed gate ended" in result.reason and "within the search budget" not in result.reason
    assert all(w["float_nodes"] == 1 for w in result.walls), result.walls  # each track's wall, at its first prefix
    assert {s.recipe.split(" ", 1)[1] for s in result.steps if s.stage == "fallback"} <= {"+0 float", "+1 float"}


class _Scan(search.SearchContext):
    """The sensitivity scan on its own: unit u's float copy scores cosine min 0.99 + gains[u] / 1000, and the budget
    affords the unperturbed candidate and `affordable` units."""

    def __init__(self, gains: dict[str, float], affordable: int):
        super().__init__(TinySpec(), Path("unused.onnx"), ["int8"], check_speed=False, progress=False,
                         log=lambda _m: None)
        self.gains, self.affordable, self._sample = gains, affordable + 1, self
        self.plan.fits = self.fits  # the plan's, which the scan asks

    def units(self, r):
        return {u: [u] for u in self.gains}

    def build(self, r):
        return r

    def metrics(self, r, exact=False):
        return {"cosine_min": 0.99 + sum(self.gains[n] for n in r.float_nodes) / 1000, "cosine_mean": 0.999}

    def fits(self, kind, what, estimate=None, ahead=None):
        self.affordable -= kind == "unit:sample"
        return self.affordable >= 0


def test_a_scan_cut_by_the_budget_ranks_its_unmeasured_units_after_those_that_helped():
    gains = {"u0": 2.0, "u1": -1.0, "u2": 5.0, "u3": 9.0, "u4": 1.0}
    s = _Scan(gains, affordable=3)
    ranked = [u for u, _, _ in steps.rank_units(s, context.Track(search.Recipe(form="int8", placement="inputs"), {}))]
    assert ranked == ["u2", "u0", "u3", "u4", "u1"]  # helped by gain, then unmeasured in graph order, then no help
    assert [u["unit"] for u in s.sensitivity[0]["units"]] == ["u2", "u0", "u1"]
    assert s.sensitivity[0]["unmeasured"] == ["u3", "u4"]
    s = _Scan(gains, affordable=0)  # no unit measured: graph order
    assert [u for u, _, _ in steps.rank_units(s, context.Track(search.Recipe(form="int8", placement="inputs"), {}))] \
        == list(gains)


def test_the_tensorrt_form_keeps_two_thirds_of_the_compute_in_int8():
    """Without a GPU speed gate, a TensorRT-form candidate may not leave more than a third of the compute float:
    a strongly typed network runs it in FP32 and the FP16 plan would be faster."""
    s = _CountedSearch(10, units=30)  # 10 of 30 equal units float: exactly 2/3 left in INT8
    r = fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(30))
    assert r is not None and len(r.float_nodes) == 10
    s = _CountedSearch(11, units=30)
    assert fallback.fallback(s, "v", search.Recipe(form="int8", placement="inputs"), _units(30)) is None
    assert max(n for _, n in s.tried) == 10, s.tried  # nothing past the share was even built


def test_multiply_accumulates_are_counted_per_conv_output_pixel_and_per_weight(tmp_path):
    """weight_macs against the textbook count from the torch layers' shapes, and the built artefact's INT8 share
    against the same count with one conv left float."""
    import torch

    from tritonkit.int8 import builder, checks

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1, stride=2), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU(),
                              torch.nn.Conv2d(16, 8, 1), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10))
    path = tmp_path / "net.onnx"
    torch.onnx.export(net.eval(), (torch.zeros(1, 3, 16, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    expected = [16 * 3 * 9 * 8 * 8, 16 * 1 * 9 * 8 * 8, 8 * 16 * 8 * 8, 10 * 512]  # out × in/groups × k² × pixels
    macs = checks.weight_macs(onnx.shape_inference.infer_shapes(onnx.load(str(path))), ("Conv", "Gemm"))
    assert list(macs.values()) == expected
    first = next(iter(macs))
    x = np.random.default_rng(0).uniform(-1, 1, (16, 3, 16, 16)).astype(np.float32)
    recipe = search.Recipe(form="int8", placement="inputs", float_nodes=[first]).to_quant(("Conv", "Gemm"))
    out = builder.quantize(path, tmp_path / "q.onnx", recipe, lambda: iter([{"x": x}]), progress=False)
    share = checks.artefact_int8_share(out, ("Conv", "Gemm"))
    assert share == pytest.approx(1 - expected[0] / sum(expected))


@pytest.mark.parametrize("readers", [1, 2])
def test_a_float_conv_stays_float_in_onnxruntime(tmp_path, readers):
    """An all-ops Q/DQ graph's float depthwise conv reads a DequantizeLinear and reaches a QuantizeLinear through a
    Clip: onnxruntime's WeightBiasQuantization would give its weights one int8 scale at session load, undoing the
    fallback. With the guard, the default session computes what a session without that pass computes. `readers`:
    the Clip's output read by that many convs, each through its own Q/DQ pair (DedicatedQDQPair), which the pass
    takes too (Lite1's block 1 project conv)."""
    import onnxruntime as ort
    import torch

    from tritonkit.int8 import builder

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU6(),
                                            torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU6())
            self.heads = torch.nn.ModuleList(torch.nn.Conv2d(16, 8, 1) for _ in range(readers))

        def forward(self, x):
            h = self.body(x)
            return sum(head(h) for head in self.heads)

    torch.manual_seed(0)
    net = Net()
    with torch.no_grad():  # channels 1000x apart: one per-tensor int8 scale flattens the small ones to zero
        net.body[2].weight.mul_(torch.logspace(-3, 0, 16).view(16, 1, 1, 1))
        for head in net.heads:
            head.weight.div_(torch.logspace(-3, 0, 16).view(1, 16, 1, 1))
    path = tmp_path / "convs.onnx"
    torch.onnx.export(net.eval(), (torch.zeros(1, 3, 8, 8),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    depthwise = next(n.name for n in onnx.load(str(path)).graph.node
                     if n.op_type == "Conv" and any(a.name == "group" and a.i > 1 for a in n.attribute))
    x = np.random.default_rng(0).uniform(-1, 1, (32, 3, 8, 8)).astype(np.float32)
    recipe = search.Recipe(form="uint8", placement="all", float_nodes=[depthwise]).to_quant(("Conv",))
    out = builder.quantize(path, tmp_path / "q.onnx", recipe, lambda: iter([{"x": x}]), progress=False)
    assert any(n.name == f"{depthwise}_keep_float" for n in onnx.load(str(out)).graph.node)

    def run(**kw):
        return ort.InferenceSession(str(out), providers=["CPUExecutionProvider"], **kw).run(None, {"x": x})[0]

    np.testing.assert_allclose(run(), run(disabled_optimizers=["WeightBiasQuantization"]), atol=1e-5)


def test_graph_outputs_stay_float_under_all_ops_placement(tmp_path):
    """All-ops placement quantizes every tensor a quantized op reads or writes, graph outputs included: uint8
    probabilities in steps of 1/255 no longer sum to 1. The outputs must come out of float ops, and the
    probabilities must be the softmax of the served logits."""
    import onnxruntime as ort
    import torch

    from tritonkit.int8 import builder

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 1000)

        def forward(self, x):
            logits = self.fc(x)
            return logits, torch.softmax(logits, -1)

    torch.manual_seed(0)
    path = tmp_path / "head.onnx"
    torch.onnx.export(Head().eval(), (torch.zeros(1, 16),), str(path), input_names=["x"],
                      output_names=["logits", "probabilities"], dynamic_axes={"x": {0: "b"}}, opset_version=17,
                      dynamo=False)
    x = np.random.default_rng(0).normal(0, 0.3, (64, 16)).astype(np.float32)
    recipe = search.Recipe(form="uint8", placement="all").to_quant(("Gemm", "MatMul"))
    out = builder.quantize(path, tmp_path / "q.onnx", recipe, lambda: iter([{"x": x}]), progress=False)
    model = onnx.load(str(out))
    producer = {o: n for n in model.graph.node for o in n.output}
    assert {producer[o.name].op_type for o in model.graph.output} == {"Gemm", "Softmax"}
    assert any(n.op_type == "QuantizeLinear" for n in model.graph.node)  # the Gemm itself is still INT8
    logits, probs = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-5)
    e = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(probs, e / e.sum(1, keepdims=True), atol=1e-6)


def test_all_ops_placement_quantizes_an_element_wise_constant_as_an_activation(tmp_path):
    """GELU's constants (0.5, sqrt 2, 1) go through onnxruntime's all-ops placement as activations: uint8 with a
    zero point. The uint8 form takes them, and still refuses a weighted op's weight that is not symmetric int8
    (every text encoder's uint8/all start was rejected before)."""
    import torch
    from onnx import TensorProto, numpy_helper

    from tritonkit.errors import QuantizationError
    from tritonkit.int8 import builder
    from tritonkit.kinds.base import Kind

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).eval()
    path = tmp_path / "gelu.onnx"
    torch.onnx.export(net, (torch.zeros(1, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b"}}, opset_version=17, dynamo=False)
    x = np.random.default_rng(0).normal(0, 1, (64, 16)).astype(np.float32)
    recipe = search.Recipe(form="uint8", placement="all").to_quant(("Gemm", "MatMul"))
    out = builder.quantize(path, tmp_path / "q.onnx", recipe, lambda: iter([{"x": x}]), progress=False)
    model = onnx.load(str(out))
    inits = {i.name: i for i in model.graph.initializer}
    consumers = {i: n.op_type for n in model.graph.node for i in n.input}
    dq_consts = {n.output[0]: inits[n.input[0]] for n in model.graph.node
                 if n.op_type == "DequantizeLinear" and n.input[0] in inits}
    by_type = {(consumers[o], c.data_type) for o, c in dq_consts.items()}
    assert ("Mul", TensorProto.UINT8) in by_type and ("Gemm", TensorProto.INT8) in by_type, by_type
    with torch.no_grad():
        ref = net(torch.from_numpy(x)).numpy()
    # In the arithmetic a served replica of this CPU computes (off VNNI a default session saturates: 0.80 on AVX2).
    got = Kind.session(out).run(None, {"x": x})[0]
    cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    assert cos.min() > 0.99, cos.min()
    # A Gemm's weight made asymmetric uint8 is still refused.
    weight = next(c for o, c in dq_consts.items() if consumers[o] == "Gemm" and c.data_type == TensorProto.INT8)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight).astype(np.int16).clip(0, 255)
                                            .astype(np.uint8), weight.name))
    with pytest.raises(QuantizationError, match="is not INT8"):
        check_qdq(model, "uint8", per_channel=True)


def test_cpu_int8_classes():
    from tritonkit.envinfo import int8_class

    assert int8_class(["avx2", "avx512f", "avx512bw", "avx512_vnni"]) == "vnni"
    assert int8_class(["avx2", "avx_vnni"]) == "vnni"
    assert int8_class(["avx2", "avx512f", "avx512bw"]) == "avx512"
    assert int8_class(["avx2"]) == "avx2"
    assert int8_class([]) == "generic"


def test_a_candidate_the_speed_gate_alone_rejects_is_kept_with_its_accuracy(tiny, monkeypatch):
    """A CPU of the class that cannot run the FP32 competitor the candidate lost to races it there: the search keeps
    the fastest candidate that held every accuracy gate, with its whole-split validation metrics."""
    path, sensitive = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1e-3)  # the real ceiling and quick timings pass

    def outrun(ctx, r):  # what a faster FP32 competitor (bf16) would leave it
        return {"speedup_batch8": 0.9, "speedup_lo_batch8": 5e-4, "speedup_hi_batch8": 9e-4,
                "int8_speedup": 0.9, "int8_speedup_lo": 5e-4}

    with monkeypatch.context() as m:
        m.setattr(timing, "candidate_speed", outrun)
        result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False,
                                                 log=lambda _m: None, min_int8_share=0.0))
    assert not result.passed and result.recipe is None and "fastest that met the accuracy gates" in result.reason
    kept = result.accurate
    assert kept is not None and kept["speed"]["int8_speedup_lo"] == 5e-4
    assert sensitive in kept["recipe"]["float_nodes"] and len(kept["recipe"]["float_nodes"]) < 3
    assert all(t.met(kept["validation"]) and t.met(kept["test"]) for t in spec.TARGETS), kept
    # Its validation numbers are the whole split's, as the search measured them: the same graph scores the same.
    rebuilt = search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False, log=lambda _m: None)
    again = rebuilt.val.metrics(rebuilt.build(search.Recipe.from_json(kept["recipe"])))
    assert again == pytest.approx(kept["validation"], abs=1e-6)
    # One that the held-out test split rejects is not kept (a test-split gate no graph meets).
    strict = search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False, log=lambda _m: None,
                                  min_int8_share=0.0)
    strict.targets["test"] = [Target("cosine_min", ">=", 1.0 + 1e-9)]
    with monkeypatch.context() as m:
        m.setattr(timing, "candidate_speed", outrun)
        assert search.run(strict).accurate is None
    # A search that is not speed-gated has no such candidate.
    assert search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                           log=lambda _m: None, min_int8_share=0.0)).accurate is None


def _recipe_file(tmp_path, served: dict, env_features=("avx2", "avx512bw", "avx512_vnni")):
    import json
    from types import SimpleNamespace

    spec = SimpleNamespace(NAME="tiny", spec=SimpleNamespace(file=tmp_path / "tiny.yaml"))
    data = {"model": "tiny", "env": {"cpu_int8_features": list(env_features)}, "served": served,
            "tensorrt": {"recipe": None, "status": "fp32-fallback"}}
    (tmp_path / "tiny.int8.json").write_text(json.dumps(data))
    return spec


def test_a_served_recipe_is_resolved_for_this_cpus_int8_class(tmp_path):
    from tritonkit.int8 import recipe

    legacy = {"recipe": {"form": "uint8", "placement": "inputs"}, "status": "passed"}
    spec = _recipe_file(tmp_path, legacy)  # one entry from before classes: its env's CPU was a VNNI one
    assert list(recipe.read(spec).served) == ["vnni"]
    assert recipe.load_recipes(spec, cpu="vnni")["served"].borrowed_from is None
    assert recipe.load_recipes(spec, cpu="avx2")["served"].borrowed_from == "vnni"
    own = {"recipe": None, "status": recipe.FALLBACK}
    spec = _recipe_file(tmp_path, {"vnni": legacy, "avx2": own})
    assert recipe.load_recipes(spec, cpu="avx2")["served"].to_json() == own
    assert not recipe.all_classes_fall_back(spec)  # the committed config marks a fallback of every class only
    spec = _recipe_file(tmp_path, {"vnni": own, "avx2": own})
    assert recipe.all_classes_fall_back(spec)
    # A class without its own entry borrows a found recipe, judged in its own arithmetic where there is one.
    spec = _recipe_file(tmp_path, {"vnni": legacy, "avx2": legacy})
    assert recipe.load_recipes(spec, cpu="avx512")["served"].borrowed_from == "avx2"
    assert recipe.load_recipes(spec, cpu="generic")["served"].borrowed_from == "avx2"
    spec = _recipe_file(tmp_path, {"vnni": legacy, "avx2": own})
    assert recipe.load_recipes(spec, cpu="avx512")["served"].borrowed_from == "vnni"


def test_every_committed_recipe_file_is_rewritten_byte_for_byte(tmp_path, monkeypatch):
    """The recipe file's one reader and one writer: a file read and written back holds the same bytes."""
    from tritonkit import kinds
    from tritonkit.int8 import recipe

    checked = 0
    for name in kinds.names():
        kind = kinds.get(name)
        committed = recipe.recipe_path(kind)
        if not committed.exists():
            continue
        read = recipe.read(kind)
        monkeypatch.setattr(recipe, "recipe_path", lambda _kind, out=tmp_path / committed.name: out)
        assert recipe.write(kind, read).read_bytes() == committed.read_bytes(), name
        monkeypatch.undo()
        checked += 1
    assert checked >= 3


@pytest.mark.parametrize("borrowed", [False, True])
def test_a_recipe_from_another_cpu_class_that_misses_here_serves_fp32_not_a_failed_build(tiny, tmp_path,
                                                                                         monkeypatch, borrowed):
    """All three layers INT8 misses the tiny model's gates. On the CPU class that searched it that is a broken
    recipe (the build fails); on another class it only means none was searched here: FP32, marked as such."""
    import onnxruntime as ort

    from tritonkit.int8 import recipe

    path, _ = tiny
    spec = TinySpec()
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    entry = recipe.Entry({"form": "int8", "placement": "inputs"}, "passed", borrowed_from="vnni" if borrowed else None)
    out = tmp_path / "served.onnx"
    outcome = decide.replay(spec, path, "served", entry, out, progress=False)
    if not borrowed:
        assert outcome.status == "failed" and any("cosine_min" in m for m in outcome.missed)
        return
    assert outcome.status == recipe.FALLBACK
    meta = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    assert meta[recipe.PRECISION_KEY].startswith("fp32-fallback: the served recipe was searched on a vnni CPU")
    assert not any(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node)


@pytest.mark.parametrize("candidate", ["accurate", "inaccurate"])
def test_a_cpu_without_bf16_replays_its_classes_accurate_candidate(tiny, tmp_path, monkeypatch, candidate):
    """The class's search fell back only because FP32 on OpenVINO bf16 outran its accurate candidate. A CPU of the
    class without native bf16 cannot run that competitor: it replays the candidate, proves it on the test split and
    races FP32 as served here; one that misses a gate there serves FP32, marked, and the build goes on."""
    import json

    import onnxruntime as ort

    from tritonkit import envinfo
    from tritonkit.int8 import recipe

    path, sensitive = tiny
    floats = [sensitive] if candidate == "accurate" else []  # every layer INT8 misses the tiny model's gates
    found = {"form": "int8", "placement": "inputs", "float_nodes": floats}
    entry = {"recipe": None, "status": recipe.FALLBACK, "speed_against": BF16_COMPETITOR,
             "accurate": {"recipe": found, "validation": {"cosine_min": 0.9999}, "speed": {"int8_speedup": 0.9}}}
    committed = _recipe_file(tmp_path, {"vnni": entry})
    monkeypatch.setenv(envinfo.CLASS_ENV, "vnni")
    monkeypatch.setenv(envinfo.NO_BF16_ENV, "1")
    served = recipe.load_recipes(committed)["served"]
    assert served.recipe == found and served.without_bf16
    assert recipe.load_recipes(committed, cpu="vnni")["served"].to_json() == entry  # a class named: as committed
    spec = TinySpec()
    spec.EXPORT = type("Export", (), {"name": "tiny"})
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1e-3)  # this test is about which graph, not its speed
    monkeypatch.setattr(report, "REPORTS", tmp_path)
    out = tmp_path / "served.onnx"
    outcome = decide.replay(spec, path, "served", served, out, progress=False)
    decide.write_records(spec, [outcome])
    dq = any(n.op_type == "DequantizeLinear" for n in onnx.load(str(out)).graph.node)
    meta = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta().custom_metadata_map
    if candidate == "accurate":
        assert outcome.status == "passed" and dq and recipe.file_recipe(out) == recipe.recipe_digest(found)
        rep = json.loads(report.report_path(spec).read_text())
        assert all(t.met(rep["test"]) for t in spec.TARGETS) and "no native bf16" in rep["recipe_cpu"]
    else:
        assert outcome.status == recipe.FALLBACK and not dq
        assert "replayed for a CPU without native bf16, misses here (test: cosine_min" in meta[recipe.PRECISION_KEY]
    # A CPU with native bf16 serves what its class's race chose: FP32 on OpenVINO bf16.
    monkeypatch.delenv(envinfo.NO_BF16_ENV)
    if envinfo.has_bf16():
        assert recipe.load_recipes(committed)["served"].to_json() == entry


def test_int8_docs_replace_this_cpu_classes_table_and_keep_the_others(tmp_path):
    from tritonkit import envinfo

    begin, end = report.README_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{begin}\nCPU INT8 class `zzz`. kept as it was\n\n| t |\n\n"
                      f"CPU INT8 class `{envinfo.int8_class()}`. stale\n{end}\nrest\n")
    report.docs(readme=readme, out=tmp_path / "page.md")
    text = readme.read_text()
    assert "CPU INT8 class `zzz`. kept as it was\n\n| t |" in text and "stale" not in text
    assert text.count(f"CPU INT8 class `{envinfo.int8_class()}`. Regenerated") == 1
    assert text.startswith("intro\n") and text.endswith(f"{end}\nrest\n")


def _unit_scale_qdq_matmul(weight: np.ndarray, zero_point: np.ndarray, rows: int):
    """Y = DQ(Q(X)) @ DQ(W) with every scale 1, so its outputs are the integer dot products themselves; X's zero
    point (0 of uint8 or int8) picks u8 or s8 activations. The weights' zero point is explicit, as
    onnxruntime.quantization writes it: without one, onnxruntime 1.23's exact-path rewrite on a real AVX2 CPU aborts
    the process (an out-of-range input index), which VNNI CPUs never reach."""
    from onnx import TensorProto, helper, numpy_helper

    k, n = weight.shape
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]),
             helper.make_node("MatMul", ["xd", "wd"], ["y"])]
    inits = [numpy_helper.from_array(np.array(1.0, np.float32), "xs"), numpy_helper.from_array(zero_point, "xz"),
             numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.array(1.0, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])
    model.ir_version = 9
    return model


def test_exact_sessions_compute_int8_as_exact_integer_arithmetic(tmp_path):
    """u8 activations at 255 times s8 weights at 127: each pair of products (64,770) overflows int16, which
    onnxruntime's non-VNNI u8s8 kernels sum in saturating int16. The exact session (how both forms are judged there)
    must give the true dot products on any CPU, and so must `Kind.session`, which the packed graph's proof and the
    served-file checks use: it computes as a served replica of this CPU (an AVX2 build once judged its packed MiniLM
    in saturating int16 pairs: top-10 overlap 0.909 against 0.96 as served)."""
    from tritonkit.kinds.base import Kind

    k = 64
    path = tmp_path / "qdq.onnx"
    onnx.save(_unit_scale_qdq_matmul(np.full((k, 4), 127, np.int8), np.array(0, np.uint8), rows=2), str(path))
    x = np.full((2, k), 255.0, np.float32)
    for sess in (evaluate.session(path, exact=True), Kind.session(path)):
        got = sess.run(None, {"x": x})[0]
        np.testing.assert_array_equal(got, np.full((2, 4), 255.0 * 127 * k, np.float32))


def test_the_tensorrt_form_is_judged_by_this_cpus_kernels_only_where_they_sum_int8_exactly(monkeypatch):
    """TensorRT sums int8 products exactly in int32. Where onnxruntime's fused kernels do too (VNNI), its
    candidates are judged in a plain session; elsewhere in one asking for exact sums. On a VNNI CPU the fused
    kernels must then give the true sums of the form's int8 activations at both extremes."""
    from tritonkit import envinfo
    from tritonkit.int8.judge import exact_judgement

    for cpu, exact in (("vnni", False), ("avx512", True), ("avx2", True), ("generic", True)):
        monkeypatch.setenv(envinfo.CLASS_ENV, cpu)
        assert exact_judgement() is exact, cpu  # both forms alike
    monkeypatch.delenv(envinfo.CLASS_ENV)
    if not envinfo.int8_sums_exact():
        pytest.skip(f"this CPU is INT8 class {envinfo.int8_class()}: its fused kernels are not the judgement")
    k, rng = 3072, np.random.default_rng(0)
    weight = np.concatenate([np.full((k, 2), 127, np.int8), np.full((k, 2), -127, np.int8),
                             rng.integers(-127, 128, (k, 12)).astype(np.int8)], axis=1)
    # Symmetric int8 activations (zero point 0 of int8): TensorRT's form.
    model = _unit_scale_qdq_matmul(weight, np.array(0, np.int8), rows=4)
    x = np.stack([np.full(k, 127.0), np.full(k, -128.0), *rng.integers(-128, 128, (2, k))]).astype(np.float32)
    got = evaluate.session(model, exact=exact_judgement()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got.astype(np.int64), x.astype(np.int64) @ weight.astype(np.int64))


def test_the_speed_interval_separates_a_clear_gain_and_straddles_a_tie():
    from tritonkit.int8.speed import ratio_interval

    rng = np.random.default_rng(1)
    fp32 = 10.0 * (1 + 0.05 * rng.standard_normal(21))
    lo, hi = ratio_interval(fp32, fp32 / 1.3 * (1 + 0.05 * rng.standard_normal(21)))
    assert 1.0 < lo < 1.3 < hi < 1.6, (lo, hi)
    lo, hi = ratio_interval(fp32, fp32 * (1 + 0.08 * rng.standard_normal(21)))
    assert lo < 1.0 < hi, (lo, hi)
    assert ratio_interval(fp32, fp32 / 2) == pytest.approx((2.0, 2.0))  # noiseless pairs: a point


def test_the_speed_gate_judges_the_interval_not_the_median():
    from tritonkit import kinds

    target = kinds.get("text_embedding").SPEED_TARGET
    assert target.metric == "int8_speedup_lo" and target.value == 1.0
    assert not target.met({"int8_speedup": 1.31, "int8_speedup_lo": 0.98})  # a median above, noise across 1.0
    assert target.met({"int8_speedup": 1.12, "int8_speedup_lo": 1.04})


def test_the_speed_gate_races_fp32_as_the_int8_name_would_serve_it(tiny, monkeypatch):
    """Where the CPU has native bf16 the INT8 name may serve the FP32 file on OpenVINO bf16 (it computes the floor),
    so a search races INT8 against that wherever it beats the FP32 model's variant by the runtime choice's margin;
    elsewhere against the FP32 model's variant. A replay races what its recipe was searched against."""
    from tritonkit import envinfo
    from tritonkit.int8.decide import competitor as replay_competitor
    from tritonkit.int8.recipe import Entry

    path, _ = tiny
    spec = TinySpec()
    bf16 = Entry(speed_against=BF16_COMPETITOR)
    monkeypatch.setenv(envinfo.CLASS_ENV, "avx2")  # a class without bf16: only the served variant can compete
    assert fp32_competitor(spec, path, "onnxruntime", 1.1) == ("onnxruntime", {})
    assert replay_competitor(spec, bf16, "onnxruntime") == "onnxruntime"
    assert replay_competitor(spec, Entry(speed_against="openvino"), "onnxruntime") == "openvino"
    assert replay_competitor(spec, Entry(), "openvino") == "openvino"  # a recipe from before the race: as searched
    monkeypatch.delenv(envinfo.CLASS_ENV)
    if not envinfo.has_bf16():
        pytest.skip("this CPU has no native bf16: the FP32 file cannot run on OpenVINO bf16 here")
    assert replay_competitor(spec, bf16, "onnxruntime") == BF16_COMPETITOR
    chosen, timed = fp32_competitor(spec, path, "onnxruntime", 0.0)  # any gain is enough
    assert chosen == BF16_COMPETITOR and timed["bf16_vs_served"] > 0
    assert set(timed) == {"bf16_vs_served", *(f"bf16_gain_batch{b}" for b in spec.SPEED_BATCHES)}
    assert fp32_competitor(spec, path, "onnxruntime", math.inf)[0] == "onnxruntime"  # no gain is enough


def test_a_speed_gate_the_fastest_start_cannot_meet_ends_the_search_before_any_unit_goes_float(tiny):
    """Every start has every unit in INT8 and float units only slow a graph down: where the fastest start's
    interval lies under the gate at a served batch size, no recipe can pass, and the search says so at once."""
    path, _ = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1000.0)  # no INT8 graph is 1000x its FP32 graph
    result = search.run(search.SearchContext(spec, path, ["int8", "uint8"], check_speed=True, progress=False,
                                             log=lambda _m: None))
    assert not result.passed and result.recipe is None
    assert result.reason.startswith("no recipe can meet the speed gate"), result.reason
    assert result.speed["speedup_hi_batch8"] < 1000.0
    assert {s.stage for s in result.steps} == {"start"}, "it searched past the starts"


class _SlowSpec(TinySpec):
    """Scoring takes DELAY per 64 rows, like a real model's evaluation: a known floor under every evaluation's
    time, so a test can say what a budget could afford without reading the search's own estimates. Six validation
    batches: the search's sample (every third) is a third of the split, as on the shipped models."""

    NAME = "tiny-slow"  # its own FP32 references: the validation split differs from TinySpec's
    DELAY = 0.04

    def __init__(self):
        super().__init__()
        self.data["validation"] = np.random.default_rng(1).standard_normal((384, 16)).astype(np.float32)
        self.SEARCH_PRIOR = {"calibrate_method": "entropy"}  # not the listed order's first variant (percentile)

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        time.sleep(self.DELAY * len(ref) / 64)
        return super().gate_metrics(ref, got)


_QUIET = {"check_speed": False, "progress": False, "log": lambda _m: None, "min_int8_share": 0.0}


@pytest.fixture(scope="module")
def unbudgeted(tiny):
    """The slow spec's whole search: the faster of two (a process's first pays onnxruntime's warm-up)."""
    path, _ = tiny
    spec = _SlowSpec()
    return spec, min((search.run(search.SearchContext(spec, path, ["int8"], **_QUIET)) for _ in range(2)),
                     key=lambda r: r.seconds)


@pytest.mark.parametrize("share", [0.5, 0.7, 0.85])
def test_a_budget_never_starts_a_step_it_cannot_afford_and_lists_what_it_cut(tiny, unbudgeted, share):
    path, _ = tiny
    spec, free = unbudgeted
    assert free.passed and not free.cuts
    assert next(s.change for s in free.steps if s.stage == "variant") == "as started + calibrate=entropy"
    budget = free.seconds * share
    logs: list[str] = []
    cut = search.run(search.SearchContext(spec, path, ["int8"], budget=Budget.of(budget),
                                          **{**_QUIET, "log": logs.append}))
    assert cut.cuts, f"{share} of the time a whole search took, and nothing was cut"
    assert any("not started" in line for line in logs)

    def median_before(i: int, stage: str) -> float | None:
        """What the minmax steps of `stage` before step i took (one graph here: no calibration inside them; a
        histogram method's first step holds its graph's histogram pass)."""
        same = [e.seconds for e in cut.steps[:i] if e.stage == stage and "-minmax" in (e.recipe or "")]
        return float(np.median(same)) if same else None

    for i, s in enumerate(cut.steps[1:], 1):  # the first start runs whatever the budget
        # Started only with its estimate inside what the test's own clock says was left, less a reserve.
        assert s.estimate_s is not None and s.estimate_s <= s.left_s <= budget - s.started_s + 0.002, (s, budget)
        assert s.estimate_s >= spec.DELAY, s  # every evaluation takes DELAY at least: an estimate under it is wrong
        if s.stage in ("variant", "fallback") and median_before(i, s.stage) is not None:
            assert s.estimate_s == pytest.approx(median_before(i, s.stage), abs=0.002), s
    for c in cut.cuts:
        # Not started because its estimate exceeded what was left on the test's clock less the reserve (a found
        # candidate's confirmation and test split: two evaluations, 2 DELAY at least).
        assert c["reserve_s"] >= 2 * spec.DELAY and c["left_s"] <= budget - c["at_s"] + 0.002, c
        assert c["left_s"] == pytest.approx(max(0.0, budget - c["at_s"] - c["reserve_s"]), abs=0.002), c
        assert (c["estimate_s"] is None and c["left_s"] == 0) or c["estimate_s"] > c["left_s"] - 0.001, c
        if c["stage"] in ("variant:sample", "fallback:sample"):
            i = sum(s.started_s <= c["at_s"] for s in cut.steps)
            if median_before(i, c["stage"].split(":")[0]) is not None:
                assert c["estimate_s"] >= median_before(i, c["stage"].split(":")[0]) - 0.002, c
    for j, c in enumerate(cut.cuts):
        if c["stage"].startswith(("fallback", "track")):  # a step the search needs: nothing after it but checks
            assert all(s.stage == "confirm" for s in cut.steps if s.started_s > c["at_s"]), (c, cut.steps)
            assert all(x["stage"].startswith(RESERVED) for x in cut.cuts[j + 1:]), cut.cuts
    # A variant other than the prior's starts only with room left for the rest of its track, each part estimated at
    # no less than its evaluations take (a sample: 2 DELAY; the whole split, three samples; 3 Gemm units): itself
    # 2, the resample 6 + 2, the scan 4 x 2, one fallback (5 candidates over 3 units) 5 x 2, the reserve 2 x 6.
    for s in cut.steps:
        if s.stage == "variant" and s.change != "as started + calibrate=entropy":
            assert budget - s.started_s >= (2 + 8 + 8 + 10 + 12) * spec.DELAY, (s, budget)
    # An option that did not fit (a knob variant, the resample, a sensitivity unit) is skipped alone: the search
    # went on to its next phase, which ran or was cut in its turn.
    phases = ["variant:sample", "resample", "unit:sample", "fallback:sample"]
    cut_phases = [phases.index(c["stage"]) for c in cut.cuts if c["stage"] in phases]
    ran_after = [s for s in cut.steps if s.stage == "fallback"]
    if cut_phases and cut_phases[0] < 3:
        assert max(cut_phases) > cut_phases[0] or ran_after, cut.cuts
    # The prior's variant was tried (or cut) before any other.
    tried = [s.change for s in cut.steps if s.stage == "variant"] or \
        [c["what"] for c in cut.cuts if c["stage"] == "variant:sample"]
    assert tried[0] == "as started + calibrate=entropy", tried
    assert cut.seconds <= budget + 6 * spec.DELAY + 0.5, (cut.seconds, budget)


def test_the_kinds_prior_is_tried_first(tiny):
    path, _ = tiny
    spec = TinySpec()
    for prior in ("int8", "uint8"):  # whichever measured better at the start, the prior's form goes first
        spec.SEARCH_PRIOR = {"form": prior, "calibrate_method": "entropy"}
        s = search.SearchContext(spec, path, ["int8", "uint8"], check_speed=False, progress=False,
                                 log=lambda _m: None)
        tracks = steps.start(s)
        assert tracks[0].recipe.form == prior
        assert s.steps[0].change == f"form={prior} placement=inputs", "the prior's start was not measured first"
    names = [name for name, _ in steps.knob_variants(s, tracks[0])]
    assert names[0] == "as started" and names[1] == "as started + calibrate=entropy", names
    spec.SEARCH_PRIOR = {}
    plain = search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False, log=lambda _m: None)
    assert [n for n, _ in steps.knob_variants(plain, tracks[0])][1] == "as started + calibrate=percentile"


def test_a_further_start_must_leave_the_first_track_its_time(tiny):
    """Starts after the first are options: one runs only where what is left, less the reserve, also holds the rest
    of the first track (a variant, the resample, the scan, a fallback). all-mpnet-base-v2's 15-minute search spent
    its budget on four starts and searched no track."""
    path, _ = tiny
    spec = TinySpec()
    spec.SEARCH_PRIOR = {"form": "uint8", "placement": "inputs"}
    spec.SPEED_TARGET = Target("int8_speedup", ">=", 0.01)  # no start dropped for speed: each gives a track
    hour = 3600.0

    def leaving(s: search.SearchContext, rest: float) -> search.SearchContext:
        """`s`, its plan reckoning that the first track leaves `rest` seconds after its start."""
        real_after_start = s.plan.after_start

        def after_start(units: int) -> float:
            real = real_after_start(units)
            first = search.Recipe(form="uint8", placement="inputs")  # the prior's start, measured first
            # At least the scan: every unit and the unperturbed graph once, at a start's sample time.
            assert real >= (len(s.units(first)) + 1) * s.plan.estimate("start:sample") > 0
            return rest

        s.plan.after_start = after_start
        s.plan.deadline = s.plan.t0 + hour
        return s

    for rest, measured in ((0.0, 4), (hour, 1)):
        s = leaving(search.SearchContext(spec, path, ["int8", "uint8"], check_speed=True, progress=False,
                                         log=lambda _m: None, budget=Budget.of(hour)), rest)
        steps.start(s)
        assert s.steps[0].change == "form=uint8 placement=inputs" and len(s.steps) == measured, s.steps
        assert [c["stage"] for c in s.plan.cuts] == ["start:sample"] * (4 - measured), s.plan.cuts
    # A first track already under the speed gate leaves nothing to protect: every start is measured, and a speed
    # ceiling then speaks for every form.
    spec.SPEED_TARGET = Target("int8_speedup", ">=", 1000.0)

    class Slow(search.SearchContext):
        early_speed = 0.0  # none dropped: each start under the gate still gives a (slow) track

    s = leaving(Slow(spec, path, ["int8", "uint8"], check_speed=True, progress=False, log=lambda _m: None,
                     budget=Budget.of(hour)), hour)
    steps.start(s)
    assert len(s.steps) == 4 and not s.plan.cuts, (s.steps, s.plan.cuts)


def test_a_start_too_slow_to_keep_is_dropped_before_its_accuracy_is_scored(tiny, monkeypatch):
    """A start is timed first: one under the early speed bound is dropped without an evaluation (10-25 s each on the
    new-model fixture); the fastest is still remembered for the speed ceiling. Fast enough, each is scored."""
    path, _ = tiny
    scored = []
    real = evaluate.Evaluator.metrics
    monkeypatch.setattr(evaluate.Evaluator, "metrics", lambda self, *a, **k: scored.append(1) or real(self, *a, **k))
    spec = TinySpec()
    for gate, evaluations in ((1000.0, 0), (0.01, 4)):
        spec.SPEED_TARGET = Target("int8_speedup", ">=", gate)
        scored.clear()
        s = search.SearchContext(spec, path, ["int8", "uint8"], check_speed=True, progress=False,
                                 log=lambda _m: None)
        tracks = steps.start(s)
        assert len(s.steps) == 4 and len(scored) == evaluations, (gate, s.steps)
        assert all(bool(st.metrics) == bool(evaluations) and st.speedup for st in s.steps)
        assert s.fastest is not None and len(tracks) == min(evaluations, s.max_tracks)
    spec.SPEED_TARGET = Target("int8_speedup", ">=", 1000.0)
    result = search.run(search.SearchContext(spec, path, ["int8", "uint8"], check_speed=True, progress=False,
                                             log=lambda _m: None))
    assert result.reason.startswith("no recipe can meet the speed gate"), result.reason
    page = pages.render_markdown({"model": "tiny", "form": "served", "status": "fp32-fallback", "served": "fp32",
                                  "created": "today", "search": result.to_json()})
    assert page.count("| not scored |") == 4, page


@pytest.mark.parametrize("flag,budget", [([], 15 * 60), (["--budget-minutes", "5"], 300),
                                         (["--budget-minutes", "0"], None)])
def test_a_search_is_capped_at_fifteen_minutes_unless_told(flag, budget):
    import inspect

    from tritonkit import build

    args = build.arguments().parse_args(["text_embedding", *flag])
    assert build.budget_from_minutes(args.budget_minutes) == budget
    # Library callers (and `make build` of a model with no committed recipe) get the same default.
    for fn, name in ((build.build, "search_budget_s"), (build.build_int8, "search_budget_s")):
        assert inspect.signature(fn).parameters[name].default == 15 * 60, fn


def test_the_served_form_gets_two_thirds_of_what_is_left_and_tensorrt_the_rest():
    import time

    budget = Budget.of(900, start=time.perf_counter() - 60)  # 60 s spent: 840 left
    assert budget.share(SERVED_SHARE).left() == pytest.approx(560, abs=1)
    assert budget.left() == pytest.approx(840, abs=1)  # --form served (or the TensorRT form after it): all of it
    assert Budget.of(900, start=time.perf_counter() - 950).share(SERVED_SHARE).left() == 0.0  # spent
    assert not Budget.of(None).bounded and Budget.of(None).share(SERVED_SHARE).left() is None
    assert not Budget.of(0).bounded  # `--budget-minutes 0`: no cap


def test_a_build_that_searches_keeps_its_budget_end_to_end():
    import time

    # 15 min, 25 s of export spent: the search gets the rest less the share kept for replays and runtime choice.
    budget = Budget.of(900, start=time.perf_counter() - 25)
    searching = budget.less(AFTER_SEARCH_SHARE * budget.seconds)
    assert searching.left() == pytest.approx(900 * (1 - AFTER_SEARCH_SHARE) - 25, abs=1)
    assert searching.deadline < budget.deadline and searching.seconds == 900
    assert Budget.of(900, start=time.perf_counter() - 1000).less(225).left() == 0.0  # spent: form_cut starts nothing


def test_a_re_search_judges_the_committed_candidate_first_from_its_parameters(tiny, tmp_path, monkeypatch):
    """A re-search builds the committed candidate from its quantization parameters (no calibration pass, the
    replay's bytes) and judges it before any start: within a budget that affords nothing else it is still proven
    (passing, or kept as the accurate candidate where the speed gate alone rejects it); one that misses is dropped
    and the search goes on from its starts."""
    from tritonkit.int8 import calibration
    from tritonkit.int8.builder import quantize_with_params

    path, sensitive = tiny
    spec = TinySpec()
    committed = search.Recipe(form="int8", placement="inputs", float_nodes=[sensitive])
    replayed = tmp_path / "replayed.onnx"
    # Named as a replay names it (onnx producer_name "<model>-<form>"): the same bytes, not only the same graph.
    params = quantize_with_params(path, replayed, committed.to_quant(spec.WEIGHT_OPS, name=f"{spec.NAME}-tensorrt"),
                                  spec.calibration_batches, spec.calibration_batch_count(), progress=False)
    passes: list[Path] = []
    original = calibration.collect
    monkeypatch.setattr(calibration, "collect", lambda graph, *a, **k: passes.append(graph) or original(graph, *a, **k))
    quiet = dict(check_speed=False, progress=False, log=lambda _m: None, min_int8_share=0.0)

    searcher = search.SearchContext(spec, path, ["int8"], budget=Budget.of(1e-6), committed=(committed, params),
                                    **quiet)
    assert searcher.build(committed).SerializeToString() == onnx.load(str(replayed)).SerializeToString()
    result = search.run(searcher)
    assert result.passed and result.recipe == committed, result.reason
    assert [s.stage for s in result.steps] == ["committed"] and not passes, (result.steps, passes)
    assert all(t.met(result.validation) and t.met(result.test) for t in spec.TARGETS)
    # Without it, the same budget runs the first start, which calibrates.
    alone = search.run(search.SearchContext(spec, path, ["int8"], budget=Budget.of(1e-6), **quiet))
    assert [s.stage for s in alone.steps] == ["start"] and passes and not alone.passed

    def outrun(ctx, r):  # a faster FP32 competitor (bf16) than the candidate
        return {"speedup_batch8": 0.9, "speedup_lo_batch8": 0.8, "speedup_hi_batch8": 0.95,
                "int8_speedup": 0.9, "int8_speedup_lo": 0.8}

    with monkeypatch.context() as m:
        m.setattr(timing, "candidate_speed", outrun)
        slow = search.run(search.SearchContext(spec, path, ["int8"], budget=Budget.of(1e-6),
                                               committed=(committed, params), **{**quiet, "check_speed": True}))
    assert not slow.passed and "fastest that met the accuracy gates" in slow.reason, slow.reason
    assert slow.accurate["recipe"]["float_nodes"] == [sensitive] and slow.accurate["speed"]["int8_speedup_lo"] == 0.8

    # A committed candidate that misses here (every layer INT8) is dropped: the search goes on and finds the layer.
    everything = search.Recipe(form="int8", placement="inputs")
    given = quantize_with_params(path, tmp_path / "all.onnx", everything.to_quant(spec.WEIGHT_OPS),
                                 spec.calibration_batches, spec.calibration_batch_count(), progress=False)
    again = search.run(search.SearchContext(spec, path, ["int8"], committed=(everything, given), **quiet))
    assert again.steps[0].stage == "committed" and not again.steps[0].passed
    assert again.passed and sensitive in again.recipe.float_nodes and again.steps[1].stage == "start"


def _committed(path, spec, float_nodes: list[str], out: Path) -> tuple:
    """A committed int8/inputs candidate with `float_nodes` float, and the parameters a replay builds it from."""
    from tritonkit.int8.builder import quantize_with_params

    r = search.Recipe(form="int8", placement="inputs", float_nodes=float_nodes)
    return r, quantize_with_params(path, out, r.to_quant(spec.WEIGHT_OPS), spec.calibration_batches,
                                   spec.calibration_batch_count(), progress=False)


def test_a_re_search_trims_the_committed_candidate_before_any_start(tiny, tmp_path):
    """A committed candidate with a layer float that need not be (a block fallen back whole) is trimmed right after
    it is judged: the re-search ends with the sensitive layer alone float, the other back in INT8."""
    path, sensitive = tiny
    spec = TinySpec()
    other = next(n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm" and n.name != sensitive)
    committed, params = _committed(path, spec, [sensitive, other], tmp_path / "c.onnx")
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                             log=lambda _m: None, min_int8_share=0.0, committed=(committed, params)))
    stages = [s.stage for s in result.steps]
    assert stages[:4] == ["committed", "trim", "trim", "confirm"], stages
    # Last added first: the other layer returns, then the sensitive one, tried, stays.
    assert [s.change.split(" back")[0] for s in result.steps[1:3]] == [other, sensitive]
    assert [s.passed for s in result.steps[1:3]] == [True, False]
    assert result.passed and result.recipe.float_nodes == [sensitive], result.recipe


def test_a_committed_candidate_within_the_margin_only_is_trimmed_before_it_is_dropped(tiny, tmp_path):
    """Another machine's FP32 file can leave a committed candidate above every gate but inside the margin (Lite1's
    +39): it is trimmed (each return screened at the gates on the sample) and the trim stands only where the whole
    split holds it with the margin; one that misses even the gates is dropped untrimmed."""
    from tritonkit.int8.gates import slack

    path, sensitive = tiny
    spec = TinySpec()
    other = next(n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm" and n.name != sensitive)
    committed, params = _committed(path, spec, [sensitive, other], tmp_path / "c.onnx")

    def run(margin: float):
        lines: list[str] = []
        s = search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False, log=lines.append,
                                 min_int8_share=0.0, committed=(committed, params), margin=margin)
        return s, search.run(s), lines

    _, plain, _ = run(0.0)
    room = min(slack(t, plain.steps[0].metrics) for t in spec.TARGETS)
    assert room > 0, plain.steps[0]
    s, result, lines = run(room * 1.5)  # holds the gates, not this margin
    stages = [st.stage for st in result.steps]
    assert not result.steps[0].passed and stages[1:3] == ["trim", "trim"], stages
    assert any("holds the gates here, not the margin: trimmed" in line for line in lines), lines
    confirm = next(st for st in result.steps if st.stage == "confirm")
    assert confirm.passed == s.gates.holds("validation", confirm.metrics, room * 1.5)
    assert any("no trim of it holds" in line for line in lines) is not confirm.passed, lines

    bare = _committed(path, spec, [], tmp_path / "b.onnx")  # the sensitive layer in INT8: under the gates
    dropped = search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                              log=lambda _m: None, min_int8_share=0.0, committed=bare,
                                              margin=room * 1.5))
    assert not dropped.steps[0].passed and dropped.steps[1].stage != "trim", [st.stage for st in dropped.steps]



def test_a_re_search_takes_its_classes_committed_candidate_where_its_parameters_apply(tiny, tmp_path, monkeypatch):
    """pipeline.search_forms hands each form's search the committed recipe (else the accurate candidate) of this CPU
    class with its parameters; parameters computed from another FP32 graph do not apply, and it searches from the
    starts."""
    import json

    from tritonkit import envinfo
    from tritonkit.int8 import recipe
    from tritonkit.int8.builder import quantize_with_params
    from tritonkit.int8.params import file_digest

    path, sensitive = tiny
    spec = TinySpec()
    found = {"form": "int8", "placement": "inputs", "float_nodes": [sensitive]}
    entry = {"recipe": None, "status": recipe.FALLBACK, "speed_against": BF16_COMPETITOR,
             "accurate": {"recipe": found}}
    committed = _recipe_file(tmp_path, {"vnni": entry})
    committed.spec.file.write_text('name = "tiny"\n')  # what the parameters' origin digests
    monkeypatch.setenv(envinfo.CLASS_ENV, "vnni")
    own = recipe.read(committed).served["vnni"]
    assert recipe.committed_candidate(committed, "served", own, path, file_digest(path)) is None  # no parameters
    r = search.Recipe.from_json(found)
    quantize_with_params(path, tmp_path / "q.onnx", r.to_quant(spec.WEIGHT_OPS), spec.calibration_batches,
                         spec.calibration_batch_count(), False, None, recipe.recipe_digest(found),
                         recipe.params_origin(committed)).save(recipe.params_path(committed, "served"))
    got = recipe.committed_candidate(committed, "served", own, path, file_digest(path))
    assert got is not None and got[0] == r and got[1].recipe == recipe.recipe_digest(found)
    assert recipe.committed_candidate(committed, "served", recipe.Entry(found, "passed"), path,
                                      file_digest(path))[0] == r  # a passing recipe is its own candidate
    # An export's last bits may differ between CPUs: the same spec and packages still apply; a changed spec does not.
    assert recipe.committed_candidate(committed, "served", own, path, "0" * 64) is not None
    committed.spec.file.write_text('name = "tiny"\ndescription = "changed"\n')
    assert recipe.committed_candidate(committed, "served", own, path, "0" * 64) is None
    assert json.loads((tmp_path / "tiny.int8.json").read_text())["served"]["vnni"] == entry


@pytest.mark.parametrize("named", ["sensitive", "harmless"])
def test_the_kinds_prior_float_nodes_are_one_candidate_before_the_scan(tiny, named):
    """A kind may name what its shipped models kept float: that set is scored right after the knob variants, and
    where it holds on the whole split it is the search's result, with no scan or fallback after it; one that misses
    costs one sample step, and the scan finds the layer as before."""
    path, sensitive = tiny
    spec = TinySpec()
    harmless = next(n for n in search.quantizable_nodes(path, spec.WEIGHT_OPS) if n != sensitive)
    spec.SEARCH_PRIOR_FLOAT = ("^" + (sensitive if named == "sensitive" else harmless) + "$",)
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=False, progress=False,
                                             log=lambda _m: None, min_int8_share=0.0))
    stages = [s.stage for s in result.steps]
    prior = stages.index("prior")
    assert "variant" in stages[:prior] and "fallback" not in stages[:prior], stages
    assert result.passed and result.recipe.float_nodes == [sensitive], result.recipe
    if named == "sensitive":
        assert result.steps[prior].passed and stages[prior + 1] == "confirm", stages
        assert "fallback" not in stages and not result.sensitivity, stages  # the passing prior ended the search
    else:
        assert not result.steps[prior].passed and result.sensitivity[0]["units"][0]["unit"] == sensitive


def test_a_samples_reference_is_the_whole_splits_rows_once_that_is_computed(tiny, monkeypatch):
    """A sample (every third batch, plus the worst rows of others) takes its FP32 outputs from the whole split's
    reference where that was computed already, instead of running the FP32 graph again; the same rows either way."""
    path, _ = tiny
    spec = _SlowSpec()  # six validation batches
    hard = {1: [0, 5], 4: [2]}
    evaluate._REFERENCES.pop(evaluate._reference_key(spec, path, "validation"), None)  # another test's
    assert not evaluate.reference_ready(spec, path, "validation")
    fresh = evaluate.Evaluator(spec, path, "validation", stride=3, extra_rows=hard).ref  # the sample's own run
    evaluate.reference(spec, path, "validation")
    assert evaluate.reference_ready(spec, path, "validation")
    with monkeypatch.context() as m:  # no session opened: the FP32 graph does not run again
        m.setattr(evaluate, "session", lambda *_a, **_k: pytest.fail("the sample ran the FP32 graph again"))
        sliced = evaluate.Evaluator(spec, path, "validation", stride=3, extra_rows=hard)
    assert len(sliced.ref) == 64 * 2 + 3 and sliced.ref is not fresh
    np.testing.assert_allclose(sliced.ref, fresh, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sliced.ref, evaluate.run_batches(evaluate.session(path), sliced.batches), atol=1e-6)


def test_the_prior_float_nodes_go_on_the_priors_own_variant_first(tiny):
    """The prior float nodes go on the variant with the prior's knobs even where another variant scored better with
    every unit INT8: that score does not rank variants once the worst units stay float."""
    path, sensitive = tiny
    spec = TinySpec()
    spec.SEARCH_PRIOR_FLOAT = ("^" + sensitive + "$",)
    spec.SEARCH_PRIOR = {}
    probe = search.SearchContext(spec, path, ["int8"], **_QUIET)
    track = steps.start(probe)[0]
    named = dict(steps.knob_variants(probe, track))
    scores = {name: probe.measure("variant", name, r, evaluator=probe.sample).distortion
              for name, r in named.items() if name != "as started"}
    worst = max(scores, key=scores.get)
    assert scores[worst] > min(scores.values()), scores  # else any rule would pick it
    spec.SEARCH_PRIOR = {k: getattr(named[worst], k) for k in context.KNOBS
                         if getattr(named[worst], k) != getattr(track.recipe, k)}
    result = search.run(search.SearchContext(spec, path, ["int8"], **_QUIET))
    priors = [s for s in result.steps if s.stage == "prior"]
    assert priors and priors[0].recipe == replace(named[worst], float_nodes=[sensitive]).describe(), priors


@pytest.mark.parametrize("int8_variant, timed_on", [
    # OpenVINO's INT8 sums saturate off VNNI as onnxruntime's default session does (an AVX2 EPYC: cosine min 0.81
    # against exact int32 here), so there the candidate misses run as openvino and is timed where it was judged.
    ("openvino", "openvino" if __import__("tritonkit.envinfo").envinfo.int8_sums_exact() else "onnxruntime"),
    pytest.param("openvino-bf16", "onnxruntime", marks=pytest.mark.skipif(
        not __import__("tritonkit.envinfo").envinfo.has_bf16(),
        reason="needs a CPU with native bf16: without it OpenVINO computes the float layer in f32")),
])
def test_the_speed_gate_times_int8_only_where_its_gates_hold(tmp_path, int8_variant, timed_on):
    """The speed gate times a candidate's INT8 graph on the INT8 model's variant only where the candidate holds the
    validation gates run so: its last layer must stay float and in fp32, so OpenVINO f32 keeps it and bf16 does
    not (a float layer in bf16 loses the difference of two channels near 1000); there it is timed under ONNX
    Runtime, where the search judged it, and a replay races it there too."""
    from tests.support.tiny_search import export_cancelling
    from tritonkit.int8.decide import replay_variants
    from tritonkit.int8.recipe import Entry
    from tritonkit.serving.runtimes import DEFAULT

    path = tmp_path / "cancelling.onnx"
    last = export_cancelling(path)
    spec = TinySpec()
    spec.SPEED_TARGET = Target("int8_speedup_lo", ">=", 1e-3)  # timing is not under test: any speed passes
    logs: list[str] = []
    result = search.run(search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False, log=logs.append,
                                             min_int8_share=0.0, speed_variants=(DEFAULT, int8_variant)))
    assert result.passed and last in result.recipe.float_nodes, result.reason
    assert result.int8_variant == timed_on
    assert any(f"misses run as {int8_variant}" in line for line in logs) == (timed_on != int8_variant), logs
    assert any(line.endswith(f"(INT8 on {timed_on})") for line in logs), logs
    assert replay_variants((DEFAULT, int8_variant), Entry(int8_variant=result.int8_variant)) == (DEFAULT, timed_on)


def test_a_build_graphs_fp32_reference_is_computed_once_across_processes(tiny, tmp_path, monkeypatch):
    """evaluate.reference keeps a build output's FP32 outputs on disk, named by the graph's bytes and the split's
    feeds: a later process (its in-memory cache empty) loads them without a run; another graph or other feeds run
    again; a graph outside the build outputs (a test's) is not kept."""
    import shutil

    from tritonkit import paths

    monkeypatch.setattr(paths, "BUILD_OUTPUTS", tmp_path / "build")
    fp32 = tmp_path / "build" / "artifacts" / "tiny.onnx"
    fp32.parent.mkdir(parents=True)
    shutil.copy(tiny[0], fp32)
    spec = TinySpec()
    runs: list[int] = []
    original = evaluate.run_batches
    monkeypatch.setattr(evaluate, "run_batches", lambda sess, b: runs.append(len(b)) or original(sess, b))

    first = evaluate.reference(spec, fp32, "validation")
    assert runs == [4] and len(list((tmp_path / "build" / "cache" / "references").glob("*.npy"))) == 1
    evaluate._REFERENCES.clear()  # a new process
    again = evaluate.reference(spec, fp32, "validation")
    assert runs == [4] and np.array_equal(first, again)
    evaluate._REFERENCES.clear()
    spec.data["validation"] = spec.data["validation"] * 0.5  # other feeds: measured again, the old file replaced
    assert not np.array_equal(evaluate.reference(spec, fp32, "validation"), first) and runs == [4, 4]
    assert len(list((tmp_path / "build" / "cache" / "references").glob("*.npy"))) == 1
    evaluate._REFERENCES.clear()
    evaluate.reference(spec, tiny[0], "validation")  # outside the build outputs: run, not kept
    assert runs == [4, 4, 4] and len(list((tmp_path / "build" / "cache" / "references").glob("*.npy"))) == 1


@pytest.mark.parametrize("up_front", [False, True])
def test_a_form_whose_first_start_and_up_front_floor_would_not_fit_is_not_searched(tiny, tmp_path, up_front):
    """A build's budget holds for a model of any size: a form's first start and, where its gates measure the
    half-precision floor up front (a gate at its maximum, gates.deferrable; else a judgement measures it when it
    needs it), that floor (the FP32 references not yet computed, then a run at its precision) are estimated from the
    FP32 graph's seconds a row, and a form they would not fit in is not started; it records an FP32 fallback that
    names the budget and the command."""
    import shutil

    from tritonkit.int8 import evaluate, floor, gates

    path, _ = tiny
    spec = TinySpec()
    if up_front:
        spec.TARGETS = (*spec.TARGETS, Target("cosine_min", ">=", 1.0))
    assert gates.deferrable(spec) is not up_front
    fresh = tmp_path / "tiny.onnx"  # a graph no test computed references of
    shutil.copy(path, fresh)
    rows = {s: sum(len(b["x"]) for b in spec.eval_batches(s)) for s in ("validation", "test")}
    cold = sum(rows.values()) * (floor.PRECISION_COST + 1.0)
    assert floor.estimate_s(spec, fresh, "bf16", row_s=1.0) == pytest.approx(cold)
    evaluate.reference(spec, fresh, "validation")
    evaluate.reference(spec, fresh, "test")
    warm = sum(rows.values()) * floor.PRECISION_COST
    assert floor.estimate_s(spec, fresh, "bf16", row_s=1.0) == pytest.approx(warm)
    need = START_PASSES * rows["validation"] + (warm if up_front else 0.0)
    assert pipeline.form_cut(spec, fresh, "served", need, row_s=1.0) is None
    cut = pipeline.form_cut(spec, fresh, "tensorrt", need - 1.0, row_s=1.0)
    assert cut is not None and cut.recipe is None and not cut.passed and cut.form == "int8"
    assert "budget cut the tensorrt search" in cut.reason and "make int8-search MODEL=tiny FORM=tensorrt" in cut.reason
    assert ("floor" in cut.reason) is up_front
    assert cut.cuts[0]["stage"] == "form" and cut.cuts[0]["estimate_s"] == pytest.approx(need, abs=0.1)
    assert floor.row_seconds(spec, fresh) > 0.0


@pytest.mark.parametrize("left, searched, fraction", [(600.0, True, 2 / 3), (400.0, True, 1.0), (300.0, False, 2 / 3)])
def test_the_served_form_takes_the_tensorrt_forms_share_where_only_the_whole_budget_fits_its_first_start(
        tiny, left, searched, fraction):
    """The served form serves every CPU replica: a first start that fits the search's budget but not the served
    form's two thirds of it still starts, with the whole budget; the TensorRT form gets what is left."""
    path, _ = tiny
    spec = TinySpec()
    # At 1 s a row the first start takes 332.8 s: within 2/3 of 600 s, within 400 s but not 2/3 of it, not in 300 s.
    assert START_PASSES * sum(len(b["x"]) for b in spec.eval_batches("validation")) == pytest.approx(332.8)
    cut, got = pipeline.form_share(spec, path, "served", left, 2 / 3, row_s=1.0)
    assert (cut is None) is searched and got == pytest.approx(fraction)
    assert pipeline.form_share(spec, path, "tensorrt", 400.0, 1.0, row_s=1.0) == (None, 1.0)
    cut, got = pipeline.form_share(spec, path, "tensorrt", 300.0, 1.0, row_s=1.0)
    assert cut is not None and got == 1.0


@pytest.mark.parametrize("gate, decided", [(100.0, True), (0.01, False)])
def test_the_speed_probe_decides_a_served_form_no_int8_graph_can_win_before_its_floor(tiny, gate, decided):
    """Before the served form's floor or any calibration pass, every start is built from two calibration batches
    (a graph's speed does not depend on its ranges) and timed: where even the fastest cannot meet the speed gate the
    form ends there; else the search goes on, with none of the probe's ranges in its workspace."""

    path, _ = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = replace(spec.SPEED_TARGET, value=gate)
    workspace = Workspace()
    try:
        got, probed = pipeline.speed_probe(spec, path, ["int8", "uint8"], workspace,
                                           (DEFAULT, DEFAULT), False, gates.absolute(spec, "served"))
        assert (got is not None) == decided
        if decided:
            assert got.recipe is None and not got.passed and "can meet the speed gate" in got.reason
            assert got.speed["int8_speedup"] < gate and got.form == "int8/uint8"
        else:  # the start that cleared the gate, and its timings, for the search
            assert probed.cleared is not None and set(probed.ceiling) >= {"speedup_hi_batch8"}
            assert probed.quick[context.key(probed.cleared)] > gate
        assert workspace.prepared and not workspace.ranges and not workspace.stats  # graphs shared, ranges not
    finally:
        workspace.close()


@pytest.mark.parametrize("cpu_class, rejected", [("avx2", True), ("vnni", False)])
def test_the_speed_probe_rejects_what_the_exact_path_cannot_open_off_vnni(tiny, monkeypatch, cpu_class, rejected):
    """Off VNNI every served session takes onnxruntime's exact int8 path; a start that path cannot open (an AVX2
    EPYC's s8-to-u8 weight rewrite adding an initializer twice crashed CI's build in the probe's timing) is rejected
    by the probe as the search rejects it, and nothing is timed from it. With VNNI the plain path serves."""
    from tritonkit import envinfo
    from tritonkit.errors import QuantizationError
    from tritonkit.int8 import builder

    path, _ = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = replace(spec.SPEED_TARGET, value=100.0)  # no start clears it: every one is probed
    monkeypatch.setenv(envinfo.CLASS_ENV, cpu_class)

    def refuse(model):
        raise QuantizationError("onnxruntime's exact int8 path cannot open this graph: refused by the test")

    monkeypatch.setattr(builder, "_opens_exactly", refuse)
    lines: list[str] = []
    monkeypatch.setattr(pipeline, "_log", lines.append)
    workspace = Workspace()
    try:
        got, probed = pipeline.speed_probe(spec, path, ["int8", "uint8"], workspace,
                                           (DEFAULT, DEFAULT), False, gates.absolute(spec, "served"))
    finally:
        workspace.close()
    refused = [line for line in lines if "probe" in line and "rejected" in line]
    assert (len(refused) == 4) is rejected and (not refused) is not rejected, lines
    assert (got is None and not probed.quick) is rejected, lines  # nothing timed, nothing decided


def test_the_search_does_not_time_again_what_the_speed_probe_timed(tiny, monkeypatch):
    """Where the start the probe cleared is the search's fastest, its ceiling at every served batch size comes from
    the probe, as does each start's quick timing the probe made (another graph of the same ops): not timed again."""
    path, _ = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = replace(spec.SPEED_TARGET, value=0.01)
    spec.SEARCH_PRIOR = {"form": "int8", "placement": "inputs"}
    workspace = Workspace()
    try:
        _, probed = pipeline.speed_probe(spec, path, ["int8"], workspace, (DEFAULT, DEFAULT), False,
                                         gates.absolute(spec, "served"))
        timed = []
        real = timing.speedup

        def counted(*a, **k):
            return timed.append(tuple(a[3])) or real(*a, **k)

        # The search's own timings (a start's quick one, the ceiling, a candidate's); a wall's is the fallback's.
        monkeypatch.setattr(context, "speedup", counted)
        monkeypatch.setattr(timing, "speedup", counted)
        real_prefix_speed = timing.prefix_speed

        def prefix_speed(ctx, r, batch):
            with monkeypatch.context() as m:
                m.setattr(timing, "speedup", real)
                return real_prefix_speed(ctx, r, batch)

        monkeypatch.setattr(timing, "prefix_speed", prefix_speed)

        def run(**kw):
            timed.clear()
            lines: list[str] = []
            search.run(search.SearchContext(spec, path, ["int8"], check_speed=True, progress=False, log=lines.append,
                                            workspace=workspace, **kw))
            return list(timed), lines

        alone, _ = run()
        # The other start as if the probe had timed it too, slower (the probe stops at the first that clears):
        # the cleared one is then the fastest whatever this machine's noise.
        other = context.key(search.Recipe(form="int8", placement="all"))
        inputs = probed.quick[context.key(probed.cleared)]
        after, lines = run(probed=replace(probed, quick={**probed.quick, other: inputs / 2}))
    finally:
        workspace.close()
    assert probed.cleared == search.Recipe(form="int8", placement="inputs")
    assert any("in the speed probe: not timed again" in line for line in lines), "\n".join(lines)
    assert len(after) == len(alone) - 3, (alone, after)  # both starts' quick timings and the ceiling


@pytest.mark.parametrize("gate, probed", [(100.0, 4), (0.01, 1)])
def test_the_speed_probe_ends_at_the_first_start_that_clears_the_gate_everywhere(tiny, gate, probed):
    """A start over the gate at every served batch size ends the probe (the others cannot make a ceiling of it);
    under a gate no start clears, every start is probed and the fastest decides."""
    path, _ = tiny
    spec = TinySpec()
    spec.SPEED_TARGET = replace(spec.SPEED_TARGET, value=gate)
    spec.SEARCH_PRIOR = {"form": "uint8", "placement": "all"}  # the last start in the listed order
    lines: list[str] = []
    workspace = Workspace()
    try:
        s = search.SearchContext(FewCalibrationBatches(spec), path, ["int8", "uint8"], check_speed=True,
                                 progress=False, log=lines.append, workspace=workspace.graphs_only())
        got = timing.speed_probe(s)
    finally:
        workspace.close()
    assert (got is None) == (gate < 1.0)
    assert sum("speed x" in line for line in lines) == probed, lines
    assert "uint8-all" in next(line for line in lines if "speed x" in line)  # the prior's start first
    assert sum("speed ceiling" in line for line in lines) == 1, lines


def test_a_recipe_confirmed_on_the_whole_split_is_not_evaluated_again(tiny, monkeypatch):
    """A trim that puts every float node back ends at the recipe its fallback confirmed: the same graph, whose
    validation metrics the search already holds (tests/int8/test_pipeline.py counts this over a real build)."""
    path, _ = tiny
    calls = []
    metrics = evaluate.Evaluator.metrics

    def counted(self, model, exact=False):
        calls.append(len(self.batches))
        return metrics(self, model, exact)

    monkeypatch.setattr(evaluate.Evaluator, "metrics", counted)
    ctx = search.SearchContext(TinySpec(), path, ["int8"], check_speed=False, progress=False, log=lambda _m: None)
    r = search.Recipe(form="int8", placement="inputs")
    first = ctx.measure("confirm", "once", r)
    again = ctx.measure("confirm", "again", search.Recipe(form="int8", placement="inputs", float_nodes=[]))
    assert len(calls) == 1 and first.metrics == again.metrics
