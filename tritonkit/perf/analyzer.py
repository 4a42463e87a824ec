"""Shared benchmark machinery: perf_analyzer runs (real input data, CSV parsed), concurrency sweeps with the
median of repeats, in-process baselines timed the same way, and a printed table.

perf_analyzer is the binary from the tritonclient wheel (`.venv/bin/perf_analyzer`); it links libcudart even for
CPU-only runs, so its environment gets the venv's nvidia/cuda_runtime/lib on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tritonkit import paths
from tritonkit.errors import PerfError
from tritonkit.perf import stats


@dataclass
class PerfPoint:
    label: str
    concurrency: int
    throughput: float  # inferences (items) per second
    p50_ms: float
    p99_ms: float
    p90_ms: float = float("nan")
    avg_ms: float = float("nan")
    # Server-side split of the average latency (perf_analyzer --verbose-csv), microseconds.
    server: dict[str, float] = field(default_factory=dict)
    repeats: int = 1
    p95_ms: float = float("nan")
    request_rate: float = 0.0  # offered requests/s in request-rate mode (concurrency is then 0)
    # Per composing model, from the statistics API: avg queue / compute ms per request, avg batch per execution.
    stats: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def perf_analyzer_binary() -> Path:
    binary = paths.venv_bin() / "perf_analyzer"
    if not binary.exists():
        raise PerfError(f"perf_analyzer not found at {binary}; run `make setup` (it comes with tritonclient[all])")
    return binary


def perf_env() -> dict[str, str]:
    import sysconfig

    env = dict(os.environ)
    site = Path(sysconfig.get_paths()["purelib"])
    libs = [str(site / "nvidia" / "cuda_runtime" / "lib")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    return env


def write_input_data(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """perf_analyzer --input-data JSON: one entry per row, {input: {"content": [...], "shape": [...]}}."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"data": list(rows)}))
    return path


def text_rows(texts: Sequence[str], input_name: str = "text") -> list[dict]:
    """Input-data rows for a model taking one BYTES string per request (shape [1])."""
    return [{input_name: {"content": [t], "shape": [1]}} for t in texts]


_SERVER_COLUMNS = {
    "Server Queue": "queue_us",
    "Server Compute Input": "compute_input_us",
    "Server Compute Infer": "compute_infer_us",
    "Server Compute Output": "compute_output_us",
    "Client Send": "client_send_us",
    "Client Recv": "client_recv_us",
}


# perf_analyzer 2.51's --verbose-csv has no average-latency column; these parts add up to it.
_AVG_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
              "Server Compute Infer", "Server Compute Output", "Client Recv")


def parse_csv(path: Path, label: str) -> list[PerfPoint]:
    points = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            # The first column is "Concurrency" or, in request-rate mode, "Request Rate".
            if not (row.get("Concurrency") or row.get("Request Rate")):
                continue
            us = lambda key, row=row: float(row.get(key) or "nan")  # noqa: E731
            points.append(
                PerfPoint(
                    label=label,
                    concurrency=int(row.get("Concurrency") or 0),
                    request_rate=float(row.get("Request Rate") or 0.0),
                    throughput=float(row["Inferences/Second"]),
                    p50_ms=us("p50 latency") / 1e3,
                    p90_ms=us("p90 latency") / 1e3,
                    p95_ms=us("p95 latency") / 1e3,
                    p99_ms=us("p99 latency") / 1e3,
                    avg_ms=(us("Avg latency") if row.get("Avg latency") else sum(us(k) for k in _AVG_PARTS)) / 1e3,
                    server={v: us(k) for k, v in _SERVER_COLUMNS.items() if k in row},
                )
            )
    return points


