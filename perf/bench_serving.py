"""Where the served text pipeline's CPU goes, and what its serving choices are worth, in one run.

    python perf/bench_serving.py [--model text_embedding] [--seconds 10] [--repeats 3]

Each variant is a scratch model repository holding the spec's ensemble, tokenizer and INT8 encoder (version
directories linked, configs copied and edited through Triton's own schema), served by a fresh tritonserver and
driven by the perf lab's HTTP load generator (tritonkit.peers.http_point: 16 callers, one real benchmark text
per request). While it runs, the CPU time of every process (tritonserver, each Python stub, the load generator)
is read from /proc (tritonkit.load, as the soak does). Variants are interleaved; the median of the repeats is printed.

  generated    the configs as `python -m tritonkit.generate` writes them
  buckets      the encoder without its packed graph: padded length buckets (ragged_max_padding)
  delay_2000   the encoder's dynamic batcher waiting up to 2000 us for more requests (the earlier default)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import data, kinds, load, paths, peers
from tritonkit.server import TritonServer


def _edit_buckets(cfg: mc.ModelConfig) -> None:
    del cfg.parameters["packed_model"]


def _edit_delay(cfg: mc.ModelConfig) -> None:
    cfg.dynamic_batching.max_queue_delay_microseconds = 2000


VARIANTS = {"generated": None, "buckets": _edit_buckets, "delay_2000": _edit_delay}


def models(kind) -> list[str]:
    """The ensemble and its two steps."""
    return [kind.spec.name, kind.PREPROCESSOR, kind.INT8_MODEL]


def scratch_repository(kind, root: Path, edit) -> Path:
    """The ensemble's models, their files linked, the encoder's config edited by `edit`."""
    for model in models(kind):
        src, dst = paths.MODEL_REPOSITORY / model, root / model
        dst.mkdir(parents=True)
        for entry in src.iterdir():
            if entry.name != "config.pbtxt":
                (dst / entry.name).symlink_to(entry.resolve())
        cfg = text_format.Parse((src / "config.pbtxt").read_text(), mc.ModelConfig())
        if model == kind.INT8_MODEL and edit is not None:
            edit(cfg)
        (dst / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    return root


def measure(kind, edit, texts: list[str], seconds: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, \
            TritonServer.on_free_ports(model_repository=scratch_repository(kind, Path(tmp), edit),
                                       models=models(kind)) as server:
        target = peers.triton_http(server.http_url, kind.spec.name)
        peers.http_point(target, texts, 16, 2.0)  # warm-up

        def snapshot() -> dict[str, float]:
            """CPU seconds so far per process of the server's group, stubs summed per model."""
            cpu: dict[str, float] = {}
            for pid, ticks in load.group_cpu_ticks(server.process.pid).items():
                name = load.process_name(pid, server.process.pid) or "gone"
                cpu[name] = cpu.get(name, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
            return cpu

        before, mine, wall = snapshot(), os.times(), os.times().elapsed
        point = peers.http_point(target, texts, 16, seconds)
        after, mine_after, wall = snapshot(), os.times(), os.times().elapsed - wall
    out = {"texts/s": point.throughput, "p50 ms": point.p50_ms, "p99 ms": point.p99_ms}
    for role in sorted(after):
        out[f"cores: {role}"] = (after[role] - before.get(role, 0.0)) / wall
    out["cores: load generator"] = (mine_after.user + mine_after.system - mine.user - mine.system) / wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    kind, texts = kinds.get(args.model), data.split("benchmark")
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for name, edit in VARIANTS.items():
            runs[name].append(measure(kind, edit, texts, args.seconds))
    keys = list(dict.fromkeys(k for rs in runs.values() for r in rs for k in r))
    print(f"{args.model} served over HTTP, 16 callers, median of {args.repeats} interleaved repeats of "
          f"{args.seconds:g} s, {os.cpu_count()} cores")
    print("| " + " | ".join(["variant", *keys]) + " |\n|---|" + "---:|" * len(keys))
    for name, rs in runs.items():
        cells = [f"{statistics.median(r.get(k, 0.0) for r in rs):.2f}" for k in keys]
        print("| " + " | ".join([name, *cells]) + " |")


if __name__ == "__main__":
    main()
