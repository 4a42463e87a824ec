"""What the runtime choice of one model costs and decides, timing a round on a quarter of the text mixes (the
default, runtime_choice.SAMPLE_MIXES) against every mix, one after the other in one process.

    python perf/bench_runtime_choice.py all_mpnet_base_v2 [--sample-mixes 6 24]

Each setting re-measures both served files as `python -m tritonkit.build <name> --choose-runtime` does (the
model must be built); prints the seconds at each step, items/s, gains over ONNX Runtime and chosen variant. The choice
file is restored afterwards: the checkout's committed record is untouched. The FP32 reference of the accuracy
check is computed once in the process, as in a build, and each setting pays for its own OpenVINO bf16 run.
"""

from __future__ import annotations

import argparse
import json
import time

from tritonkit import envinfo, kinds, paths
from tritonkit.int8 import evaluate
from tritonkit.repository import runtime_choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name")
    parser.add_argument("--sample-mixes", type=int, nargs="+", default=[runtime_choice.SAMPLE_MIXES,
                                                                         runtime_choice.MIXES])
    args = parser.parse_args()
    kind = kinds.get(args.name)
    fp32, int8 = paths.model_file(kind.FP32_MODEL), paths.model_file(kind.INT8_MODEL)
    choice = runtime_choice.choice_path(kind)
    committed = choice.read_text()
    evaluate.reference(kind, fp32, "test")  # once, as the build's replay leaves it
    print(f"{args.name}: {envinfo.cpu_model()}, {runtime_choice.MIXES} mixes per batch size")
    try:
        for mixes in args.sample_mixes:
            runtime_choice.SAMPLE_MIXES = mixes
            print(f"\n{mixes} mixes a round")
            t0 = time.perf_counter()
            entry = runtime_choice.choose(kind, fp32, int8, force=True,
                                          log=lambda m, t=t0: print(f"  [{time.perf_counter() - t:4.0f} s] {m}"))
            print(f"  {mixes} mixes a round: {time.perf_counter() - t0:.0f} s")
            for model, record in entry["models"].items():
                print(f"  {model}: {record['runtime']} ({record['reason']})")
                print(f"    gains {json.dumps(record['vs_onnxruntime'])}")
                print(f"    items/s {json.dumps(record['items_per_s'], sort_keys=True)}")
    finally:
        choice.write_text(committed)


if __name__ == "__main__":
    main()