def run_perf_analyzer(
    model: str,
    url: str,
    concurrency: int,
    input_data: Path,
    protocol: str = "http",
    measurement_ms: int = 4000,
    batch_size: int = 1,
    label: str | None = None,
    extra: Sequence[str] = (),
    timeout_s: float = 300.0,
    stability_percentage: int = 25,
    request_rate: float | None = None,
) -> PerfPoint:
    """One perf_analyzer run at a fixed concurrency (closed loop) or, given `request_rate`, at a fixed offered
    rate (open loop, constant intervals); p50/p95/p99 from its CSV (--verbose-csv).

    perf_analyzer gives up when 3 consecutive windows differ by more than `stability_percentage`; on a shared
    machine that happens, so an unstable run is retried once accepting any spread (we take medians of repeats).
    """
    with tempfile.TemporaryDirectory(prefix="tritonkit-perf-") as tmp:
        out = Path(tmp) / "perf.csv"
        cmd = [
            str(perf_analyzer_binary()),
            "-m", model,
            "-u", url,
            "-i", protocol,
            "-b", str(batch_size),
            "--input-data", str(input_data),
            # Request-rate mode sends from at most --max-threads threads (default 4), which caps the requests in
            # flight and so the rate actually offered; 64 lets the offered rate exceed what the server sustains.
            *(["--request-rate-range", f"{request_rate:g}:{request_rate:g}", "--request-distribution", "constant",
               "--max-threads", "64"]
              if request_rate else ["--concurrency-range", f"{concurrency}:{concurrency}"]),
            "--measurement-mode", "time_windows",
            "--measurement-interval", str(measurement_ms),
            "--stability-percentage", str(stability_percentage),
            "--max-trials", "6",
            "--percentile", "99",
            "-f", str(out),
            "--verbose-csv",
            *extra,
        ]
        proc = subprocess.run(cmd, env=perf_env(), capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0 and "stable measurement" in proc.stdout + proc.stderr and stability_percentage < 1000:
            return run_perf_analyzer(model, url, concurrency, input_data, protocol, measurement_ms, batch_size,
                                     label, extra, timeout_s, stability_percentage=1000, request_rate=request_rate)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            load = f"rate={request_rate:g}/s" if request_rate else f"c={concurrency}"
            raise PerfError(f"perf_analyzer failed (exit {proc.returncode}) for {model} {load}:\n{tail}")
        points = parse_csv(out, label or model)
    if not points:
        raise PerfError(f"perf_analyzer wrote no measurement for {model} c={concurrency}")
    return points[-1]


def median_point(points: Sequence[PerfPoint]) -> PerfPoint:
    """Median of repeats, metric by metric (throughput, p50, p99 ...)."""
    first = points[0]
    med = lambda attr: statistics.median(getattr(p, attr) for p in points)  # noqa: E731
    server = {k: statistics.median(p.server.get(k, float("nan")) for p in points) for k in first.server}
    stats = {
        model: {k: statistics.median(p.stats.get(model, {}).get(k, float("nan")) for p in points) for k in split}
        for model, split in first.stats.items()
    }
    return PerfPoint(
        label=first.label,
        concurrency=first.concurrency,
        request_rate=first.request_rate,
        throughput=med("throughput"),
        p50_ms=med("p50_ms"),
        p99_ms=med("p99_ms"),
        p90_ms=med("p90_ms"),
        p95_ms=med("p95_ms"),
        avg_ms=med("avg_ms"),
        server=server,
        stats=stats,
        repeats=len(points),
    )


def sweep(
    model: str,
    url: str,
    concurrencies: Sequence[int],
    input_data: Path,
    repeats: int = 3,
    label: str | None = None,
    progress: Callable[[str], None] = print,
    rates: Sequence[float] = (),
    stats_of: tuple[str, Sequence[str]] | None = None,
    **kwargs,
) -> list[PerfPoint]:
    """perf_analyzer at each concurrency (then each offered request rate), `repeats` times, interleaved so drift
    hits every level alike; the median of repeats per level.

    `stats_of=(http_url, models)` snapshots the statistics API around every run to split server time per model.
    """
    loads = [("c", c) for c in concurrencies] + [("rate", r) for r in rates]
    runs: dict[tuple, list[PerfPoint]] = {load: [] for load in loads}
    for r in range(repeats):
        for kind, value in loads:
            before = stats.read(*stats_of) if stats_of else {}
            if kind == "c":
                point = run_perf_analyzer(model, url, int(value), input_data, label=label, **kwargs)
            else:
                point = run_perf_analyzer(model, url, 0, input_data, label=label, request_rate=value, **kwargs)
            if stats_of:
                point.stats = stats.between(before, stats.read(*stats_of))
            runs[(kind, value)].append(point)
            progress(f"  {label or model} {kind}={value:g} run {r + 1}/{repeats}: {point.throughput:.1f}/s "
                     f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms")
    return [median_point(runs[load]) for load in loads]


def cpu_ms_per_item(fn, calls: list, seconds: float = 1.0) -> float:
    """Process CPU ms per item of `fn(call)` over `calls` (lists), repeated for `seconds` of wall clock after one
    warm pass (every shape once, as a warm server has seen them)."""
    for call in calls:
        fn(call)
    cpu0, wall0, done = time.process_time(), time.perf_counter(), 0
    while time.perf_counter() - wall0 < seconds:
        for call in calls:
            fn(call)
            done += len(call)
    return (time.process_time() - cpu0) * 1000 / done


def time_in_process(
    fn: Callable[[Any], Any],
    items: Sequence[Any],
    concurrency: int,
    duration_s: float = 8.0,
    warmup: int = 2,
    label: str = "in-process",
    items_per_call: int = 1,
) -> PerfPoint:
    """Closed-loop load like perf_analyzer's: `concurrency` threads call fn(item) back to back for duration_s.

    Each call's latency is recorded; throughput counts items (calls × items_per_call) per second.
    """
    for i in range(warmup):
        fn(items[i % len(items)])
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration_s
    counter = iter(range(10**12))

    def worker() -> None:
        local = []
        while time.perf_counter() < stop:
            item = items[next(counter) % len(items)]
            t0 = time.perf_counter()
            fn(item)
            local.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(local)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    from tritonkit.perf.load import percentile  # the lab's one formula (nearest rank)

    lat_ms = [x * 1e3 for x in latencies]
    return PerfPoint(
        label=label,
        concurrency=concurrency,
        throughput=len(latencies) * items_per_call / elapsed,
        p50_ms=percentile(lat_ms, 50),
        p99_ms=percentile(lat_ms, 99),
        p90_ms=percentile(lat_ms, 90),
        p95_ms=percentile(lat_ms, 95),
        avg_ms=statistics.fmean(lat_ms),
    )


def metrics_counters(metrics_url: str, prefix: str = "tritonkit_ort_") -> dict[tuple[str, str], float]:
    """Prometheus counters `{prefix}*` from the server's metrics port: {(name, model): value}, read after twice
    the time our stubs take to hand their counts to Triton (backend_utils.Counters), so they include this moment's."""
    import re
    import time
    import urllib.request

    from tritonkit.serving.backend_utils import COUNTER_FLUSH_S

    time.sleep(2 * COUNTER_FLUSH_S)

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        m = re.match(r'(\w+)\{([^}]*)\}\s+([0-9.eE+-]+)', line)
        if m:
            model = re.search(r'model="([^"]+)"', m.group(2))
            out[(m.group(1), model.group(1) if model else "")] = float(m.group(3))
    return out


def print_table(points: Sequence[PerfPoint], title: str, baseline: dict[int, PerfPoint] | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("what", "concurrency", "items/s", "p50 ms", "p99 ms"):
        table.add_column(col, justify="right" if col != "what" else "left")
    if baseline:
        table.add_column("× baseline", justify="right")
    for p in points:
        row = [p.label, str(p.concurrency), f"{p.throughput:.1f}", f"{p.p50_ms:.1f}", f"{p.p99_ms:.1f}"]
        if baseline:
            base = baseline.get(p.concurrency)
            row.append(f"{p.throughput / base.throughput:.2f}" if base and base.throughput else "")
        table.add_row(*row)
    Console().print(table)


RESULTS = paths.ROOT / "perf" / "results"


def save_results(bench: str, record: dict, argv: Sequence[str] | None = None) -> Path:
    """perf/results/<bench>-<stamp>.json: the command that made it (perf/bench_<bench>.py and its arguments), the
    core count, then `record`; prints where it went."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    args = sys.argv[1:] if argv is None else list(argv)
    head = {"command": shlex.join(["python", f"perf/bench_{bench}.py", *args]), "cpu_count": os.cpu_count()}
    out.write_text(json.dumps(head | record, indent=2) + "\n")
    print(f"results: {out.relative_to(paths.ROOT)}")
    return out
