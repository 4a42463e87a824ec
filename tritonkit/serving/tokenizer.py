"""Tokenizer for the `text_embedding` ensemble (Python backend, HF `tokenizers` via tritonkit.serving.textproc).

All texts of all requests handed to one execute() go through a single `encode_batch` (Rust, no GIL), then each
request gets its own ids/mask padded only to its own longest text. The encoder accepts them with
`allow_ragged_batch`, so a short request batched with a long one is not padded to the model's max length.

Per text it also returns `num_tokens` and `truncated` (text longer than `max_length` tokens was cut).
A request with an empty / whitespace-only / non-UTF-8 / over-`max_chars` text, or one that tokenizes to nothing
(only control, zero-width or other characters the normalizer drops), fails alone with an error naming the element
(status INVALID_ARG: HTTP 400 / gRPC INVALID_ARGUMENT); the other requests of the batch are served.
Validation and tokenization live in tritonkit/serving/textproc.py, shared with `text_embedding_fused`.

A config with two BYTES inputs tokenizes pairs (a reranker's query + document, a classifier's text + text_pair; an
`optional` second input may be left out); where it declares a `token_type_ids` output, the segment ids go there.
"""

from __future__ import annotations

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from tritonkit.serving import textproc
from tritonkit.serving.backend_utils import error_response


def _bad_request(message: str):
    return error_response(pb_utils, message)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.config = json.loads(args["model_config"])
        try:
            self.tok = textproc.TextTokenizer(self.config, Path(args["model_repository"]))
        except (LookupError, FileNotFoundError) as err:
            raise pb_utils.TritonModelException(f"tokenizer: {err}") from None
        self.segment_ids = any(o["name"] == "token_type_ids" for o in self.config.get("output", []))

    def execute(self, requests):
        responses = [None] * len(requests)
        arrays, pairs = self.tok.request_arrays(requests, pb_utils.get_input_tensor_by_name)
        for r, enc in enumerate(self.tok.encode_requests(arrays, pairs)):
            if isinstance(enc, textproc.BadText):
                responses[r] = _bad_request(f"tokenizer: {enc}")
                continue
            ids, mask = textproc.pad(enc.encodings)
            outputs = [pb_utils.Tensor("input_ids", ids), pb_utils.Tensor("attention_mask", mask)]
            if self.segment_ids:
                outputs.append(pb_utils.Tensor("token_type_ids", textproc.pad_types(enc.encodings)))
            responses[r] = pb_utils.InferenceResponse(
                output_tensors=[
                    *outputs,
                    pb_utils.Tensor("num_tokens", enc.lengths),
                    pb_utils.Tensor("truncated", enc.truncated),
                ]
            )
        return responses
