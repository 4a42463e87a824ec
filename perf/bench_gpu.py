"""Both pipelines of the GPU view (tritonkit.runtime.gpu_repository) on the embedded tritonserver: perf_analyzer at each
concurrency, queue vs compute per step (Triton's statistics API), GPU utilisation (nvidia-smi sampled every
100 ms during each run), and a correctness check of the served outputs against the same weights in FP32 on the
CPU.

    python -m tritonkit.runtime.gpu_repository build --out .build/gpu_repository
    python perf/bench_gpu.py --repository .build/gpu_repository --variants fp16 fp32 fp16:cpu8

A variant is `<precision>[:cpu<N>]`: the torch_cuda models at that precision, and optionally N instances of the
CPU steps (tokenizer, image_preprocess) instead of the committed counts, which were sized for a 2-core machine.
Writes gpu-<stamp>.json (and the perf_analyzer input files it used) to --out.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tritonkit import paths
from tritonkit.perf.analyzer import PerfError, sweep, write_input_data
from tritonkit.repository.config import load_config, to_pbtxt
from tritonkit.runtime import gpu_repository
from tritonkit.runtime.server import TritonServer

PIPELINES = {
    "text_embedding": ("tokenizer", "text_encoder_cuda"),
    "image_classification": ("image_preprocess", "image_classifier_cuda"),
}


def variant(repository: Path, spec: str, dest: Path) -> Path:
    """A copy of `repository` (files hard-linked) with the torch_cuda precision and CPU-step instances of `spec`."""
    precision, _, cpu = spec.partition(":cpu")
    if precision not in ("fp16", "fp32") or (cpu and not cpu.isdigit()):
        raise SystemExit(f"--variants: {spec!r} is not <fp16|fp32>[:cpu<N>]")
    shutil.copytree(repository, dest, copy_function=os.link)
    for config in dest.glob("*/config.pbtxt"):
        cfg = load_config(config)
        if cfg.backend == "torch_cuda":
            cfg.parameters["precision"].string_value = precision
        elif cfg.name in gpu_repository.CPU_STEPS and cpu:
            for group in cfg.instance_group:
                group.count = int(cpu)
        else:
            continue
        header = "".join(line + "\n" for line in config.read_text().splitlines() if line.startswith("#"))
        config.unlink()  # a hard link: the source repository keeps its file
        config.write_text(header + f"# bench_gpu variant {spec}\n" + to_pbtxt(cfg))
    return dest


class GpuSampler:
    """nvidia-smi --query-gpu every 100 ms in the background; `stop()` returns means over the samples."""

    FIELDS = ("utilization.gpu", "memory.used", "power.draw")

    def __init__(self):
        self.proc = None
        if shutil.which("nvidia-smi") is None:
            return
        self.proc = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={','.join(self.FIELDS)}", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )

    def stop(self) -> dict[str, float]:
        if self.proc is None:
            return {}
        self.proc.terminate()
        out, _ = self.proc.communicate(timeout=10)
        rows = [[float(v) for v in line.split(",")] for line in out.splitlines() if line.strip()
                and all(_is_number(v) for v in line.split(","))]
        if not rows:
            return {}
        cols = list(zip(*rows))
        return {"samples": len(rows), "gpu_util_pct": statistics.mean(cols[0]),
                "gpu_util_pct_max": max(cols[0]), "memory_used_mib_max": max(cols[1]),
                "power_w": statistics.mean(cols[2])}


def _is_number(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


def input_files(out: Path, reuse: Path | None) -> dict[str, Path]:
    """perf_analyzer input data for each pipeline (the perf lab's rows: benchmark texts, real JPEGs)."""
    files = {"text_embedding": out / "inputs-text_embedding.json",
             "image_classification": out / "inputs-image_classification.json"}
    for name, path in files.items():
        if reuse and (reuse / path.name).exists():
            shutil.copy2(reuse / path.name, path)
            continue
        from tritonkit.perf import lab

        write_input_data(path, lab._text_rows() if name == "text_embedding" else lab._image_rows())
    return files


def _jpegs(path: Path, n: int) -> list[bytes]:
    rows = json.loads(path.read_text())["data"][:n]
    return [base64.b64decode(r["IMAGE"]["b64"])[4:] for r in rows]  # drop the 4-byte BYTES length prefix


def check_outputs(server: TritonServer, repository: Path, files: dict[str, Path]) -> dict:
    """Served outputs vs the same module in FP32 on the CPU (torch_serving.build_module, in this process)."""
    import torch
    from tritonkit_client import image, text
    from tritonkit_client.core import Client

    from tritonkit.serving import imaging, torch_serving
    from tritonkit.serving.textproc import TextTokenizer

    texts = [r["text"]["content"][0] for r in json.loads(files["text_embedding"].read_text())["data"][:64]]
    jpegs = _jpegs(files["image_classification"], 22)
    with Client(server.grpc_url, protocol="grpc") as client:
        served_text = text.embed(texts, client=client, batch_size=1, concurrency=16).vectors
        served_img = image.probabilities(jpegs, client=client)["LOGITS"]
        labels = [p[0].label for p in image.classify(jpegs, top_k=1, client=client)]

    def reference(model: str):
        params = _params(repository / model / "config.pbtxt")
        params["parameters"]["precision"] = {"string_value": "fp32"}
        return torch_serving.build_module(params, repository / model / "1", "cpu")[0]

    tok = TextTokenizer(_params(repository / "tokenizer" / "config.pbtxt"), repository / "tokenizer")
    encoder = reference("text_encoder_cuda")
    with torch.no_grad():
        ref_text = []
        for t in texts:  # one text per pass: no padding in the reference
            ids = torch.tensor([tok.tokenizer.encode(t).ids])
            ref_text.append(encoder(ids, torch.ones_like(ids))[0][0].numpy())
        pixels = torch.from_numpy(np.stack([imaging.preprocess_one(j) for j in jpegs]))
        ref_logits = reference("image_classifier_cuda")(pixels)[0].numpy()
    cosine = np.sum(served_text * np.stack(ref_text), axis=1)
    return {
        "texts": len(texts), "cosine_min_vs_fp32_cpu": float(cosine.min()),
        "images": len(jpegs), "logits_max_abs_diff_vs_fp32_cpu": float(np.abs(served_img - ref_logits).max()),
        "top1_agree_vs_fp32_cpu": float(np.mean(served_img.argmax(1) == ref_logits.argmax(1))),
        "top1_labels_first4": labels[:4],
    }


def _params(config: Path) -> dict:
    return gpu_repository.params_json(load_config(config))


def run_variant(repository: Path, spec: str, files: dict[str, Path], args, save) -> dict:
    """One server over the variant; `save(record)` after every point, so a cut-off run keeps what it measured."""
    with tempfile.TemporaryDirectory(prefix="gpu-variant-") as tmp:
        repo = variant(repository, spec, Path(tmp) / "repo")
        server = TritonServer.on_free_ports(model_repository=repo, log_path=Path(args.out) / f"server-{spec}.log")
        started = time.monotonic()
        with server:
            record = {"variant": spec, "load_s": round(time.monotonic() - started, 1), "pipelines": {}}
            save(record)
            print(f"[{spec}] server ready in {record['load_s']} s", flush=True)
            if not args.no_check:
                record["check"] = check_outputs(server, repo, files)
                print(f"[{spec}] check: {record['check']}", flush=True)
            for model, steps in PIPELINES.items():
                points = record["pipelines"].setdefault(model, [])
                for c in args.concurrencies:
                    sampler = GpuSampler()
                    try:
                        point = sweep(model, server.grpc_url, [c], files[model], repeats=args.repeats,
                                      protocol="grpc", measurement_ms=args.measurement_ms,
                                      stats_of=(server.http_url, steps))[0]
                        points.append(point.to_json() | {"gpu": sampler.stop()})
                    except PerfError as err:  # an unstable level is reported, the sweep goes on
                        sampler.stop()
                        points.append({"concurrency": c, "error": str(err)[-400:]})
                        print(f"  {model} c={c}: {points[-1]['error']}", flush=True)
                    save(record)
    return record


def time_modules(repository: Path, batches: list[int], iters: int = 20) -> list[dict]:
    """Each torch_cuda module in this process on cuda:0, through the backend's data path (numpy → device →
    forward → numpy), one thread as in a stub: wall ms per pass, and GPU ms per pass from CUDA events around
    the forward alone. Wall far above GPU time means the pass is bound by the host (launches, copies)."""
    import torch

    from tritonkit.serving import torch_serving

    torch.set_num_threads(1)
    rows = []
    for model in ("text_encoder_cuda", "image_classifier_cuda"):
        for precision in ("fp16", "fp32"):
            for benchmark in (False, True) if model == "image_classifier_cuda" else (False,):
                torch.backends.cudnn.benchmark = benchmark
                params = _params(repository / model / "config.pbtxt")
                params["parameters"]["precision"] = {"string_value": precision}
                module, dtype = torch_serving.build_module(params, repository / model / "1", "cuda:0")
                for b in batches:
                    if model == "text_encoder_cuda":
                        feeds = [np.random.randint(1000, 20000, (b, 32)).astype(np.int64), np.ones((b, 32), np.int64)]
                    else:
                        feeds = [np.random.randn(b, 3, 224, 224).astype(np.float32)]

                    def one_pass(feeds=feeds, module=module, dtype=dtype):
                        ts = [torch.from_numpy(f).to("cuda:0") for f in feeds]
                        ts = [t.to(dtype).contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t
                              for t in ts]
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        with torch.inference_mode():
                            start.record()
                            out = module(*ts)
                            end.record()
                        [o.float().cpu().numpy() for o in out]
                        return start.elapsed_time(end)

                    for _ in range(3):
                        one_pass()
                    t0 = time.perf_counter()
                    gpu = [one_pass() for _ in range(iters)]
                    wall = (time.perf_counter() - t0) / iters * 1e3
                    rows.append({"model": model, "precision": precision, "cudnn_benchmark": benchmark, "batch": b,
                                 "wall_ms": round(wall, 3), "gpu_ms": round(statistics.median(gpu), 3)})
                    print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    return rows


def table(records: list[dict]) -> str:
    lines = ["| variant | pipeline | c | items/s | p50 ms | p99 ms | step: queue / compute ms per request (batch) "
             "| GPU util % (max) |", "|---|---|---|---|---|---|---|---|"]
    for rec in records:
        for model, points in rec["pipelines"].items():
            for p in points:
                if "error" in p:
                    lines.append(f"| {rec['variant']} | {model} | {p['concurrency']} | perf_analyzer failed | | | | |")
                    continue
                steps = "; ".join(f"{m} {s['queue_ms']:.2f} / {s['compute_ms']:.2f} ({s['batch']:.1f})"
                                  for m, s in p["stats"].items())
                gpu = p.get("gpu", {})
                util = f"{gpu['gpu_util_pct']:.0f} ({gpu['gpu_util_pct_max']:.0f})" if gpu else "n/a"
                lines.append(f"| {rec['variant']} | {model} | {p['concurrency']} | {p['throughput']:.1f} | "
                             f"{p['p50_ms']:.2f} | {p['p99_ms']:.2f} | {steps} | {util} |")
    return "\n".join(lines)


def machine() -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "n/a"

    import torch

    return {
        "gpu": run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(), "cpu": platform.processor() or run(["uname", "-m"]),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", default=str(gpu_repository.DEFAULT_OUT))
    parser.add_argument("--variants", nargs="+", default=["fp16"])
    parser.add_argument("--concurrencies", type=lambda s: [int(c) for c in s.split(",")], default=[1, 4, 16, 64])
    parser.add_argument("--measurement-ms", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--inputs", default="", help="folder with inputs-<pipeline>.json to reuse")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--module-timing", type=lambda s: [int(c) for c in s.split(",")], default=None,
                        metavar="BATCHES", help="time each torch_cuda module in-process at these batches, then exit")
    parser.add_argument("--out", default=str(paths.ROOT / "perf" / "results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.module_timing:
        rows = time_modules(Path(args.repository), args.module_timing)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        (out / f"gpu-modules-{stamp}.json").write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2))
        return 0
    files = input_files(out, Path(args.inputs) if args.inputs else None)
    record = {"command": shlex.join(["python", "perf/bench_gpu.py", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "variants": []}
    print(json.dumps(record["machine"]), flush=True)
    path = out / f"gpu-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def save(variant_record: dict) -> None:
        done = [v for v in record["variants"] if v["variant"] != variant_record["variant"]]
        path.write_text(json.dumps(record | {"variants": [*done, variant_record]}, indent=2) + "\n")

    for spec in args.variants:
        record["variants"].append(run_variant(Path(args.repository), spec, files, args, save))
        save(record["variants"][-1])
    print(table(record["variants"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
