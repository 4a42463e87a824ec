"""`image_classification_fused`: the `image_classification` ensemble (image_preprocess → INT8 image_classifier) in
ONE Python-backend stub.

Same input, outputs and per-request errors as the ensemble, without the second stub and the FP32 pixel batch
(602 KB per image at 224 px) handed between the two through tritonserver: the images of all requests of one
execute() are decoded into one batch (tritonkit.serving.imaging, what image_preprocess runs), the classifier's
ONNX (parameter `onnx_model`, the INT8 `image_classifier`'s file, read in place) runs over it on the runtime the
build chose for that file (parameter `runtime`, tritonkit.serving.runtimes, threads as that runtime's backend
names them), and each request gets its rows back.

A request with a bad image fails alone (INVALID_ARG, the element named); the rest of the batch is served.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.errors import ConfigError
from tritonkit.serving import imaging
from tritonkit.serving.backend_utils import announce_precision, error_response, ort_metrics, param
from tritonkit.serving.image_preprocess import read_images
from tritonkit.serving.runtimes import open_runner

# Triton output -> the classifier ONNX's output (the ensemble's output_map).
OUTPUTS = {"PROBABILITIES": "probabilities", "LOGITS": "logits"}


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        self.name = config["name"]
        onnx_path = Path(args["model_repository"]) / param(config, "onnx_model", "../image_classifier/1/model.onnx")
        if not onnx_path.exists():
            raise pb_utils.TritonModelException(
                f"{self.name}: classifier model not found: {onnx_path} (built by `python -m tritonkit.build image`)")
        try:
            self.session = open_runner(param(config, "runtime", "onnxruntime"), onnx_path, config)
            self.cfg = imaging.config_from_parameters(config, int(param(config, "crop", "224")))
        except (ConfigError, ValueError) as err:
            raise pb_utils.TritonModelException(f"{self.name}: {err}") from None
        self.input = next(iter(self.session.input_names))
        pb_utils.Logger.log_info(f"{self.name}: {self.session.describe()}, decode + classify in one stub")
        self._precision_gauge = announce_precision(pb_utils, config, self.name, self.session.metadata)
        self._counters = ort_metrics(pb_utils, {"model": self.name, "version": str(args["model_version"])})
        for _ in range(int(param(config, "warmup_runs", "2"))):  # lazy kernel set-up before the first request
            self._classify(np.zeros((2, 3, self.cfg.crop, self.cfg.crop), np.float32))
            self._counters.add("warmup_runs", 1)

    def _classify(self, pixels: np.ndarray) -> list[np.ndarray]:
        return self.session.run(list(OUTPUTS.values()), {self.input: pixels}, len(pixels))[0]

    def execute(self, requests):
        images, counts = read_images(requests)
        pixels, errors = imaging.preprocess(images, self.cfg)
        spans = imaging.per_request(counts, errors)
        served = [s for s in spans if isinstance(s, slice)]
        responses = [error_response(pb_utils, f"{self.name}: {s}") if isinstance(s, str) else None for s in spans]
        if not served:
            return responses
        try:  # only the rows of requests that are answered; all of them in the usual case, without a copy
            batch = pixels if len(served) == len(spans) else np.concatenate([pixels[s] for s in served])
            results = self._classify(batch)
        except Exception as err:  # every request of the group gets the reason; the model stays up
            return [r or error_response(pb_utils, f"{self.name}: inference failed: {err}", client=False)
                    for r in responses]
        self._counters.add("session_runs", 1)
        self._counters.add("input_elements", batch.size)
        self._counters.add("batched_requests", len(served))
        start = 0
        for r, span in enumerate(spans):
            if responses[r] is None:
                rows = slice(start, start + span.stop - span.start)
                responses[r] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor(name, out[rows]) for name, out in zip(OUTPUTS, results, strict=True)])
                start = rows.stop
        return responses

    def finalize(self) -> None:
        self._counters.close()
        self.session = self._precision_gauge = None
