"""Could training close an image model's INT8 gap? A weight-only quantization-aware fine-tuning probe.

perf/int8_error_budget.py shows that EfficientNet-Lite0's int8 weights alone miss the gates, whatever the
activations do, so no post-training knob can meet them. This probe:
- folds each BatchNorm into the conv before it, as the ONNX export does;
- fake-quantizes every conv and linear weight to symmetric per-channel int8 (scale max|w| / 127; the gradient
  passes straight through the rounding);
- fine-tunes the folded float weights to match the FP32 model's logits, on the calibration photos only: their
  fixed calibration views, or (`--views N`) N random crops and flips of them, made once before training;
- reports the gates on the validation split with activations in float: plain rounding first, then after each epoch.
Nothing here is served: it says whether a training knob is worth building into the search.

    python perf/int8_qat_probe.py image_classification --epochs 4
    python perf/int8_qat_probe.py image_classification --views 4000 --loss mse --epochs 3 --lr 2e-5
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time

import numpy as np
import torch
from torch.nn.utils import parametrize
from torch.nn.utils.fusion import fuse_conv_bn_eval


def fold_batchnorms(module) -> int:
    """Folds every BatchNorm2d that directly follows a Conv2d among a module's children; returns how many."""

    folded = 0
    children = list(module.named_children())
    for (name, child), (next_name, next_child) in itertools.pairwise(children):
        if isinstance(child, torch.nn.Conv2d) and isinstance(next_child, torch.nn.BatchNorm2d):
            setattr(module, name, fuse_conv_bn_eval(child, next_child))
            setattr(module, next_name, torch.nn.Identity())
            folded += 1
    return folded + sum(fold_batchnorms(child) for _, child in module.named_children())


class Int8Weight(torch.nn.Module):
    """Parametrization: symmetric per-output-channel int8 rounding, straight-through gradient."""

    def forward(self, w):
        scale = w.detach().abs().flatten(1).amax(1).clamp_min(1e-12) / 127.0
        scale = scale.view(-1, *([1] * (w.dim() - 1)))
        return w + (torch.clamp(torch.round(w / scale), -127, 127) * scale - w).detach()


def augmented_views(kind, count: int, seed: int = 0) -> np.ndarray:
    """`count` random crops (10-100 % of the area, aspect 3:4-4:3) and flips of the calibration photos, through
    the served preprocessing: more distinct inputs to distil on, none from the validation or test photos."""
    from tritonkit.data import photos
    from tritonkit.serving import imaging

    rng = np.random.default_rng(seed)
    source = photos.photos("calibration")
    encoded = []
    for _ in range(count):
        rgb = source[rng.integers(len(source))].rgb
        area, aspect = rng.uniform(0.1, 1.0), np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        w, h = min(1.0, np.sqrt(area * aspect)), min(1.0, np.sqrt(area / aspect))
        x0, y0 = rng.uniform(0, 1 - w), rng.uniform(0, 1 - h)
        encoded.append(imaging.encode(photos.crop(rgb, (x0, y0, x0 + w, y0 + h), bool(rng.integers(2))), "JPEG", 92))
    pixels, errors = imaging.preprocess(encoded, kind.PREPROCESS)
    return pixels[[e is None for e in errors]]


def main() -> None:
    from tritonkit import kinds

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="image_classification")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--views", type=int, default=0, help="train on this many random crops (0: calibration views)")
    parser.add_argument("--loss", choices=("kl", "mse"), default="kl", help="distillation loss on the logits")
    parser.add_argument("--evals", type=int, default=1, help="validation reports per epoch")
    args = parser.parse_args()
    torch.manual_seed(0)
    kind = kinds.get(args.model)
    reference = kind.load_backbone()
    student = kind.load_backbone()
    folded = fold_batchnorms(student)
    weighted = [m for m in student.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    for m in weighted:
        parametrize.register_parametrization(m, "weight", Int8Weight())

    def logits(model, x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return np.concatenate([model(torch.from_numpy(x[i : i + 64])).numpy() for i in range(0, len(x), 64)])

    calib = augmented_views(kind, args.views) if args.views else kind.pixels("calibration")
    val = kind.pixels("validation")
    ref_calib, ref_val = logits(reference, calib), logits(reference, val)
    print(f"{kind.NAME}: {folded} BatchNorms folded, {len(weighted)} weighted layers int8 (weights only); "
          f"{len(calib)} {'augmented ' if args.views else ''}calibration views to train on, {len(val)} validation "
          f"views to judge; loss {args.loss}; {platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    metrics = ("top1_agreement", "top1_agreement_margin0.05", "top5_agreement")
    print("| weights | " + " | ".join(metrics) + " | top-1 on training views | seconds |\n|---|"
          + "---|" * (len(metrics) + 2))
    seen = slice(0, min(len(calib), len(val)))  # training views judged too: is the gap fitting or generalising?

    def report(label: str, seconds: float) -> None:
        got = kind.gate_metrics(ref_val, logits(student, val))
        fit = kind.gate_metrics(ref_calib[seen], logits(student, calib[seen]))["top1_agreement"]
        print(f"| {label} | " + " | ".join(f"{got[m]:.4f}" for m in metrics) + f" | {fit:.4f} | {seconds:.0f} |",
              flush=True)

    report("int8, nearest rounding", 0.0)
    optimizer = torch.optim.Adam(student.parameters(), lr=args.lr)
    target = torch.from_numpy(ref_calib)
    x = torch.from_numpy(calib)
    t0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        batches = torch.randperm(len(x)).split(args.batch)
        checkpoints = {round(len(batches) * (k + 1) / args.evals) - 1 for k in range(args.evals)}
        for step, idx in enumerate(batches):
            out = student(x[idx])
            if args.loss == "mse":
                loss = torch.nn.functional.mse_loss(out, target[idx])
            else:
                loss = torch.nn.functional.kl_div(torch.log_softmax(out, -1), torch.log_softmax(target[idx], -1),
                                                  log_target=True, reduction="batchmean")
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step in checkpoints:
                report(f"int8, fine-tuned epoch {epoch} step {step + 1}/{len(batches)} (lr {args.lr:g})",
                       time.perf_counter() - t0)


if __name__ == "__main__":
    main()
