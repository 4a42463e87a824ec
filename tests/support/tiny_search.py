"""The tiny model the INT8 search has never seen (three Linear layers, one outlier channel) and its spec: what the
search and floor tests measure."""

from __future__ import annotations

import numpy as np
import onnx

from tritonkit.kinds.gates import Target

WIDTH = 64


class TinySpec:
    """Three Linear layers (Gemm); layer 2 reads an activation with one huge outlier channel, so a single int8
    scale leaves its other 63 channels a handful of codes. Nothing tells the search which layer that is."""

    NAME = "tiny"
    WEIGHT_OPS = ("Gemm",)
    TARGETS = (Target("cosine_min", ">=", 0.999), Target("cosine_mean", ">=", 0.9995))
    SPEED_TARGET = Target("int8_speedup", ">=", 1.0)
    SPEED_BATCHES = (8,)
    SERVE_THREADS = 1

    def __init__(self):
        self.rng = np.random.default_rng(0)
        self.data = {split: self.rng.standard_normal((n, 16)).astype(np.float32)
                     for split, n in (("calibration", 256), ("validation", 256), ("test", 256))}

    def calibration_batches(self):
        x = self.data["calibration"]
        for i in range(0, len(x), 32):
            yield {"x": x[i : i + 32]}

    def calibration_batch_count(self) -> int:
        return len(self.data["calibration"]) // 32

    def eval_batches(self, split: str):
        x = self.data[split]
        return [{"x": x[i : i + 64]} for i in range(0, len(x), 64)]

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
        return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean())}

    def speed_feeds(self, batch: int):
        return {"x": self.data["validation"][:batch]}


def export_tiny(path) -> str:
    """Exports the tiny model; returns the name of the Gemm that reads the outlier activation."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH),
                                torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8))
    with torch.no_grad():
        # Channel 0 of layer 1's output x1000, undone in layer 2's weights: the float function is unchanged.
        model[0].weight[0] *= 1000.0
        model[0].bias[0] = abs(model[0].bias[0]) * 1000.0 + 1000.0
        model[2].weight[:, 0] /= 1000.0
    torch.onnx.export(model.eval(), (torch.zeros(4, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    gemms = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 3
    return gemms[1]


def export_cancelling(path) -> str:
    """Exports a model whose last layer must stay float and must compute in fp32: two hidden channels ride on
    +1000 and cancel in it (weights +w and -w). fp32 keeps their difference; bf16 rounds each to steps of 4, and
    one int8 scale over them leaves the other channels no codes. Returns the name of that last Gemm."""
    import torch

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 8))
    with torch.no_grad():
        model[0].bias[:2] += 1000.0
        model[2].weight[:, 1] = -model[2].weight[:, 0]
    torch.onnx.export(model.eval(), (torch.zeros(4, 16),), str(path), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    gemms = [n.name for n in onnx.load(str(path)).graph.node if n.op_type == "Gemm"]
    assert len(gemms) == 2
    return gemms[1]
