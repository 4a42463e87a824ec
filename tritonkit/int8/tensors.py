"""Primitives the graph transforms of tritonkit.int8.transforms and the GPTQ rounding of tritonkit.int8.rounding
share: reading a graph's intermediate tensors on calibration batches, and the symmetric int8 round trip of a weight."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

Feeds = Mapping[str, np.ndarray]


def probe_tensors(model, names: list[str], batches: Callable[[], Iterable[Feeds]], max_batches: int | None = None,
                  arena: bool = True) -> Iterator[dict[str, np.ndarray]]:
    """{name: value} of graph tensors `names` of `model` (a ModelProto, left unchanged) per calibration batch: the
    graph is run with those tensors added as outputs. `arena=False` keeps onnxruntime from holding the peak of a
    run that outputs many large activations."""
    import onnx
    import onnxruntime as ort
    from onnx import helper

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    existing = {o.name for o in probe.graph.output}
    for name in names:
        if name not in existing:
            probe.graph.output.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = arena
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del probe
    input_names = {i.name for i in session.get_inputs()}
    for i, feeds in enumerate(batches()):
        if max_batches is not None and i >= max_batches:
            break
        yield dict(zip(names, session.run(names, {k: v for k, v in feeds.items() if k in input_names})))


def fake_quant_weight(w: np.ndarray, per_channel: bool, bits: int = 8) -> np.ndarray:
    """Symmetric int8 round trip as onnxruntime quantizes weights: scale = max|w| / 127 (per output channel);
    `bits` other than 8 only for measuring how much precision a model needs."""
    qmax = 2 ** (bits - 1) - 1
    r = np.abs(w).reshape(w.shape[0], -1).max(1) if per_channel else np.abs(w).max(keepdims=True)
    scale = np.where(r > 0, r / qmax, 1.0).reshape([-1] + [1] * (w.ndim - 1))
    return np.clip(np.round(w / scale), -qmax, qmax) * scale
