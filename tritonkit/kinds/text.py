"""text-embedding: a sentence-transformers encoder served as tokenizer → encoder (→ pooled embedding).

The exported graph is the whole sentence-transformers pipeline after tokenization: the transformer, the pooling
its directory declares (mean, CLS, max or mean/sqrt(len) over the attention mask) and L2 normalisation when the
directory has a Normalize module, so the server returns final embeddings. Architectures differ only in how the
transformer is called (tritonkit.kinds.architectures); the tokenizer is the directory's own tokenizer.json.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import ClassVar

import numpy as np

from tritonkit import data
from tritonkit.export import ExportSample, ExportSpec, row_metric
from tritonkit.kinds import architectures
from tritonkit.kinds.base import TransformerKind
from tritonkit.kinds.gates import Target
from tritonkit.serving.textproc import pad

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

INPUTS = ("input_ids", "attention_mask")
OUTPUT = "embedding"
# Export check: every grid point's batch sizes × sequence lengths, texts long enough to hit truncation.
VALIDATION_BATCHES = (1, 8, 33, 64)
VALIDATION_LENGTHS = (8, 32, 64, 128, 256)
CALIBRATION_TEXTS = 512
CALIBRATION_BATCH = 16  # texts per calibration run for an encoder of CALIBRATION_SIZE (MiniLM-L6: 6 layers x 384)
CALIBRATION_SIZE = 6 * 384
EVAL_BATCH = 32
PACKED_CHECK_TEXTS = 96  # mixed-length validation texts a packed float graph must reproduce
PACKED_BATCH = 16  # texts per packed run when an INT8 packed graph is proven: a served dynamic batch at c=16
# Gates (a spec's [gates] may only tighten them): on the held-out corpus, FP32 as the reference.
DEFAULT_GATES = {"cosine_min": 0.99, "cosine_mean": 0.996, "top10_overlap": 0.93, "int8_speedup": 1.0}


def long_text(sentences: Sequence[str], i: int, min_words: int) -> str:
    """Join consecutive real sentences until the text is long enough to reach (and pass) the length limit."""
    parts, j = [], i
    while sum(len(p.split()) for p in parts) < min_words:
        parts.append(sentences[j % len(sentences)])
        j += 1
    return " ".join(parts)


def with_long_texts(sentences: Sequence[str], every: int = 10, words: int = 200) -> list[str]:
    """Every `every`-th text becomes several consecutive sentences joined (>= `words` words, past the length
    limit), so calibration covers the long texts the server truncates."""
    return [long_text(sentences, i, words) if i % every == every - 1 else s for i, s in enumerate(sentences)]


def validation_texts(point: dict[str, int]) -> list[str]:
    sentences = data.split("validation")
    texts = []
    for row in range(point["batch"]):
        i = point["start"] + row
        # Every other row is long enough to hit the truncation limit, so padding and truncation are both checked.
        texts.append(long_text(sentences, i, point["seq"]) if row % 2 and point["seq"] >= 32 else sentences[i])
    return texts


class TextEmbedding(TransformerKind):
    WEIGHT_OPS = ("MatMul",)
    # What the INT8 search tries first (tritonkit.int8.search.SearchSpec): MiniLM's winning knobs, served and
    # TensorRT forms alike (models/text_embedding.int8.json), so a budget that ends early has tried them.
    SEARCH_PRIOR: ClassVar[dict] = {"form": "uint8", "placement": "inputs", "smooth_alpha": 0.8,
                                    "calibrate_method": "minmax"}
    # Float nodes tried as one candidate before the scan: every FFN output projection (its input is GELU's, with
    # outliers) and attention's activation-by-activation MatMuls, what MiniLM's (both forms) and MPNet's searches
    # kept float most (models/*.int8.json). A family name, or a regular expression over node names.
    SEARCH_PRIOR_FLOAT: ClassVar[tuple[str, ...]] = ("family:activation-matmul", r"layer\.\d+/output/dense/MatMul$")
    SERVE_THREADS = 1
    SPEED_BATCHES = (1, 8, 32)
    DATA_FILES = (data.EVAL_CORPUS,)
    DEFAULT_GATES = DEFAULT_GATES
    # How far under its bf16/fp16 floor INT8 may fall where the floor is below a gate (tritonkit.int8.floor): a narrow
    # embedding cone reorders neighbours at any reduced precision, so top-10 overlap gets the most room.
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"cosine_min": 0.005, "cosine_mean": 0.001, "top10_overlap": 0.03}
    # Never looser, whatever the floor: an embedding this far off is a different model.
    CATASTROPHE: ClassVar[tuple[Target, ...]] = (Target("cosine_min", ">=", 0.98), Target("cosine_mean", ">=", 0.995))
    INPUTS = INPUTS
    OUTPUT = OUTPUT

    def __init__(self, spec):
        super().__init__(spec)
        self.MAX_LENGTH = spec.facts.max_length
        self.DIM = spec.facts.dim
        self.SERVE_THREADS = spec.serving.model_threads

    @property
    def TARGETS(self) -> list[Target]:
        return [Target(m, ">=", self.gate(m)) for m in ("cosine_min", "cosine_mean", "top10_overlap")]

    # -- source ------------------------------------------------------------------------------------------

    def load_tokenizer(self, max_length: int | None = None, path: Path | None = None):
        """HF `tokenizers` with truncation at max_length and no padding (tokenizer.json may ship fixed padding)."""
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path or self.tokenizer_file()))
        tok.no_padding()
        tok.enable_truncation(max_length=max_length or self.MAX_LENGTH)
        return tok

    @cache  # noqa: B019 - one tokenizer per (kind object, length); kinds live for the process
    def _tokenizer(self, max_length: int):
        return self.load_tokenizer(max_length)

    def encode(self, texts: Sequence[str], max_length: int | None = None) -> dict[str, np.ndarray]:
        ids, mask = pad(self._tokenizer(max_length or self.MAX_LENGTH).encode_batch(list(texts)),
                        self.spec.facts.pad_id)
        return {"input_ids": ids, "attention_mask": mask}

    def sentence_transformer(self, max_length: int | None = None):
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(self.model_dir()), device="cpu")
        model.max_seq_length = max_length or self.MAX_LENGTH
        return model

    def load_encoder(self):
        """Transformer + the directory's pooling (+ L2 norm) as one torch module (eager attention)."""
        return architectures.pooled_encoder(self.model_dir(), self.architecture, self.spec.facts.pooling,
                                            self.spec.facts.normalize)

    # -- export ------------------------------------------------------------------------------------------

    def _grid(self) -> list[dict[str, int]]:
        grid, start = [], 0
        for seq in (s for s in VALIDATION_LENGTHS if s < self.MAX_LENGTH):
            for batch in VALIDATION_BATCHES:
                grid.append({"batch": batch, "seq": seq, "start": start})
                start += batch
        for batch in VALIDATION_BATCHES:  # the longest: what the server sends for long texts
            grid.append({"batch": batch, "seq": self.MAX_LENGTH, "start": start})
            start += batch
        return grid

    def _sample(self, point) -> ExportSample:
        texts = validation_texts(point)
        return ExportSample(feeds=self.encode(texts, point["seq"]), labels=texts, context=point)

    @cache  # noqa: B019
    def _st(self, max_length: int):
        return self.sentence_transformer(max_length)

    def _reference(self, sample: ExportSample) -> np.ndarray:
        """sentence-transformers' own encode on the raw texts: checks tokenization, pooling and normalisation."""
        model = self._st(sample.context["seq"])
        return model.encode(sample.labels, batch_size=64, convert_to_numpy=True, normalize_embeddings=False)

    @cached_property
    def EXPORT(self) -> ExportSpec:
        return ExportSpec(
            name=self.spec.name,
            loader=self.load_encoder,
            inputs={"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}},
            outputs={OUTPUT: {0: "batch"}},
            sample_inputs=self._sample,
            validation_grid=self._grid(),
            opset=17,
            metric="cosine",
            tolerance=0.9999,
            reference=self._reference,
        )

    # -- INT8 data and metrics ---------------------------------------------------------------------------

    def calibration_texts(self) -> list[str]:
        return with_long_texts(data.split("calibration")[:CALIBRATION_TEXTS])

    @cached_property
    def calibration_batch(self) -> int:
        """Calibration runs the graph unoptimised with every activation alive until its min/max is taken, so its
        memory grows with layers x width x batch: larger encoders calibrate in proportionally smaller batches."""
        config = json.loads((self.model_dir() / "config.json").read_text())
        size = int(config.get("num_hidden_layers", 6)) * int(config.get("hidden_size", 384))
        return max(2, min(CALIBRATION_BATCH, CALIBRATION_BATCH * CALIBRATION_SIZE // size))

    def calibration_batches(self, texts: Sequence[str] | None = None,
                            batch_size: int | None = None) -> Iterable[dict]:
        texts, batch_size = list(texts or self.calibration_texts()), batch_size or self.calibration_batch
        for start in range(0, len(texts), batch_size):
            yield self.encode(texts[start : start + batch_size])

    def calibration_batch_count(self) -> int:
        return -(-CALIBRATION_TEXTS // self.calibration_batch)

    def eval_batches(self, split: str) -> list[dict[str, np.ndarray]]:
        """Held-out texts of a split, length-sorted into padded batches (rows come back in that order)."""
        texts = sorted(data.eval_texts(split), key=len)
        return [self.encode(texts[i : i + EVAL_BATCH]) for i in range(0, len(texts), EVAL_BATCH)]

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray, k: int = 10) -> dict[str, float]:
        """Cosine per text and top-k neighbour overlap (every text a query over the whole split)."""
        cos = row_metric("cosine", got, ref)
        overlap = neighbour_overlap(ref, got, k)
        return {
            "cosine_min": float(cos.min()),
            "cosine_p1": float(np.percentile(cos, 1)),
            "cosine_mean": float(cos.mean()),
            f"top{k}_overlap": float(overlap.mean()),
            f"top{k}_overlap_min": float(overlap.min()),
            "texts": float(len(cos)),
        }

    @property
    def FP32_RUNTIME_CHECK(self) -> Target:
        return Target("cosine_min", ">=", self.EXPORT.tolerance)  # as the export validates the file

    def timing_feeds(self, batch: int, mixes: int) -> list[dict[str, np.ndarray]]:
        """`mixes` batches of `batch` random benchmark texts (fixed seed): served lengths vary by request."""
        texts = data.split("benchmark")
        rng = np.random.default_rng(batch)
        return [self.encode([texts[int(j)] for j in rng.choice(len(texts), batch, replace=False)])
                for _ in range(mixes)]

    def speed_feeds(self, batch: int) -> dict[str, np.ndarray]:
        """`batch` mixed-length real texts, padded to the longest as served."""
        return self.encode(data.split("benchmark")[:batch])

    def embed_onnx(self, sess, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Embeddings in the input order; texts are length-sorted into batches so padding stays small."""
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.zeros((len(texts), self.DIM), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            out[idx] = sess.run([OUTPUT], self.encode([texts[i] for i in idx]))[0]
        return out

    # -- packed batches ---------------------------------------------------------------------------------

    @property
    def packable(self) -> bool:
        from tritonkit.serving import packing

        return self.spec.facts.pooling in packing.POOLINGS

    def write_packed(self, model_path: Path, fp32: Path | None = None,
                     judge: Callable[[dict[str, float]], list[str]] | None = None,
                     reference: np.ndarray | None = None) -> Path:
        """model.packed.onnx beside `model_path` (tritonkit.serving.packing), installed only once it is proven.

        A float graph must reproduce the padded graph's embeddings of mixed-length validation texts within the
        export tolerance. An INT8 graph cannot: a text's softmax sums its row in another order when other texts
        share the row, and a last-bit change can move a probability to the next uint8 level (measured on MiniLM:
        1 - cosine up to 6e-4 against the padded graph). So with `fp32` given, the packed INT8 graph's metrics
        against that FP32 graph on the test split, packed in arrival order as served, must pass `judge` (the lines
        it returns are what they miss: the INT8 build's test-split gates, tritonkit.int8.gates); `reference`: that
        graph's outputs over `eval_batches("test")` where the caller has them.
        """
        import onnx

        from tritonkit.errors import PackingError
        from tritonkit.serving import packing

        f = self.spec.facts
        graph = packing.pack_graph(onnx.load(str(model_path)), f.pooling, f.normalize, f.dim)
        out = packing.packed_path(model_path)
        tmp = out.with_name(f"{out.stem}.tmp.onnx")
        onnx.save(graph, str(tmp))
        if fp32 is None:
            pool = data.eval_texts("validation")
            texts = pool[:: max(1, len(pool) // PACKED_CHECK_TEXTS)][:PACKED_CHECK_TEXTS]  # every source, length
            cos = row_metric("cosine", self.embed_packed(self.session(tmp), texts),
                             self.session(model_path).run([OUTPUT], self.encode(texts))[0])
            problem = (f"cosine min {cos.min():.6f} < {self.EXPORT.tolerance} against the padded graph over "
                       f"{len(texts)} texts") if cos.min() < self.EXPORT.tolerance else ""
        else:
            texts = data.eval_texts("test")
            ref = self.embed_onnx(self.session(fp32), texts) if reference is None else \
                self.arrival_order(reference, texts)
            metrics = self.gate_metrics(ref, self.embed_packed(self.session(tmp), texts))
            if judge is None:
                raise ValueError("judge: an INT8 graph's packed form needs its gates")
            problem = "; ".join(judge(metrics))
        if problem:
            tmp.unlink()
            raise PackingError(f"{out.name}: {problem}")
        tmp.replace(out)
        return out

    @staticmethod
    def arrival_order(rows: np.ndarray, texts: Sequence[str]) -> np.ndarray:
        """Outputs over `eval_batches` of `texts`' split (the texts length-sorted, stably) in the texts' order."""
        out = np.empty_like(rows)
        out[sorted(range(len(texts)), key=lambda i: len(texts[i]))] = rows
        return out

    def packed_feeds(self, texts: Sequence[str], balanced: bool = True, width_multiple: int = 1,
                     row_tokens: int | None = None) -> dict[str, np.ndarray]:
        """`texts` tokenized and packed end to end (tritonkit.serving.packing), as the served encoder runs them."""
        from tritonkit.serving import packing

        ids = [np.asarray(e.ids, np.int64) for e in self._tokenizer(self.MAX_LENGTH).encode_batch(list(texts))]
        return packing.pack(ids, row_tokens or packing.ROW_TOKENS, self.spec.facts.pooling, self.spec.facts.pad_id,
                            balanced, width_multiple=width_multiple)

    def embed_packed(self, sess, texts: Sequence[str], batch_size: int = PACKED_BATCH) -> np.ndarray:
        """Embeddings in the input order, `batch_size` texts per packed run in that (arrival) order."""
        return np.concatenate([sess.run([OUTPUT], self.packed_feeds(texts[start : start + batch_size]))[0]
                               for start in range(0, len(texts), batch_size)])

    # -- served model repository ------------------------------------------------------------------------

    def write_assets(self, model_repository: Path) -> list[Path]:
        """The tokenizer file beside the preprocessor's config, unless the config names an installed package."""
        import shutil

        if self.spec.source.package and not self.spec.source.zip_parts:
            return []
        out = Path(model_repository) / self.PREPROCESSOR / "tokenizer.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.tokenizer_file(), out)
        return [out]



def neighbour_overlap(ref: np.ndarray, got: np.ndarray, k: int = 10) -> np.ndarray:
    """Per row: share of its top-k cosine neighbours (itself excluded) that both embeddings agree on."""
    ref_n = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    got_n = got / np.linalg.norm(got, axis=1, keepdims=True)
    sim_ref, sim_got = ref_n @ ref_n.T, got_n @ got_n.T
    np.fill_diagonal(sim_ref, -np.inf)
    np.fill_diagonal(sim_got, -np.inf)
    top_ref = np.argpartition(-sim_ref, k, axis=1)[:, :k]
    top_got = np.argpartition(-sim_got, k, axis=1)[:, :k]
    return np.array([len(set(a) & set(b)) / k for a, b in zip(top_ref, top_got)])
