"""Tokenizer for the `text_embedding` ensemble (Python backend, HF `tokenizers`).

All texts of all requests handed to one execute() go through a single `encode_batch` (Rust, no GIL), then each
request gets its own ids/mask padded only to its own longest text. The encoder accepts them with
`allow_ragged_batch`, so a short request batched with a long one is not padded to the model's max length.

Per text it also returns `num_tokens` and `truncated` (text longer than `max_length` tokens was cut).
A request with an empty / whitespace-only / non-UTF-8 text fails alone with an error naming the element.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def _resolve(ref: str, model_dir: Path) -> Path:
    """'package:relative/path' (an installed package's file) or a path relative to the model directory."""
    if ":" in ref:
        package, rel = ref.split(":", 1)
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise pb_utils.TritonModelException(f"tokenizer: package '{package}' is not installed")
        return Path(next(iter(spec.submodule_search_locations))) / rel
    return model_dir / ref


class _BadText(ValueError):
    pass


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.config = json.loads(args["model_config"])
        model_dir = Path(args["model_repository"])
        self.max_length = int(_param(self.config, "max_length", "256"))
        path = _resolve(_param(self.config, "tokenizer_file", "tokenizer.json"), model_dir)
        if not path.exists():
            raise pb_utils.TritonModelException(f"tokenizer: tokenizer file not found: {path}")
        self.tokenizer = Tokenizer.from_file(str(path))
        # tokenizer.json may carry fixed padding/truncation; ours are explicit.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_length)
        self.max_chars = int(_param(self.config, "max_chars", "100000"))

    def _texts(self, request) -> list[str]:
        tensor = pb_utils.get_input_tensor_by_name(request, "text")
        array = tensor.as_numpy().reshape(-1)
        texts = []
        for i, item in enumerate(array):
            raw = item if isinstance(item, bytes) else str(item).encode()
            if len(raw) > self.max_chars:
                raise _BadText(f"text[{i}] is {len(raw)} bytes; the limit is {self.max_chars} (parameter max_chars)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = f"byte {raw[err.start]:#04x} at offset {err.start}"
                raise _BadText(f"text[{i}] is not valid UTF-8 ({bad})") from None
            if not text.strip():
                raise _BadText(f"text[{i}] is empty or whitespace-only")
            texts.append(text)
        return texts

    def execute(self, requests):
        responses = [None] * len(requests)
        batches: list[tuple[int, list[str]]] = []
        for r, request in enumerate(requests):
            try:
                batches.append((r, self._texts(request)))
            except _BadText as err:
                responses[r] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"tokenizer: {err}"))
        encodings = self.tokenizer.encode_batch([t for _, texts in batches for t in texts]) if batches else []
        start = 0
        for r, texts in batches:
            encs = encodings[start : start + len(texts)]
            start += len(texts)
            longest = max(len(e.ids) for e in encs)
            ids = np.zeros((len(encs), longest), dtype=np.int64)
            mask = np.zeros((len(encs), longest), dtype=np.int64)
            for row, enc in enumerate(encs):
                ids[row, : len(enc.ids)] = enc.ids
                mask[row, : len(enc.ids)] = 1
            lengths = np.array([[len(e.ids)] for e in encs], dtype=np.int32)
            truncated = np.array([[bool(e.overflowing)] for e in encs], dtype=bool)
            responses[r] = pb_utils.InferenceResponse(
                output_tensors=[
                    pb_utils.Tensor("input_ids", ids),
                    pb_utils.Tensor("attention_mask", mask),
                    pb_utils.Tensor("num_tokens", lengths),
                    pb_utils.Tensor("truncated", truncated),
                ]
            )
        return responses
