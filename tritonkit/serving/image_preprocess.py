"""Image preprocessor for the `image_classification` ensemble (Python backend over tritonkit.serving.imaging).

All images of all requests in one execute() are decoded into one FP32 batch; each request gets its rows back.
A request with a corrupt, truncated, non-image or oversized image fails alone, with an error naming the
element and the limit (status INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT); the other requests of the batch are
served.
"""

from __future__ import annotations

import json

import triton_python_backend_utils as pb_utils

from tritonkit.serving import imaging
from tritonkit.serving.backend_utils import error_response


def read_images(requests) -> tuple[list[bytes], list[int]]:
    """Every request's encoded images, in order, and how many each request sent."""
    images: list[bytes] = []
    counts: list[int] = []
    for request in requests:
        items = pb_utils.get_input_tensor_by_name(request, "IMAGE").as_numpy().reshape(-1)
        images.extend(bytes(x) if not isinstance(x, bytes) else x for x in items)
        counts.append(len(items))
    return images, counts


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        dims = pb_utils.get_output_config_by_name(config, "PIXELS")["dims"]
        self.cfg = imaging.config_from_parameters(config, int(dims[-1]))

    def execute(self, requests):
        images, counts = read_images(requests)
        pixels, errors = imaging.preprocess(images, self.cfg)
        responses = []
        for rows in imaging.per_request(counts, errors):
            if isinstance(rows, str):
                responses.append(error_response(pb_utils, f"image_preprocess: {rows}"))
            else:  # a view of the batch: pb_utils.Tensor copies it into shared memory once
                responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("PIXELS", pixels[rows])]))
        return responses
