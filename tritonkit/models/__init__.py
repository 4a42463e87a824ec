"""Registry of model specs: build target name → module path.

A spec module provides NAME, EXPORT (tritonkit.export.ExportSpec), FP32_MODEL / INT8_MODEL (Triton model
names the artefacts go to), RECIPE and CANDIDATES (tritonkit.quantize.QuantRecipe), TARGETS, and
calibration_batches() / calibration_batch_count() / evaluate(fp32_path, int8_path) -> metrics. Optional:
SERVE_RECIPE (+ SERVE_CANDIDATES, TRT_TARGETS): the INT8 form served on CPU when it differs from RECIPE, the
TensorRT form (see tritonkit.build).
Modules are imported lazily so `python -m tritonkit.build text` never imports the image stack.
"""

from __future__ import annotations

import importlib
from types import ModuleType

REGISTRY: dict[str, str] = {
    "text": "tritonkit.models.minilm",
    "image": "tritonkit.models.efficientnet_lite0",
}


def get(name: str) -> ModuleType:
    if name not in REGISTRY:
        raise KeyError(f"unknown model '{name}' (registered: {', '.join(REGISTRY)})")
    return importlib.import_module(REGISTRY[name])
