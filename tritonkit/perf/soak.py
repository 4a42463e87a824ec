"""Soak benchmark: mixed text + image traffic at ~70 % of capacity for minutes; errors, p99 drift and memory.

    python perf/bench_soak.py [--minutes 10] [--rate-fraction 0.7] [--text-share 0.5] [--window-s 60]

Starts tritonserver with text_embedding and image_classification, measures each pipeline's capacity alone
(closed loop, 16 callers), then offers open-loop Poisson traffic (tritonkit.perf.load, gRPC) of real inputs -- texts
of the `benchmark` split and the bundled JPEG photos -- at `rate-fraction` of capacity, split between the two
pipelines by `text-share` of their capacities (0.5: half of each, so together ~rate-fraction of the machine).
Every answer is checked (unit-norm embedding; probabilities summing to 1). Per window (default one minute):
requests, ok, rejected, errors, p50/p99 (all and per pipeline), the cores used by the server, the load generator
and anything else, and Triton's mean queue time and batch per step. Every 10 s: RSS and PSS of the server +
Python-backend stubs.

Verdict (PASS/FAIL, exit code 1 on FAIL):
  - zero errors and zero rejections (70 % is below capacity: nothing should be shed),
  - last-window p99 <= 2x first-window p99 (no latency drift; 2x allows for a 2-core machine shared with other
    jobs),
  - the floor of PSS of server + stubs (lowest sample per window) grows by at most max(64 MiB, 10 %) from the
    first window after warm-up to the last; the peak is reported beside it.
Writes perf/results/soak-<time>.json and prints a Markdown table. tests/scenarios/test_soak.py runs 60 s of it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import data
from tritonkit.perf import load, stats
from tritonkit.perf.analyzer import save_results
from tritonkit.runtime.server import TritonServer

MODELS = ["text_embedding", "image_classification"]
STEPS = ("tokenizer", "text_encoder", "image_preprocess", "image_classifier")
MEMORY_BOUND_MIB = 64.0
MEMORY_BOUND_FRACTION = 0.10
P99_DRIFT = 2.0


def cpu_cores(samples: list[dict], start_s: float, end_s: float) -> dict:
    """Mean cores used between the memory samples nearest to start_s and end_s."""
    a = min(samples, key=lambda s: abs(s["t_s"] - start_s))
    b = min(samples, key=lambda s: abs(s["t_s"] - end_s))
    span = b["t_s"] - a["t_s"]
    if span <= 0:
        return {}
    server, client = b["cpu_s"] - a["cpu_s"], b["client_cpu_s"] - a["client_cpu_s"]
    busy = b["machine_busy_s"] - a["machine_busy_s"]
    return {"server_cores": server / span, "client_cores": client / span,
            "other_cores": max(0.0, busy - server - client) / span}


def soak(
    server: TritonServer,
    duration_s: float,
    rate_fraction: float = 0.7,
    text_share: float = 0.5,
    window_s: float = 60.0,
    sample_s: float = 10.0,
    capacity_s: float = 6.0,
    capacities: dict[str, float] | None = None,
    progress=print,
) -> dict:
    """Run the soak against a started server holding MODELS; returns figures and the verdict."""
    workloads = {"text": load.text_workload(data.split("benchmark")),
                 "image": load.image_workload(load.real_images())}
    if capacities is None:
        capacities = {}
        for name, w in workloads.items():
            capacities[name] = load.capacity(server.grpc_url, w, 16, capacity_s, warmup_s=2.0)["ok_per_s"]
            progress(f"capacity {name}: {capacities[name]:.1f}/s")
    rates = {"text": rate_fraction * text_share * capacities["text"],
             "image": rate_fraction * (1 - text_share) * capacities["image"]}
    progress(f"offering text {rates['text']:.1f}/s + image {rates['image']:.1f}/s for {duration_s:.0f}s "
             f"({100 * rate_fraction:.0f} % of capacity)")

    # Triton's statistics at every window boundary: where a slow minute spent its time (queue or compute, which
    # step), or whether it was outside the server.
    snapshots = [stats.read(server.http_url, STEPS)]
    stop = threading.Event()

    def snapshot_windows(started: float) -> None:
        k = 1
        while not stop.wait(max(0.0, started + k * window_s - time.perf_counter())):
            snapshots.append(stats.read(server.http_url, STEPS))
            k += 1

    with load.MemorySampler(server.process.pid, interval_s=sample_s) as mem:
        sampler = threading.Thread(target=snapshot_windows, args=(time.perf_counter(),), daemon=True)
        sampler.start()
        outcomes = load.open_loop(server.grpc_url, [(workloads[n], r) for n, r in rates.items()], duration_s,
                                  arrivals="poisson")
        stop.set()
        sampler.join()
    windows = load.by_window(outcomes, window_s, duration_s)
    for w, before, after in zip(windows, snapshots, snapshots[1:], strict=False):
        w["steps"] = stats.between(before, after)
    for name in workloads:  # which pipeline a drift comes from
        mine = load.by_window([o for o in outcomes if o.workload == name], window_s, duration_s)
        for w, m in zip(windows, mine, strict=True):
            w[f"{name}_p99_ms"] = m["ok_p99_ms"]
    for w in windows:  # who had the cores in each window: server, load generator, anything else on the machine
        w.update(cpu_cores(mem.samples, w["start_s"], w["start_s"] + window_s))
    per_pipeline = {n: load.summarize([o for o in outcomes if o.workload == n], duration_s) for n in workloads}
    total = load.summarize(outcomes, duration_s)

    # Memory is compared by its floor (the lowest sample) in the first window after warm-up and in the last
    # window: ORT's arena grows during a burst of big batches and is released after it (ArenaRelease), so a
    # single sample lands anywhere in that swing, while a leak or a ratchet raises the floor.
    warm_s = min(window_s, duration_s / 2)
    first = [s for s in mem.samples if warm_s <= s["t_s"] < warm_s + window_s] or mem.samples[:1]
    last = [s for s in mem.samples if s["t_s"] >= duration_s - window_s] or mem.samples[-1:]
    reference = min(first, key=lambda s: s["pss_mib"])
    final = min(last, key=lambda s: s["pss_mib"])
    growth = final["pss_mib"] - reference["pss_mib"]
    bound = max(MEMORY_BOUND_MIB, MEMORY_BOUND_FRACTION * reference["pss_mib"])
    first_p99, last_p99 = windows[0]["ok_p99_ms"], windows[-1]["ok_p99_ms"]
    checks = {
        "zero_errors": total["errors"] == 0,
        "zero_rejections": total["rejected"] == 0,
        "p99_stable": len(windows) < 2 or last_p99 <= P99_DRIFT * first_p99,
        "memory_bounded": growth <= bound,
    }
    return {
        "duration_s": duration_s, "rate_fraction": rate_fraction, "text_share": text_share,
        "capacities_per_s": capacities, "offered_rates_per_s": rates,
        "total": total, "per_pipeline": per_pipeline, "windows": windows,
        "memory": {"reference": reference, "final": final, "peak_pss_mib": max(s["pss_mib"] for s in mem.samples),
                   "growth_pss_mib": growth, "growth_rss_mib": final["rss_mib"] - reference["rss_mib"],
                   "bound_mib": bound, "samples": mem.samples},
        "p99_first_ms": first_p99, "p99_last_ms": last_p99,
        "checks": checks, "passed": all(checks.values()),
    }


def markdown(result: dict) -> str:
    f = lambda v: "–" if v != v else f"{v:.0f}"  # noqa: E731 (nan → dash)
    g = lambda v: "–" if v is None else f"{v:.2f}"  # noqa: E731
    def steps(w: dict, key: str) -> str:
        st = w.get("steps", {})
        return " / ".join(f"{st[m][key]:.1f}" if m in st else "–" for m in STEPS)

    lines = ["| window | requests | ok | rejected | errors | p50 ms | p99 ms | text p99 | image p99 "
             "| cores: server / load generator / other | mean queue ms per request: " + " / ".join(STEPS)
             + " | mean batch |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for w in result["windows"]:
        lines.append(f"| {w['window']} | {w['requests']} | {w['ok']} | {w['rejected']} | {w['errors']} | "
                     f"{f(w['ok_p50_ms'])} | {f(w['ok_p99_ms'])} | {f(w.get('text_p99_ms', float('nan')))} | "
                     f"{f(w.get('image_p99_ms', float('nan')))} | {g(w.get('server_cores'))} / "
                     f"{g(w.get('client_cores'))} / {g(w.get('other_cores'))} | {steps(w, 'queue_ms')} | "
                     f"{steps(w, 'batch')} |")
    t, m = result["total"], result["memory"]
    lines += [
        "",
        "| soak | value |", "|---|---|",
        f"| duration | {result['duration_s'] / 60:.1f} min at {100 * result['rate_fraction']:.0f} % of capacity |",
        f"| offered | text {result['offered_rates_per_s']['text']:.1f}/s + image "
        f"{result['offered_rates_per_s']['image']:.1f}/s (capacity {result['capacities_per_s']['text']:.0f} / "
        f"{result['capacities_per_s']['image']:.0f}) |",
        f"| requests / errors / rejected | {t['requests']} / {t['errors']} / {t['rejected']} |",
        f"| p99 first / last window | {f(result['p99_first_ms'])} / {f(result['p99_last_ms'])} ms |",
        f"| PSS server+stubs, floor after warm-up → floor of last window (peak) | {m['reference']['pss_mib']:.0f} → "
        f"{m['final']['pss_mib']:.0f}"
        f" MiB ({m['peak_pss_mib']:.0f}); growth {m['growth_pss_mib']:+.1f} MiB, bound {m['bound_mib']:.0f} MiB |",
        f"| RSS sum after warm-up → end | {m['reference']['rss_mib']:.0f} → {m['final']['rss_mib']:.0f} MiB |",
        f"| verdict | {'PASS' if result['passed'] else 'FAIL'} {result['checks']} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--rate-fraction", type=float, default=0.7, help="offered load as a fraction of capacity")
    parser.add_argument("--text-share", type=float, default=0.5, help="share of the load that is text")
    parser.add_argument("--window-s", type=float, default=60.0, help="stats window (first vs last for drift)")
    parser.add_argument("--sample-s", type=float, default=10.0, help="memory sampling interval")
    parser.add_argument("--capacity-seconds", type=float, default=6.0)
    args = parser.parse_args(argv)

    from tritonkit import build

    build.build("text", progress=False)
    build.build("image", progress=False)
    print(f"starting tritonserver with {MODELS} ...", flush=True)
    with TritonServer.on_free_ports(model_control_mode="explicit", models=MODELS) as server:
        result = soak(server, args.minutes * 60, args.rate_fraction, args.text_share, args.window_s, args.sample_s,
                      args.capacity_seconds, progress=lambda m: print(m, flush=True))
    table = markdown(result)
    print("\n" + table + "\n")
    save_results("soak", load.to_jsonable({
        **result, "markdown": table,
    }), argv)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
