"""Text → token ids for the Python-backend text models (`tokenizer`, `text_embedding_fused`), in one place.

Validation (per element, raising `BadText` with a message naming it), one `encode_batch` over all texts of an
execute(), the "no tokens" check and right-padding. Free of `triton_python_backend_utils`, so it imports (and is
testable) outside a stub; each model adds its own name to messages and wraps them in Triton errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tritonkit.errors import BadText
from tritonkit.paths import package_file
from tritonkit.serving.backend_utils import param


def resolve(ref: str, model_dir: Path) -> Path:
    """'package:relative/path' (an installed package's file) or a path relative to the model directory.

    Raises LookupError naming the package when it is not installed.
    """
    if ":" in ref:
        return package_file(ref)
    return Path(model_dir) / ref


@dataclass
class Encoded:
    """One request's texts, tokenized (`encodings` are `tokenizers.Encoding`s, unpadded)."""

    encodings: list

    @property
    def lengths(self) -> np.ndarray:
        """num_tokens per text, [n, 1] INT32 (after truncation, [CLS] and [SEP] included)."""
        return np.array([[len(e.ids)] for e in self.encodings], dtype=np.int32)

    @property
    def truncated(self) -> np.ndarray:
        """[n, 1] BOOL: the text was longer than max_length tokens and was cut."""
        return np.array([[bool(e.overflowing)] for e in self.encodings], dtype=bool)


def pad(encodings: Sequence, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) INT64 [n, longest] of tokenizers Encodings, right-padded with `pad_id` (the
    stubs pad with 0: padded slots are masked out of every text; the build pads with the spec's pad id)."""
    longest = max((len(e.ids) for e in encodings), default=0)
    ids = np.full((len(encodings), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(encodings), longest), dtype=np.int64)
    for row, enc in enumerate(encodings):
        ids[row, : len(enc.ids)] = enc.ids
        mask[row, : len(enc.ids)] = 1
    return ids, mask


class TextTokenizer:
    """The config-driven tokenizer: parameters `tokenizer_file`, `max_length`, `max_chars`."""

    def __init__(self, config: dict, model_dir: Path):
        from tokenizers import Tokenizer

        self.max_length = int(param(config, "max_length", "256"))
        path = resolve(param(config, "tokenizer_file", "tokenizer.json"), model_dir)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.tokenizer = Tokenizer.from_file(str(path))
        # tokenizer.json may carry fixed padding/truncation; ours are explicit.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_length)
        self.max_chars = int(param(config, "max_chars", "100000"))

    def texts(self, array: np.ndarray) -> list[str]:
        """The request's `text` elements as str; the first bad one raises BadText."""
        texts = []
        for i, item in enumerate(array.reshape(-1)):
            raw = item if isinstance(item, bytes) else str(item).encode()
            if len(raw) > self.max_chars:
                raise BadText(f"text[{i}] is {len(raw)} bytes; the limit is {self.max_chars} (parameter max_chars)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = f"byte {raw[err.start]:#04x} at offset {err.start}"
                raise BadText(f"text[{i}] is not valid UTF-8 ({bad})") from None
            if not text.strip():
                raise BadText(f"text[{i}] is empty or whitespace-only")
            texts.append(text)
        return texts

    def encode(self, per_request: Sequence[Sequence[str]]) -> list[Encoded | BadText]:
        """All requests' texts through ONE encode_batch (Rust, no GIL), split back per request.

        A request with a text that tokenizes to nothing gets a BadText instead of its Encoded.
        """
        flat = [t for texts in per_request for t in texts]
        encodings = self.tokenizer.encode_batch(flat) if flat else []
        out: list[Encoded | BadText] = []
        start = 0
        for texts in per_request:
            encs = encodings[start : start + len(texts)]
            start += len(texts)
            # [CLS] [SEP] only: nothing the model can embed (e.g. "\u200b" or control characters).
            empty = next((i for i, e in enumerate(encs) if not any(m == 0 for m in e.special_tokens_mask)), None)
            if empty is not None:
                out.append(BadText(
                    f"text[{empty}] has no tokens (only control, zero-width or other characters the tokenizer drops)"
                ))
            else:
                out.append(Encoded(list(encs)))
        return out

    def encode_requests(self, arrays: Sequence[np.ndarray]) -> list[Encoded | BadText]:
        """Each request's `text` tensor → its Encoded, or the BadText that fails that request alone; the valid
        requests' texts go through one encode_batch together."""
        out: list = [None] * len(arrays)
        valid: list[tuple[int, list[str]]] = []
        for r, array in enumerate(arrays):
            try:
                valid.append((r, self.texts(array)))
            except BadText as err:
                out[r] = err
        for (r, _), enc in zip(valid, self.encode([texts for _, texts in valid])):
            out[r] = enc
        return out
