"""Shared benchmark machinery: perf_analyzer runs (real input data, CSV parsed), concurrency sweeps with the
median of repeats, in-process baselines timed the same way, and a printed table.

perf_analyzer is the binary from the tritonclient wheel (`.venv/bin/perf_analyzer`); it links libcudart even for
CPU-only runs, so its environment gets the venv's nvidia/cuda_runtime/lib on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tritonkit import paths


class PerfError(RuntimeError):
    """perf_analyzer failed or is missing; the message carries its output tail."""


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


def parse_csv(path: Path, label: str) -> list[PerfPoint]:
    points = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row.get("Concurrency"):
                continue
            us = lambda key, row=row: float(row.get(key) or "nan")  # noqa: E731
            points.append(
                PerfPoint(
                    label=label,
                    concurrency=int(row["Concurrency"]),
                    throughput=float(row["Inferences/Second"]),
                    p50_ms=us("p50 latency") / 1e3,
                    p90_ms=us("p90 latency") / 1e3,
                    p99_ms=us("p99 latency") / 1e3,
                    avg_ms=us("Avg latency") / 1e3,
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
) -> PerfPoint:
    """One perf_analyzer run at a fixed concurrency; p50/p99 from its CSV (--verbose-csv).

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
            "--concurrency-range", f"{concurrency}:{concurrency}",
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
                                     label, extra, timeout_s, stability_percentage=1000)
        if proc.returncode != 0 or not out.exists():
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
            raise PerfError(f"perf_analyzer failed (exit {proc.returncode}) for {model} c={concurrency}:\n{tail}")
        points = parse_csv(out, label or model)
    if not points:
        raise PerfError(f"perf_analyzer wrote no measurement for {model} c={concurrency}")
    return points[-1]


def median_point(points: Sequence[PerfPoint]) -> PerfPoint:
    """Median of repeats, metric by metric (throughput, p50, p99 ...)."""
    first = points[0]
    med = lambda attr: statistics.median(getattr(p, attr) for p in points)  # noqa: E731
    server = {k: statistics.median(p.server.get(k, float("nan")) for p in points) for k in first.server}
    return PerfPoint(
        label=first.label,
        concurrency=first.concurrency,
        throughput=med("throughput"),
        p50_ms=med("p50_ms"),
        p99_ms=med("p99_ms"),
        p90_ms=med("p90_ms"),
        avg_ms=med("avg_ms"),
        server=server,
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
    **kwargs,
) -> list[PerfPoint]:
    """perf_analyzer at each concurrency, `repeats` times, interleaved so drift hits every level alike."""
    runs: dict[int, list[PerfPoint]] = {c: [] for c in concurrencies}
    for r in range(repeats):
        for c in concurrencies:
            point = run_perf_analyzer(model, url, c, input_data, label=label, **kwargs)
            runs[c].append(point)
            progress(f"  {label or model} c={c} run {r + 1}/{repeats}: {point.throughput:.1f}/s "
                     f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms")
    return [median_point(runs[c]) for c in concurrencies]


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
    lat_ms = sorted(x * 1e3 for x in latencies)
    pct = lambda q: lat_ms[min(len(lat_ms) - 1, int(q * len(lat_ms)))]  # noqa: E731
    return PerfPoint(
        label=label,
        concurrency=concurrency,
        throughput=len(latencies) * items_per_call / elapsed,
        p50_ms=pct(0.50),
        p99_ms=pct(0.99),
        p90_ms=pct(0.90),
        avg_ms=statistics.fmean(lat_ms),
    )


def metrics_counters(metrics_url: str, prefix: str = "tritonkit_ort_") -> dict[tuple[str, str], float]:
    """Prometheus counters `{prefix}*` from the server's metrics port: {(name, model): value}."""
    import re
    import urllib.request

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
