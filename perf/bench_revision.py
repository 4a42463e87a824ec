"""Serving speed of this checkout against an earlier revision's, in one run, with the same model files.

    python perf/bench_revision.py REV [--models text_embedding_fp32 image_classification_fp32] [--repeats 3]

REV is checked out as a git worktree under .build/revisions/<sha> (kept for the next run). Its model repository
gets this checkout's built files wherever it has none (linked: same model, same version), so the two sides differ
only in what serves them: that revision's configs, Python models, backend and server code. Each side runs its
own `python -m tritonkit.runtime.server serve`, with its own code first on PYTHONPATH, on free ports; both stay up, and
perf_analyzer (gRPC, c=16, the perf lab's real inputs) measures each model on one side then the other, round
after round. The median of the rounds is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import paths
from tritonkit.perf import lab, peers
from tritonkit.perf.analyzer import run_perf_analyzer, write_input_data
from tritonkit.repository.config import parse_config
from tritonkit.runtime.server import free_port


def worktree(rev: str) -> Path:
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=paths.ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    root = paths.BUILD_DIR / "revisions" / sha
    if not root.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(root), sha], cwd=paths.ROOT, check=True)
    return root


def steps(model: str) -> list[str]:
    """The model and, for an ensemble, the models of its steps (from this checkout's config)."""
    cfg = parse_config((paths.MODEL_REPOSITORY / model / "config.pbtxt").read_text(), model)
    return [s.model_name for s in cfg.ensemble_scheduling.step] + [model]


def link_missing(src: Path, dst: Path) -> None:
    """Entries of src that dst lacks (built models, labels), linked; dst's own files and configs stay."""
    for entry in src.iterdir():
        target = dst / entry.name
        if entry.is_dir() and target.is_dir():
            link_missing(entry, target)
        elif not target.exists() and entry.name != "config.pbtxt":
            target.symlink_to(entry.resolve())


@contextmanager
def serve(root: Path, models: list[str], log: Path):
    env = {**os.environ, "PYTHONPATH": str(root)}
    run = [sys.executable, "-m", "tritonkit.runtime.server"]
    subprocess.run([*run, "prepare-backends"], cwd=root, env=env, check=True, capture_output=True)
    http, grpc, metrics = free_port(), free_port(), free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([*run, "serve", "--model-repository", str(root / "model_repository"),
                                 "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                                 "--models", ",".join(models), "--key-file", str(log.with_suffix(".key"))],
                                cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        peers.wait_ready(f"http://127.0.0.1:{http}/v2/health/ready", proc, log, timeout_s=300)
        yield f"127.0.0.1:{grpc}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev")
    parser.add_argument("--models", nargs="+", default=["text_embedding_fp32", "image_classification_fp32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    old = worktree(args.rev)
    load = list(dict.fromkeys(m for model in args.models for m in steps(model)))
    for m in load:
        link_missing(paths.MODEL_REPOSITORY / m, old / "model_repository" / m)
    sides = {"this checkout": paths.ROOT, args.rev: old}
    results: dict[tuple[str, str], list] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        urls = {side: stack.enter_context(serve(root, load, Path(tmp) / f"{i}.log"))
                for i, (side, root) in enumerate(sides.items())}
        inputs = {}
        for model in args.models:
            text = parse_config((paths.MODEL_REPOSITORY / model / "config.pbtxt").read_text()).input[0].name == "text"
            inputs[model] = write_input_data(Path(tmp) / f"{model}.json",
                                             lab._text_rows() if text else lab._image_rows())
        for _ in range(args.repeats):
            for model in args.models:
                for side, url in urls.items():
                    point = run_perf_analyzer(model, url, args.concurrency, inputs[model], protocol="grpc")
                    results.setdefault((model, side), []).append(point)
    print(f"perf_analyzer gRPC c={args.concurrency}, median of {args.repeats} interleaved rounds, "
          f"{os.cpu_count()} cores; this checkout at {paths.ROOT.name} vs {args.rev} (same model files)")
    print("| model | served by | items/s | p50 ms | p99 ms | ÷ the revision |\n|---|---|---:|---:|---:|---:|")
    for model in args.models:
        base = statistics.median(p.throughput for p in results[model, args.rev])
        for side in sides:
            pts = results[model, side]
            tput = statistics.median(p.throughput for p in pts)
            print(f"| {model} | {side} | {tput:.1f} | {statistics.median(p.p50_ms for p in pts):.1f} | "
                  f"{statistics.median(p.p99_ms for p in pts):.1f} | {tput / base:.2f}× |")


if __name__ == "__main__":
    main()
