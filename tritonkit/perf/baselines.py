"""What users would run without us, timed like the served models (closed loop, same items, same process run).

- text: sentence-transformers FP32 (the model's own library), one text per call from N threads, N texts per call
  from one caller, and at its best batch size; its own ONNX qint8 export (tritonkit.perf.peers, in its own venv);
- image: the naive first attempt: plain PIL decode + resize + crop per image, torch FP32 at batch 32;
- the in-process ceiling: our own built ONNX models (INT8 as served, and FP32) on the runtime their config names
  (tritonkit.repository.runtime_choice), all cores, fed like the server feeds them (the model's tokenizer.json via
  `tokenizers`, length-sorted batches of 32; and the served file, packed, in calls of 32 in arrival order, as the
  in-process peers are batched; Pillow
  decode + the project's preprocessing, batches of 32), with no server in between.

Benchmarks, the perf lab and the CI ratio gate all compare against these, so a ratio means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path

from tritonkit import paths
from tritonkit.perf.analyzer import PerfPoint, time_in_process
from tritonkit.serving.backend_utils import usable_cpus

IMAGE_BATCH = 32
ONNX_BATCH = 32
ST_BATCHES = (16, 32, 64)  # where sentence-transformers FP32's best batch is looked for


def text(texts: Sequence[str], concurrency: int, seconds: float,
         model: str = "text_embedding") -> tuple[PerfPoint, PerfPoint]:
    """(N threads × 1 text per call, 1 thread × N texts per call) with sentence-transformers FP32 on all cores."""
    per_text = st_per_text(texts, concurrency, seconds, model)
    model = _st_model(model)
    groups = [list(texts[i : i + concurrency]) for i in range(0, len(texts) - concurrency, concurrency)]
    batched = time_in_process(lambda g: model.encode(g, batch_size=len(g)), groups, 1, duration_s=seconds,
                              items_per_call=concurrency,
                              label=f"sentence-transformers FP32 ({concurrency} texts/call)")
    batched.concurrency = concurrency
    return per_text, batched


def st_per_text(texts: Sequence[str], concurrency: int, seconds: float, model: str = "text_embedding") -> PerfPoint:
    """sentence-transformers FP32, N threads × 1 text per call (what a naive per-request server does)."""
    import torch

    torch.set_num_threads(usable_cpus())
    st = _st_model(model)
    return time_in_process(lambda t: st.encode([t]), texts, concurrency, duration_s=seconds,
                           label="sentence-transformers FP32 (1 text/call)")


@cache
def _st_model(name: str):
    from tritonkit import kinds

    return kinds.get(name).sentence_transformer()


def image(images: Sequence[bytes], seconds: float, model: str = "image_classification") -> PerfPoint:
    """PIL full decode + resize + crop per image, the model in torch FP32 at batch 32, all cores."""
    import numpy as np
    import torch

    from tritonkit import kinds
    from tritonkit.serving import imaging

    torch.set_num_threads(usable_cpus())
    kind = kinds.get(model)
    cfg = kind.PREPROCESS
    model = kind.load_classifier()
    batches = [[images[(i + j) % len(images)] for j in range(IMAGE_BATCH)] for i in range(len(images))]

    def run(batch: list[bytes]):
        x = torch.from_numpy(np.stack([imaging.plain_preprocess(b, cfg) for b in batch]))
        with torch.no_grad():
            return model(x)[1].topk(5)

    return time_in_process(run, batches, concurrency=1, duration_s=seconds, warmup=1,
                           label=f"naive baseline: PIL + torch FP32, batch {IMAGE_BATCH}", items_per_call=IMAGE_BATCH)


def st_best_batch(texts: Sequence[str], seconds: float, model: str = "text_embedding",
                  batches: Sequence[int] = ST_BATCHES) -> PerfPoint:
    """sentence-transformers FP32 from one caller at each batch size in `batches` (texts in their order; encode
    sorts each batch by length itself); the fastest, labelled with its batch size."""
    import torch

    torch.set_num_threads(usable_cpus())
    st = _st_model(model)
    points = []
    for batch in batches:
        groups = [list(texts[i : i + batch]) for i in range(0, len(texts) - batch + 1, batch)]
        points.append(time_in_process(lambda g, b=batch: st.encode(g, batch_size=b), groups, 1,
                                      duration_s=seconds / len(batches), warmup=1, items_per_call=batch,
                                      label=f"sentence-transformers FP32, best batch ({batch})"))
    return max(points, key=lambda p: p.throughput)


def onnx_file(model: str, precision: str) -> Path:
    """The built ONNX file the server runs for a spec's INT8 (as served) or FP32 model."""
    from tritonkit import kinds
    from tritonkit.errors import PerfError

    kind = kinds.get(model)
    name = {"int8": kind.INT8_MODEL, "fp32": kind.FP32_MODEL}[precision]
    path = paths.MODEL_REPOSITORY / name / "1" / "model.onnx"
    if not path.exists():
        raise PerfError(f"{paths.rel(path)} is not built; run `make build MODEL={model}`")
    return path


