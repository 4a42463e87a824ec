"""Text → token ids for the Python-backend text models (`tokenizer`, `text_embedding_fused`), in one place.

Validation (per element, raising `BadText` with a message naming it), one `encode_batch` over all texts of an
execute(), the "no tokens" check and right-padding. Free of `triton_python_backend_utils`, so it imports (and is
testable) outside a stub; each model adds its own name to messages and wraps them in Triton errors.

A model whose config declares two BYTES inputs takes text pairs: the first input's element i and the second's,
tokenized as one sequence pair (segment ids 0 then 1), truncated as parameter `truncation` says (`only_second`: the
second text only; default `longest_first`). A second input marked `optional` may be left out of a request.
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
        """[n, 1] BOOL: the text (or pair) was longer than max_length tokens and was cut."""
        return np.array([[bool(e.overflowing)] for e in self.encodings], dtype=bool)


def pad_types(encodings: Sequence) -> np.ndarray:
    """token_type_ids INT64 [n, longest] (0: first text, 1: second), right-padded with 0, as `pad` lays out ids."""
    longest = max((len(e.ids) for e in encodings), default=0)
    types = np.zeros((len(encodings), longest), dtype=np.int64)
    for row, enc in enumerate(encodings):
        types[row, : len(enc.type_ids)] = enc.type_ids
    return types


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


TRUNCATIONS = ("longest_first", "only_second")


class TextTokenizer:
    """The config-driven tokenizer: parameters `tokenizer_file`, `max_length`, `max_chars`, `truncation`; its
    text inputs are the config's BYTES inputs (one: texts; two: pairs), `text` where the config names none."""

    def __init__(self, config: dict, model_dir: Path):
        from tokenizers import Tokenizer

        self.max_length = int(param(config, "max_length", "256"))
        path = resolve(param(config, "tokenizer_file", "tokenizer.json"), model_dir)
        if not path.exists():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.truncation = param(config, "truncation", "longest_first")
        if self.truncation not in TRUNCATIONS:
            raise LookupError(f"parameter truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        # tokenizer.json may carry fixed padding/truncation; ours are explicit.
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_length=self.max_length, strategy=self.truncation)
        self.max_chars = int(param(config, "max_chars", "100000"))
        inputs = [i for i in config.get("input", []) if i.get("data_type") in ("TYPE_STRING", "STRING")]
        self.fields = tuple(i["name"] for i in inputs[:2]) or ("text",)
        self.names = (*self.fields, "text_pair")[:2]  # the first and second texts' names in messages
        self.pair_optional = len(inputs) > 1 and bool(inputs[1].get("optional", False))

    def texts(self, array: np.ndarray, field: str = "text") -> list[str]:
        """The request's `field` elements as str; the first bad one raises BadText."""
        texts = []
        for i, item in enumerate(array.reshape(-1)):
            raw = item if isinstance(item, bytes) else str(item).encode()
            if len(raw) > self.max_chars:
                raise BadText(f"{field}[{i}] is {len(raw)} bytes; the limit is {self.max_chars} (parameter "
                              "max_chars)")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                bad = f"byte {raw[err.start]:#04x} at offset {err.start}"
                raise BadText(f"{field}[{i}] is not valid UTF-8 ({bad})") from None
            if not text.strip():
                raise BadText(f"{field}[{i}] is empty or whitespace-only")
            texts.append(text)
        return texts

    def _problem(self, items: Sequence, encs: Sequence) -> BadText | None:
        """What makes a request's encodings unusable: a text with no tokens, or a first text that leaves the second
        no room within max_length."""
        first, second = self.names
        for i, (item, e) in enumerate(zip(items, encs)):
            seqs = {s for s in e.sequence_ids if s is not None}
            want = (0, 1) if isinstance(item, tuple) else (0,)
            for s in want:
                if s in seqs:
                    continue
                if s == 1 and e.overflowing:
                    return BadText(f"{first}[{i}] leaves no room for {second}[{i}] within max_length "
                                   f"{self.max_length} tokens")
                # [CLS] [SEP] only: nothing the model can embed (e.g. "\u200b" or control characters).
                return BadText(f"{(first, second)[s]}[{i}] has no tokens (only control, zero-width or other "
                               "characters the tokenizer drops)")
        return None

    def _untruncated(self):
        """A copy of the tokenizer without truncation, which counts a text's whole length (only_second raises on a
        single text)."""
        from tokenizers import Tokenizer

        if getattr(self, "_plain", None) is None:
            self._plain = Tokenizer.from_str(self.tokenizer.to_str())
            self._plain.no_truncation()
        return self._plain

    def _encode_one(self, items: Sequence):
        """One request's items alone (a batch that failed as a whole: find which request it was)."""
        try:
            return self.tokenizer.encode_batch(list(items)) if items else []
        except Exception:  # tokenizers' truncation error: the first text alone is past max_length
            plain = self._untruncated()
            lengths = [len(plain.encode(t[0]).ids) if isinstance(t, tuple) else 0 for t in items]
            i = int(np.argmax(lengths))
            first, second = self.names
            return BadText(f"{first}[{i}] is {lengths[i]} tokens; truncation {self.truncation} cuts only "
                           f"{second}, so {first} must leave room for it within max_length {self.max_length}")

    def encode(self, per_request: Sequence[Sequence[str | tuple[str, str]]]) -> list[Encoded | BadText]:
        """All requests' texts (or (first, second) pairs) through ONE encode_batch (Rust, no GIL), split back per
        request.

        A request with a text that tokenizes to nothing gets a BadText instead of its Encoded.
        """
        flat = [t for texts in per_request for t in texts]
        try:
            encodings = self.tokenizer.encode_batch(flat) if flat else []
        except Exception:  # only_second and a first text past max_length: that request fails alone
            encodings = None
        out: list[Encoded | BadText] = []
        start = 0
        for texts in per_request:
            encs = encodings[start : start + len(texts)] if encodings is not None else self._encode_one(texts)
            start += len(texts)
            problem = encs if isinstance(encs, BadText) else self._problem(texts, encs)
            out.append(problem if problem is not None else Encoded(list(encs)))
        return out

    def request_arrays(self, requests: Sequence, get_tensor) -> tuple[list[np.ndarray], list | None]:
        """Each request's first text tensor and, for a pair model, its second (None where an optional one is left
        out), read with `get_tensor(request, name)` (pb_utils.get_input_tensor_by_name)."""
        arrays = [get_tensor(request, self.fields[0]).as_numpy() for request in requests]
        if len(self.fields) < 2:
            return arrays, None
        tensors = [get_tensor(request, self.fields[1]) for request in requests]
        return arrays, [None if t is None else t.as_numpy() for t in tensors]

    def encode_requests(self, arrays: Sequence[np.ndarray],
                        pairs: Sequence[np.ndarray | None] | None = None) -> list[Encoded | BadText]:
        """Each request's text tensor (and its second text's, `pairs[r]`, None where absent) → its Encoded, or the
        BadText that fails that request alone; the valid requests' texts go through one encode_batch together."""
        out: list = [None] * len(arrays)
        valid: list[tuple[int, list]] = []
        for r, array in enumerate(arrays):
            try:
                texts = self.texts(array, self.fields[0])
                second = None if pairs is None else pairs[r]
                if second is not None:
                    others = self.texts(second, self.fields[1])
                    if len(others) != len(texts):
                        raise BadText(f"{self.fields[1]} has {len(others)} elements; {self.fields[0]} has "
                                      f"{len(texts)}")
                    texts = list(zip(texts, others))
                valid.append((r, texts))
            except BadText as err:
                out[r] = err
        for (r, _), enc in zip(valid, self.encode([texts for _, texts in valid])):
            out[r] = enc
        return out
