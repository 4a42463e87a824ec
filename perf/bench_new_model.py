"""`make build` of a sentence-transformers encoder the project does not ship, end to end, timed per stage.

    python perf/bench_new_model.py [--like text_embedding|all_mpnet_base_v2] [--layers N] [--minutes M]

The encoder is a shipped encoder's own weights (`--like`: all-MiniLM-L6-v2, 6 x 384, cut to 4 layers by default; or
all-mpnet-base-v2, 12 x 768, a base-size model, whole by default) cut to its first `--layers` layers: a model of
real weights whose recipe, floors and runtime choice nobody committed. Its spec, repository and build outputs live
in a temporary tree (TRITONKIT_SPECS / _MODEL_REPOSITORY / _BUILD_OUTPUTS), so the checkout is untouched. The build
is the user's command, `python -m tritonkit.build <name>` (as `make build MODEL=<name>`), which searches because no
recipe is committed; `--minutes` passes its budget. Prints the total, the seconds between the build's stage lines,
and each form's outcome; the build's stamped log goes to build/reports/bench_new_model_<like>.log
(`_L<n>` added for a --layers other than the default; `_no_bf16` under TRITONKIT_NO_BF16=1: the build then
sees a CPU without native bf16; `_<class>` under TRITONKIT_CPU_CLASS: it acts as that class, judging INT8 in exact
arithmetic off VNNI, on this CPU's kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tritonkit import envinfo, kinds, paths

NAME = "bench_encoder"
# Log lines that start a stage (the first match of each), in the order a build prints them.
STAGES = {"export": "exporting", "search served (with its bf16 floor)": "searching the served form",
          "search tensorrt (with its fp16 floor)": "searching the tensorrt form", "replays and packing": "INT8 from",
          "runtime choice": "timing ", "done": "done ("}


# Layers kept when --layers is not given, per shipped encoder.
DEFAULT_LAYERS = {"text_embedding": 4, "all_mpnet_base_v2": None}


def make_source(directory: Path, like: str, layers: int | None) -> Path:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(kinds.get(like).model_dir()), device="cpu")
    encoder = model[0].auto_model
    if layers is not None:
        encoder.encoder.layer = encoder.encoder.layer[:layers]
        encoder.config.num_hidden_layers = layers
    model.save(str(directory))
    return directory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", choices=sorted(DEFAULT_LAYERS), default="text_embedding",
                        help="whose weights (and architecture) the new model has")
    parser.add_argument("--layers", type=int, help="keep the first N layers (default: 4 of MiniLM, all of MPNet)")
    parser.add_argument("--minutes", type=float, help="the build's search budget (default: the build's own)")
    args = parser.parse_args()
    layers = args.layers if args.layers is not None else DEFAULT_LAYERS[args.like]
    no_bf16 = os.environ.get(envinfo.NO_BF16_ENV) == "1"  # a CPU of the class without bf16, as the build sees it
    faked = os.environ.get(envinfo.CLASS_ENV)  # a CPU of another class: its sessions and exact judgement, our kernels
    cut = f"_L{layers}" if layers != DEFAULT_LAYERS[args.like] else ""  # another model: another log
    log_path = paths.REPORTS / (f"bench_new_model_{args.like}{cut}{f'_{faked}' if faked else ''}"
                                f"{'_no_bf16' * no_bf16}.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tritonkit-bench-new-model-") as tmp:
        tree = Path(tmp)
        env = {**os.environ, "TRITONKIT_SPECS": str(tree / "models"),
               "TRITONKIT_MODEL_REPOSITORY": str(tree / "model_repository"),
               "TRITONKIT_BUILD_OUTPUTS": str(tree / "build")}
        source = make_source(tree / "source", args.like, layers)
        subprocess.run([sys.executable, "-m", "tritonkit.add", "text-embedding", "--name", NAME,
                        "--source", str(source)], env=env, check=True)
        command = [sys.executable, "-m", "tritonkit.build", NAME, "--no-progress"]
        if args.minutes is not None:
            command += ["--budget-minutes", str(args.minutes)]
        t0 = time.perf_counter()
        starts = {}
        with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=paths.ROOT) as proc, log_path.open("w") as log:
            for line in proc.stdout:
                at = time.perf_counter() - t0
                print(f"{at:8.1f} {line.rstrip()}", file=log, flush=True)
                for stage, marker in STAGES.items():
                    if stage not in starts and line.startswith(("[build]", "[int8]")) and marker in line:
                        starts[stage] = at
        total = time.perf_counter() - t0
        reports = tree / "build" / "reports"
        outcome = {form: json.loads(p.read_text()).get("status") for form, p in
                   (("served", reports / f"{NAME}_int8.json"), ("tensorrt", reports / f"{NAME}_int8_trt.json"))
                   if p.exists()}
    order = sorted(starts.items(), key=lambda kv: kv[1])
    spans = {stage: round((order[i + 1][1] if i + 1 < len(order) else total) - at, 1)
             for i, (stage, at) in enumerate(order)}
    print(json.dumps({"like": args.like, "layers": layers, "no_bf16": no_bf16, "cpu_class": envinfo.int8_class(),
                      "returncode": proc.returncode,
                      "total_s": round(total, 1),
                      "stage_s": spans, "outcome": outcome, "log": paths.rel(log_path)}, indent=2))
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