def _precision_label(kind, precision: str) -> str:
    """The INT8 file of an FP32 fallback holds the FP32 graph: say so rather than "INT8"."""
    from tritonkit.int8 import report

    return report.served_label(kind.NAME) if precision == "int8" else precision.upper()


def _served_session(kind, model: str, precision: str):
    """Our built file on the runtime and precision its served config names (tritonkit.repository.runtime_choice), all
    cores: (session, variant)."""
    from tritonkit.repository import runtime_choice

    name = {"int8": kind.INT8_MODEL, "fp32": kind.FP32_MODEL}[precision]
    variant = runtime_choice.variant_for(kind, name)
    return runtime_choice.open_variant(variant, onnx_file(model, precision), usable_cpus()), variant


def onnx_text(texts: Sequence[str], seconds: float, model: str = "text_embedding", precision: str = "int8",
              batch: int = ONNX_BATCH) -> PerfPoint:
    """Our own built encoder on its served runtime (all cores), one caller: tokenize (tokenizer.json) + pad + run per
    batch of `batch` texts, the texts sorted by token count so padding stays minimal."""
    from tritonkit import kinds
    from tritonkit.kinds.text import OUTPUT

    kind = kinds.get(model)
    sess, runtime = _served_session(kind, model, precision)
    tok = kind.load_tokenizer()
    lengths = [len(e.ids) for e in tok.encode_batch(list(texts))]
    ordered = [t for _, t in sorted(zip(lengths, texts, strict=True), key=lambda x: x[0])]
    batches = [ordered[i : i + batch] for i in range(0, len(ordered) - batch + 1, batch)]
    return time_in_process(lambda b: sess.run([OUTPUT], kind.encode(b)), batches, 1, duration_s=seconds,
                           warmup=2, items_per_call=batch,
                           label=f"tritonkit {_precision_label(kind, precision)} ONNX in-process ({runtime}, "
                                 f"sorted batches of {batch})")


def onnx_text_calls(texts: Sequence[str], seconds: float, model: str = "text_embedding", batch: int = ONNX_BATCH
                    ) -> PerfPoint:
    """Our served INT8 file (its packed form where built) on its served runtime, batched as the in-process peers
    are: calls of `batch` consecutive texts in arrival order, nothing sorted across calls; tokenize + pack + run."""
    from tritonkit import kinds
    from tritonkit.kinds.text import OUTPUT
    from tritonkit.repository import runtime_choice

    kind = kinds.get(model)
    name = kind.INT8_MODEL
    variant = runtime_choice.variant_for(kind, name)
    path = runtime_choice.served_file(onnx_file(model, "int8"))
    sess = runtime_choice.open_variant(variant, path, usable_cpus())
    multiple = runtime_choice.width_multiple(kind, name)
    feed = (lambda b: kind.packed_feeds(b, width_multiple=multiple)) if path.name.endswith(".packed.onnx") \
        else kind.encode
    calls = [list(texts[i : i + batch]) for i in range(0, len(texts) - batch + 1, batch)]
    return time_in_process(lambda b: sess.run([OUTPUT], feed(b)), calls, 1, duration_s=seconds, warmup=len(calls),
                           items_per_call=batch,
                           label=f"tritonkit {_precision_label(kind, 'int8')} served file in-process ({variant}, "
                                 f"{path.name}, calls of {batch} in arrival order, as the peers)")


def onnx_image(images: Sequence[bytes], seconds: float, model: str = "image_classification",
               precision: str = "int8", batch: int = IMAGE_BATCH) -> PerfPoint:
    """Pillow decode + the project's preprocessing (tritonkit.serving.imaging, what the served preprocessor runs) + our
    own built classifier on its served runtime (all cores), one caller, `batch` images per call."""
    from tritonkit import kinds
    from tritonkit.serving import imaging

    kind = kinds.get(model)
    sess, runtime = _served_session(kind, model, precision)
    batches = [[images[(i + j) % len(images)] for j in range(batch)] for i in range(len(images))]

    def run(b: list[bytes]):
        return sess.run(["probabilities"], {kind.INPUT: imaging.preprocess(b, kind.PREPROCESS)[0]})

    return time_in_process(run, batches, 1, duration_s=seconds, warmup=1, items_per_call=batch,
                           label=f"Pillow + tritonkit preprocessing + {_precision_label(kind, precision)} ONNX "
                                 f"in-process ({runtime}, batch {batch})")
