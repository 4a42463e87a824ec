"""Replays without calibration (tritonkit.int8.params): the parameters a calibration produced rebuild the same INT8
graph bytes with no calibration data, for every transform that reads data (SmoothQuant, GPTQ, bias correction)
and every calibration method; they apply only to the FP32 graph and recipe they were computed for."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tritonkit.int8.builder import quantize_with_params
from tritonkit.int8.params import QuantParams, file_digest
from tritonkit.int8.settings import QuantRecipe


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1)
        self.dw = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        x = torch.nn.functional.relu6(self.stem(x))
        x = torch.nn.functional.relu6(self.dw(x))
        return self.fc(x.mean((2, 3)))


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(self.norm(x))))


CASES = {
    "conv": (Conv, (8, 3, 24, 24), QuantRecipe("conv", calibrate_method="percentile", activation_type="uint8",
                                               weight_rounding="gptq", bias_correction=True,
                                               extra_options={"CalibPercentile": 99.99})),
    "conv-entropy": (Conv, (8, 3, 24, 24), QuantRecipe("conv", calibrate_method="entropy", op_types=["Conv", "Gemm"],
                                                       quantize_outputs=False)),
    "encoder": (Encoder, (4, 12, 32), QuantRecipe("encoder", op_types=["MatMul"], smooth_alpha=0.5,
                                                  activation_type="uint8")),
}


def _batches(shape, seed=0):
    def make():
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((6, *shape)).astype(np.float32)
        x[..., 0] *= 8.0  # an outlier channel (SmoothQuant has something to move)
        return ({"x": b} for b in x)
    return make


def _no_data():
    raise AssertionError("a replay from parameters read calibration data")


@pytest.mark.parametrize("case", CASES)
def test_a_replay_from_parameters_builds_the_same_bytes_without_calibration_data(case, tmp_path):
    module, shape, recipe = CASES[case]
    torch.manual_seed(0)
    fp32 = tmp_path / "fp32.onnx"
    torch.onnx.export(module().eval(), (torch.zeros(*shape),), str(fp32), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "n"}}, opset_version=17, dynamo=False)
    fresh = quantize_with_params(fp32, tmp_path / "fresh.onnx", recipe, _batches(shape), progress=False,
                                 recipe_digest="r1")
    assert fresh.ranges and (fresh.smooth or recipe.smooth_alpha is None)
    assert bool(fresh.rounding) == (recipe.weight_rounding == "gptq")
    assert bool(fresh.biases) == recipe.bias_correction
    loaded = QuantParams.load(fresh.save(tmp_path / "params.npz"))
    assert loaded.applies(file_digest(fp32), "r1") == (True, "")
    quantize_with_params(fp32, tmp_path / "replayed.onnx", recipe, _no_data, progress=False, given=loaded,
                         recipe_digest="r1")
    assert (tmp_path / "replayed.onnx").read_bytes() == (tmp_path / "fresh.onnx").read_bytes()
    # Other calibration data gives another graph: the equality above is the parameters', not a constant output.
    quantize_with_params(fp32, tmp_path / "other.onnx", recipe, _batches(shape, seed=1), progress=False)
    assert (tmp_path / "other.onnx").read_bytes() != (tmp_path / "fresh.onnx").read_bytes()


def test_parameters_apply_only_to_their_graph_and_recipe(tmp_path):
    params = QuantParams(source="a" * 64, recipe="r1", method="minmax", origin="spec1")
    assert params.applies("a" * 64, "r1", "spec1") == (True, "")
    # Another export of the same spec and packages (last bits differ between CPUs): applied, and said so.
    applies, note = params.applies("b" * 64, "r1", "spec1")
    assert applies and "differs in its bytes" in note
    assert params.applies("b" * 64, "r1", "spec2")[0] is False
    assert params.applies("b" * 64, "r1")[0] is False
    applies, note = params.applies("a" * 64, "r2", "spec1")
    assert not applies and "recipe" in note


def test_every_committed_recipe_carries_parameters_computed_for_it():
    """A committed recipe without its parameters would recalibrate on every fresh clone (minutes), and parameters
    of an older recipe would be refused; either means a search result was committed without its file."""
    from tritonkit import kinds
    from tritonkit.int8 import recipe

    checked = 0
    for name in kinds.names():
        kind = kinds.get(name)
        data = recipe.read(kind) or recipe.RecipeFile()
        entries = [("tensorrt", data.tensorrt, None)] if data.tensorrt else []
        entries += [("served", e, cls) for cls, e in data.served.items()]
        for form, entry, cls in entries:
            if entry.recipe is None:
                continue
            path = recipe.params_path(kind, form, cls)
            assert path.exists(), f"{name} {form} {cls or ''}: no {path.name}"
            params = QuantParams.load(path)
            assert params.recipe == recipe.recipe_digest(entry.recipe), path.name
            assert params.ranges and params.method == entry.recipe["calibrate_method"]
            assert params.origin == recipe.params_origin(kind), f"{path.name} was made from another spec or packages"
            checked += 1
    assert checked >= 3
