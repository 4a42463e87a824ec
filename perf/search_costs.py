"""What one INT8 search candidate costs, piece by piece, with and without the search's two shortcuts: calibration
with onnxruntime's CPU arena (`tritonkit.int8.calibration.ARENA_MAX_BYTES`) and scales reused across the candidates of a
prepared graph (`Prepared.initializer_params`). Each shortcut's output is checked to be the same as without it.

    python perf/search_costs.py text_embedding [--candidates 6]

Each calibration runs in its own process, so its peak RSS is its own.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import platform
import resource
import time
from dataclasses import replace

from tritonkit import kinds
from tritonkit.int8.search import Recipe, Search, quantizable_nodes
from tritonkit.paths import model_file


def _search(name: str) -> Search:
    spec = kinds.get(name)
    return Search(spec, model_file(spec.FP32_MODEL), ["uint8"], check_speed=False, progress=False,
                  log=lambda *a: None)


def _calibrate(name: str, arena: bool, out) -> None:
    from tritonkit.int8 import calibration

    if not arena:
        calibration.ARENA_MAX_BYTES = -1  # every graph calibrates without the arena
    search = _search(name)
    recipe = Recipe(form="uint8", placement="inputs")
    search._prepare(recipe)
    t0 = time.perf_counter()
    ranges = search._calibrate(recipe)
    seconds = time.perf_counter() - t0
    out.send((seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
              {k: [float(x) for x in v.range_value] for k, v in ranges.data.items()}))


def calibration(name: str, arena: bool) -> tuple[float, float, dict]:
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_calibrate, args=(name, arena, send))
    proc.start()
    result = recv.recv()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="text_embedding")
    parser.add_argument("--candidates", type=int, default=6, help="quantizations timed per cache state")
    args = parser.parse_args()
    print(f"{args.model}; {platform.machine()}, onnxruntime {__import__('onnxruntime').__version__}\n")

    (s_off, rss_off, r_off), (s_on, rss_on, r_on) = calibration(args.model, False), calibration(args.model, True)
    print("| calibration | seconds | peak RSS (GB) |\n|---|---:|---:|")
    print(f"| without the arena | {s_off:.1f} | {rss_off:.1f} |\n| with the arena | {s_on:.1f} | {rss_on:.1f} |")
    same = r_off == r_on
    print(f"\nranges identical for all {len(r_on)} tensors: {same}\n")

    search = _search(args.model)
    recipe = Recipe(form="uint8", placement="inputs")
    prepared = search._prepare(recipe)
    search._calibrate(recipe)
    nodes = quantizable_nodes(prepared.path, search.spec.WEIGHT_OPS)
    candidates = [replace(recipe, float_nodes=[n]) for n in nodes[: args.candidates]]
    search.build(recipe)  # the graph's shape inference, which both rows below reuse
    times = {"fresh": [], "cached": []}
    identical = True
    for r in candidates:
        prepared.initializer_params.clear()
        t0 = time.perf_counter()
        fresh = search.build(r)
        times["fresh"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        cached = search.build(r)
        times["cached"].append(time.perf_counter() - t0)
        identical &= fresh.SerializeToString() == cached.SerializeToString()
    print("| one candidate's quantization | seconds (mean) |\n|---|---:|")
    for k, v in times.items():
        print(f"| scales {'computed' if k == 'fresh' else 'reused'} | {sum(v) / len(v):.2f} |")
    print(f"\n{len(candidates)} candidates, graphs identical with and without reuse: {identical}")
    if not (same and identical):
        raise SystemExit("a shortcut changed the output")


if __name__ == "__main__":
    main()
