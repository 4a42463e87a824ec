"""Where a served pipeline's CPU goes, and what its serving choices are worth, in one run.

    python perf/bench_serving.py [--model text_embedding|image_classification] [--seconds 10] [--repeats 3]
                                 [--variants generated buckets ...] [--profile-stubs] [--rev REV]

Each variant is a scratch model repository holding the spec's ensemble, its preprocessor and its INT8 model
(version directories linked, configs copied and edited through Triton's own schema), served by a fresh
tritonserver and driven closed-loop by 16 callers: texts by wrk, the perf lab's native HTTP load generator
(tritonkit.perf.peers.http_point, one real benchmark text per request), images by tritonkit.perf.load's gRPC generator
(one of the lab's JPEG photos per request). While it runs, the CPU time of every process (tritonserver, each Python
stub, the load generator) is read from /proc (tritonkit.perf.load, as the soak does), and the server's PSS after
it. For text, the server's CPU per text (every tritonserver process) is set against the same INT8 file run in this
process on the runtime and parameters of the encoder's config, tokenize + pack + run, at the batch sizes the server
ran (Triton's batch statistics) in the same proportions. `--profile-stubs` samples every Python stub with py-spy
while the load runs (tritonkit.perf.stubprofile) and adds each stage's share of the stubs' samples: the runtime's
run call, tokenization, packing, image decoding, tensor helpers, the rest of the stub's Python, its C++ (shared
memory hand-offs). `--rev REV` adds, for each chosen variant, `<variant>@REV`: the same configs serving the INT8
file REV's served recipe builds (tritonkit.perf.revision; text: packed and proven against the test-split gates
as a build packs it), so today's recipe races an earlier one served. Variants are interleaved; the median of the
repeats is printed.

Text variants (the encoder's config):
  generated    the configs as `python -m tritonkit.repository.generate` writes them
  buckets      the encoder without its packed graph: padded length buckets (ragged_max_padding)
  delay_500, delay_2000  the encoder's dynamic batcher waiting up to 500 / 2000 us for more requests
  fused        `<name>_fused` instead of the ensemble: tokenizer and encoder in one stub, as generated
  fused_delay_500, fused_delay_1000  the fused model's dynamic batcher waiting up to 500 / 1000 us
  instances_1x2  one encoder instance of two threads (bigger batches, one copy of the weights read per run)
  instances_3x1  three one-thread encoder instances on two cores (one runs while another waits for its batch);
               fused_instances_1x2 and fused_instances_3x1 the same for the fused model
  no_static, fused_no_static  the encoder (ensemble or fused) without static shapes: every packed run on the
               dynamic model; static_12: static shapes for runs of one and two rows
  rows_128, rows_256, fused_rows_128, fused_rows_256  packed rows of 128 / 256 tokens (packed_row_tokens)
  onnxruntime, openvino, fused_onnxruntime, fused_openvino  the encoder (ensemble or fused) on that runtime
  tokenizer_delay_0, tokenizer_delay_2000  the tokenizer's batching wait at 0 / 2000 us (generated: the spec's)
Image variants (the classifier's config, and the preprocessor's where named):
  generated    as generated
  instances_2x1, instances_1x2  the classifier as two instances of one thread / one instance of two threads
  stubs_2_instances_1x2  two preprocessor stubs and one two-thread classifier (the spec's choice until 2026-11-26)
  no_wait      the classifier's dynamic batcher without a queue delay
  fused        `<name>_fused`: decode and classifier in one stub, as generated; fused_delay_0 / fused_delay_2000
               its batcher waiting 0 / 2000 us; fused_instances_1x2 one instance of two threads
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tritonkit import data, kinds, paths
from tritonkit.kinds.text import OUTPUT
from tritonkit.perf import lab, load, peers, revision, stats, stubprofile
from tritonkit.perf.analyzer import cpu_ms_per_item
from tritonkit.repository import variants as rv
from tritonkit.runtime.server import TritonServer
from tritonkit.serving.runtimes import THREAD_PARAMETER


def _edit_buckets(cfg: mc.ModelConfig) -> None:
    del cfg.parameters["packed_model"]


def _edit_delay(microseconds: int):
    def edit(cfg: mc.ModelConfig) -> None:
        cfg.dynamic_batching.max_queue_delay_microseconds = microseconds
    return edit


def _edit_instances(count: int, threads: int):
    def edit(cfg: mc.ModelConfig) -> None:
        cfg.instance_group[0].count = count
        runtime = cfg.parameters["runtime"].string_value if cfg.backend == "python" else cfg.backend
        cfg.parameters[THREAD_PARAMETER.get(runtime, "intra_op_thread_count")].string_value = str(threads)
    return edit


def _edit_preprocessors(count: int):
    def edit(cfg: mc.ModelConfig) -> None:
        cfg.instance_group[0].count = count
    return edit


def _edit_row_tokens(tokens: int):
    def edit(cfg: mc.ModelConfig) -> None:
        cfg.parameters["packed_row_tokens"].string_value = str(tokens)
    return edit


def _edit_static(rows: str):
    def edit(cfg: mc.ModelConfig) -> None:
        if rows:
            cfg.parameters["packed_static_rows"].string_value = rows
        else:
            del cfg.parameters["packed_static_rows"]
    return edit


FUSED = "fused"  # variants named fused*: the same generator on the spec's one-stub model, their edit applied to it
VARIANTS = {"texts": {"generated": None, "buckets": _edit_buckets, "delay_500": _edit_delay(500),
                      "delay_2000": _edit_delay(2000), FUSED: None,
                      "instances_1x2": _edit_instances(1, 2), "fused_instances_1x2": _edit_instances(1, 2),
                      "instances_3x1": _edit_instances(3, 1), "fused_instances_3x1": _edit_instances(3, 1),
                      "fused_delay_500": _edit_delay(500),
                      "fused_delay_1000": _edit_delay(1000), "onnxruntime": rv.serve_on("onnxruntime"),
                      "openvino": rv.serve_on("openvino"), "fused_onnxruntime": rv.serve_on("onnxruntime"),
                      "fused_openvino": rv.serve_on("openvino"), "no_static": _edit_static(""),
                      "static_12": _edit_static("1,2"), "fused_no_static": _edit_static(""),
                      "rows_128": _edit_row_tokens(128), "rows_256": _edit_row_tokens(256),
                      "fused_rows_128": _edit_row_tokens(128), "fused_rows_256": _edit_row_tokens(256),
                      "tokenizer_delay_0": {"preprocessor": _edit_delay(0)},
                      "tokenizer_delay_2000": {"preprocessor": _edit_delay(2000)}},
            "images": {"generated": None, "instances_2x1": _edit_instances(2, 1),
                       "instances_1x2": _edit_instances(1, 2),
                       "stubs_2_instances_1x2": {"preprocessor": _edit_preprocessors(2),
                                                 "model": _edit_instances(1, 2)},
                       "no_wait": _edit_delay(0), FUSED: None, "fused_delay_0": _edit_delay(0),
                       "fused_delay_2000": _edit_delay(2000), "fused_instances_1x2": _edit_instances(1, 2)}}


def models(kind, fused: bool = False) -> list[str]:
    """The ensemble and its two steps, or the fused model (which reads the INT8 model's files)."""
    return [f"{kind.spec.name}_fused", kind.INT8_MODEL] if fused else [kind.spec.name, kind.PREPROCESSOR,
                                                                        kind.INT8_MODEL]


def loaded(kind, fused: bool = False) -> list[str]:
    """The models the server loads: the fused model alone (its INT8 model's directory only lends it files, and
    loaded it would add idle stubs to the server's PSS), or the ensemble and its steps."""
    return models(kind, fused)[:1] if fused else models(kind, fused)


def scratch_repository(kind, root: Path, edit, fused: bool = False, int8: Path | None = None) -> Path:
    """The ensemble's models (or the fused model), their files linked, the encoder's (or the fused model's) config
    edited by `edit`, or each role's config by its edit where `edit` is {"preprocessor" | "model": edit}. `int8`: a
    version directory served as the INT8 model's instead of its own (revision.served_version)."""
    roles = {"model": models(kind, fused)[0] if fused else kind.INT8_MODEL, "preprocessor": kind.PREPROCESSOR}
    edits = {roles[role]: e for role, e in (edit if isinstance(edit, dict) else {"model": edit}).items()}
    for model in models(kind, fused):
        src, dst = paths.MODEL_REPOSITORY / model, root / model
        dst.mkdir(parents=True)
        for entry in src.iterdir():
            if entry.name != "config.pbtxt":
                linked = int8 if model == kind.INT8_MODEL and entry.name == "1" and int8 is not None else entry
                (dst / entry.name).symlink_to(linked.resolve())
        cfg = text_format.Parse((src / "config.pbtxt").read_text(), mc.ModelConfig())
        if edits.get(model) is not None:
            edits[model](cfg)
        (dst / "config.pbtxt").write_text(text_format.MessageToString(cfg))
    return root


def _driver(unit: str, server, items: list, model: str):
    """(seconds -> (items/s, p50 ms, p99 ms)): 16 closed-loop callers on `model`."""
    if unit == "texts":
        target = peers.triton_http(server.http_url, model)

        def drive(seconds: float) -> tuple[float, float, float]:
            point = peers.http_point(target, items, 16, seconds)
            return point.throughput, point.p50_ms, point.p99_ms
    else:
        workload = load.image_workload(items, model)

        def drive(seconds: float) -> tuple[float, float, float]:
            run = load.capacity(server.grpc_url, workload, 16, seconds, warmup_s=0.0)
            if run["ok"] != run["requests"]:
                raise RuntimeError(f"{run['requests'] - run['ok']} failed requests: {run['messages']}")
            return run["ok_per_s"], run["ok_p50_ms"], run["ok_p99_ms"]
    return drive


def in_process_cpu_ms(kind, cfg: mc.ModelConfig, counts: dict[int, int], texts: list[str], seconds: float = 3.0,
                      int8: Path | None = None) -> float:
    """CPU ms per text of the file the served encoder ran, on the runtime and parameters of its (edited) config,
    in this process: tokenize + pack (or pad) + run, over the batch sizes the server ran in the same proportions."""

    import numpy as np

    from tritonkit.repository import runtime_choice
    from tritonkit.serving import packing, runtimes

    params = {k: v.string_value for k, v in cfg.parameters.items()}
    runtime = params.get("runtime", cfg.backend) if cfg.backend == "python" else cfg.backend
    path = (int8 or paths.MODEL_REPOSITORY / kind.INT8_MODEL / "1") / "model.onnx"
    packed = runtime_choice.served_file(path)
    if "packed_model" in params or cfg.backend == "python":
        path = packed
    config = {"name": cfg.name, "parameters": {k: {"string_value": v} for k, v in params.items()}}
    runner = runtimes.open_runner(runtime, path, config)
    multiple = int(params.get("packed_width_multiple", "1"))
    row_tokens = int(params.get("packed_row_tokens", packing.ROW_TOKENS))
    runs_packed = path.name.endswith(".packed.onnx")
    if runs_packed:  # the static shapes its config compiles, as the backend does
        runtimes.static_shapes(runner, config, row_tokens, multiple, cfg.max_batch_size)
    rng = np.random.default_rng(0)
    total = sum(counts.values())
    sizes = [b for b, n in counts.items() for _ in range(max(1, round(64 * n / total)))]
    calls = [[texts[int(j)] for j in rng.choice(len(texts), b, replace=False)] for b in sizes]

    def run(batch: list[str]) -> None:
        feeds = kind.packed_feeds(batch, width_multiple=multiple, row_tokens=row_tokens) if runs_packed \
            else kind.encode(batch)
        feeds = {k: v for k, v in feeds.items() if k in runner.input_names}
        runner.run([OUTPUT], feeds, len(next(iter(feeds.values()))))
    return cpu_ms_per_item(run, calls, seconds)


def measure(kind, unit: str, edit, items: list, seconds: float, fused: bool = False, profile: bool = False,
            int8: Path | None = None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp, \
            TritonServer.on_free_ports(model_repository=scratch_repository(kind, Path(tmp), edit, fused, int8),
                                       models=loaded(kind, fused)) as server:
        drive = _driver(unit, server, items, models(kind, fused)[0])
        drive(2.0)  # warm-up
        compute_model = models(kind, fused)[0] if fused else kind.INT8_MODEL
        counts_before = stats.read(server.http_url, [compute_model])[compute_model]

        def snapshot() -> dict[str, float]:
            """CPU seconds so far per process of the server's group, stubs summed per model."""
            cpu: dict[str, float] = {}
            for pid, ticks in load.group_cpu_ticks(server.process.pid).items():
                name = load.process_name(pid, server.process.pid) or "gone"
                cpu[name] = cpu.get(name, 0.0) + ticks / os.sysconf("SC_CLK_TCK")
            return cpu

        before, mine, wall = snapshot(), os.times(), os.times().elapsed
        # --profile-stubs: py-spy on every stub for all but the run's last second (its callers' last requests)
        pids = {f"{model} {instance}": pid for instance, (pid, model) in server.stub_processes().items()}
        with stubprofile.Recording(pids, seconds - 1) if profile else contextlib.nullcontext() as recording:
            rate, p50, p99 = drive(seconds)
        after, mine_after, wall = snapshot(), os.times(), os.times().elapsed - wall
        counts = (stats.read(server.http_url, [compute_model])[compute_model] - counts_before).batches
        memory = load.group_memory(server.process.pid)
        cfg = text_format.Parse((Path(tmp) / compute_model / "config.pbtxt").read_text(), mc.ModelConfig())
    out = {f"{unit}/s": rate, "p50 ms": p50, "p99 ms": p99}
    for role in sorted(after):
        out[f"cores: {role}"] = (after[role] - before.get(role, 0.0)) / wall
    out["cores: load generator"] = (mine_after.user + mine_after.system - mine.user - mine.system) / wall
    out["PSS MiB"] = memory["pss_mib"]  # every process of the server, after the run
    counts = {b: n for b, n in counts.items() if n > 0}
    out["mean batch"] = sum(b * n for b, n in counts.items()) / max(1, sum(counts.values()))
    if profile:
        out.update({f"stubs: {stage} %": 100 * share for stage, share in recording.shares().items()})
    if unit == "texts":  # every tritonserver process against the same file run in-process at the same batch sizes
        server_ms = 1000 * sum(v - before.get(k, 0.0) for k, v in after.items()) / (rate * wall)
        out["server CPU ms/text"] = server_ms
        out["in-process CPU ms/text"] = in_process_cpu_ms(kind, cfg, counts, items, int8=int8)
        out["server ÷ in-process CPU"] = server_ms / out["in-process CPU ms/text"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="text_embedding")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", nargs="+", help="a subset of the variants named in the docstring")
    parser.add_argument("--profile-stubs", action="store_true",
                        help="sample every stub with py-spy while it runs: the share of each stage")
    parser.add_argument("--rev", help="also serve the INT8 file this git revision's served recipe builds, in each "
                                      "chosen variant (<variant>@REV)")
    args = parser.parse_args()
    if args.profile_stubs and stubprofile.executable() is None:
        parser.error("--profile-stubs needs py-spy (requirements.txt)")
    kind, unit = kinds.get(args.model), lab.pipeline(args.model).unit
    items = data.split("benchmark") if unit == "texts" else load.real_images()
    variants = {n: e for n, e in VARIANTS[unit].items() if (n in args.variants if args.variants else True)
                and (not n.startswith(FUSED) or kind.spec.serving.fused)}
    with tempfile.TemporaryDirectory(prefix="bench-serving-rev-") as tmp:
        int8s = {"": None, **({f"@{args.rev}": revision.served_version(kind, args.rev, Path(tmp))}
                               if args.rev else {})}
        runs: dict[str, list[dict[str, float]]] = {v + at: [] for v in variants for at in int8s}
        for _ in range(args.repeats):
            for name, edit in variants.items():
                for at, int8 in int8s.items():
                    runs[name + at].append(measure(kind, unit, edit, items, args.seconds,
                                                   fused=name.startswith(FUSED), profile=args.profile_stubs,
                                                   int8=int8))
    keys = list(dict.fromkeys(k for rs in runs.values() for r in rs for k in r))
    print(f"{args.model} served, 16 callers, median of {args.repeats} interleaved repeats of "
          f"{args.seconds:g} s, {os.cpu_count()} cores")
    print("| " + " | ".join(["variant", *keys]) + " |\n|---|" + "---:|" * len(keys))
    for name, rs in runs.items():
        cells = [f"{statistics.median(r.get(k, 0.0) for r in rs):.2f}" for k in keys]
        print("| " + " | ".join([name, *cells]) + " |")


if __name__ == "__main__":
    main()
