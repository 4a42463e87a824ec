"""Image preprocessor for the `image_classification` ensemble (Python backend over tritonkit.serving.imaging).

All images of all requests in one execute() are decoded into one FP32 batch; each request gets its rows back.
A request with a corrupt, truncated, non-image or oversized image fails alone, with an error naming the
element and the limit (status INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT); the other requests of the batch are
served.
"""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

from tritonkit.serving import imaging
from tritonkit.serving.backend_utils import error_response, param


def _floats(text: str) -> tuple[float, float, float]:
    values = tuple(float(v) for v in text.split(","))
    if len(values) != 3:
        raise ValueError(f"expected three comma-separated values, got {text!r}")
    return values


def _bad_request(message: str):
    return error_response(pb_utils, message)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        dims = pb_utils.get_output_config_by_name(config, "PIXELS")["dims"]
        self.cfg = imaging.PreprocessConfig(
            crop=int(dims[-1]),
            resize=int(param(config, "resize", "256")),
            # The model's normalisation, per channel: (pixel - mean) / std.
            mean=_floats(param(config, "mean", "127,127,127")),
            std=_floats(param(config, "std", "128,128,128")),
            max_pixels=int(param(config, "max_pixels", "40000000")),
            max_bytes=int(param(config, "max_bytes", str(32 * 1024 * 1024))),
            field="IMAGE",
        )

    def execute(self, requests):
        images: list[bytes] = []
        owners: list[int] = []
        responses = [None] * len(requests)
        for r, request in enumerate(requests):
            items = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
            images.extend(bytes(x) if not isinstance(x, bytes) else x for x in items)
            owners.extend([r] * len(items))
        pixels, errors = imaging.preprocess(images, self.cfg)
        owners_arr = np.asarray(owners)
        for r in range(len(requests)):
            rows = np.flatnonzero(owners_arr == r)
            bad = [errors[i] for i in rows if errors[i] is not None]
            if bad:
                # Element index within the request, not within the execute() batch.
                first = int(np.flatnonzero([errors[i] is not None for i in rows])[0])
                msg = str(bad[0]).split(": ", 1)[-1]
                more = f" (+{len(bad) - 1} more bad images)" if len(bad) > 1 else ""
                responses[r] = _bad_request(f"image_preprocess: IMAGE[{first}]: {msg}{more}")
                continue
            # A request's images are consecutive rows: a view, not a copy (pb_utils.Tensor copies into shared memory).
            span = pixels[rows[0]:rows[-1] + 1] if len(rows) else pixels[:0]
            responses[r] = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PIXELS", span)])
        return responses
