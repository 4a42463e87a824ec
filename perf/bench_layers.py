"""Where the served INT8 model's time goes, by group of nodes, before and after its float nodes turn INT8.

    python perf/bench_layers.py [--model text_embedding] [--variant served] [--batches 6 32] [--calls 32]
                                [--repeats 3] [--granular nbits8-b32 ...] [--fp32] [--top 8] [--rev REV]

Profiles (tritonkit.perf.layers: onnxruntime's session profiler or OpenVINO's per-layer counters) the INT8 file as
served on this machine (its packed form where built; `--variant` another runtime variant), one thread as one
Triton instance runs it, on batches of random benchmark items fed as its backend feeds them. `--granular` adds the
same file with its float weighted MatMuls (those the recipe keeps in float) rewritten by a run-time scheme of
tritonkit.int8.granularity: the "after" of the search's finer-granularity step. `--fp32` adds the FP32 file,
`--rev REV` the file REV's served recipe builds (tritonkit.perf.revision): the "before" of a re-search.
Per file and batch size: microseconds per call and share of each group (INT8 linear, run-time INT8 linear,
INT8-weight float linear, float linear, attention, quantize, other), then the costliest nodes. Files and batch sizes
are profiled in interleaved repeats, each node's median time kept (the first profile in a process runs cold).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import envinfo, kinds, paths
from tritonkit.int8 import granularity
from tritonkit.perf import layers, revision
from tritonkit.repository import runtime_choice


def granular_file(path: Path, scheme: str, out_dir: Path) -> tuple[Path, int]:
    """`path` with its float weighted MatMuls rewritten by `scheme`, and how many were."""
    import onnx

    model = onnx.load(str(path))
    nodes = granularity.eligible(model, granularity.weighted_matmuls(model), scheme)
    out = out_dir / scheme / path.name  # the same name: a packed file is fed as packed
    out.parent.mkdir()
    onnx.save(granularity.apply(model, scheme, nodes), str(out))
    return out, len(nodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--variant", default="served", help="served, or one of " + ", ".join(runtime_choice.VARIANTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[6, 32])
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--granular", nargs="*", default=[], choices=granularity.SCHEMES)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--rev", help="also the INT8 file this git revision's served recipe builds (the \"before\")")
    args = parser.parse_args()
    kind = kinds.get(args.model)
    served_variant, path, _ = runtime_choice.served_int8(kind)
    variant = served_variant if args.variant == "served" else args.variant
    with tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        files = [("INT8 as served", path)]
        if args.rev:
            version = revision.served_version(kind, args.rev, Path(tmp) / "rev")
            files.append((f"INT8 as {args.rev} served it", version / path.name))
        for scheme in args.granular:
            rewritten, count = granular_file(path, scheme, Path(tmp))
            files.append((f"INT8, {count} float MatMuls as {scheme}", rewritten))
        if args.fp32:
            files.append(("FP32", runtime_choice.served_file(paths.model_file(kind.FP32_MODEL))))
        print(f"{args.model} on {variant}, 1 thread, median of {args.repeats} interleaved repeats of {args.calls} "
              f"calls after a warm-up, {envinfo.cpu_model()} ({envinfo.int8_class()})")
        runs: dict[tuple, list] = {(f, b): [] for f in range(len(files)) for b in args.batches}
        for _ in range(args.repeats):
            for f, b in runs:
                feeds = runtime_choice.served_feeds(kind, files[f][1], b, variant)
                runs[f, b].append(layers.profile(files[f][1], variant, feeds, args.calls))
        for (f, batch), profiles in runs.items():
            prof = layers.median(profiles)
            total = prof.us_per_call
            print(f"\n{files[f][0]}, batch {batch}: {total:.0f} us per call\n"
                  "| group | us per call | share |\n|---|---:|---:|")
            for group, us in prof.by_group().items():
                print(f"| {group} | {us:.0f} | {us / total:.1%} |")
            print("\n| costliest node | op | group | us per call | share |\n|---|---|---|---:|---:|")
            for t in prof.top(args.top):
                print(f"| {t.name} | {t.op} | {t.group} | {t.us:.0f} | {t.us / total:.1%} |")


if __name__ == "__main__":
    main()
