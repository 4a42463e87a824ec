"""Load generation for the overload and soak benchmarks: one open-loop generator, a closed-loop capacity probe,
per-request outcomes and their summaries, and memory of the server's process group (server + Python stubs).

Open loop means arrivals follow a schedule (constant rate or Poisson) whatever the server does, like real
traffic: when the server falls behind, requests pile up in its queues instead of the client slowing down (a
closed loop of N callers can never offer more than N requests at a time, so it hides overload). Requests go
over gRPC with `tritonclient.grpc.aio`, one asyncio task per request, from one process.

An outcome is `ok` (answered and the answer checked), `rejected` (the server shed it: gRPC UNAVAILABLE with
Triton's queue-policy messages "Exceeds maximum queue size" / "Request timeout expired"), or `error` (anything
else, including a wrong answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import random
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

# Triton's messages when a queue policy sheds a request (gRPC UNAVAILABLE, HTTP 503).
REJECT_MESSAGES = ("Exceeds maximum queue size", "Request timeout expired")


@dataclass
class Workload:
    """One kind of request: `inputs(i)` builds the i-th request's InferInputs (grpc aio classes);
    `check(result, i)` raises if the answer to the i-th request is wrong."""

    name: str
    model: str
    inputs: Callable[[int], list]
    check: Callable[[object, int], None] = lambda result, i: None
    outputs: Sequence[str] = ()


@dataclass
class Outcome:
    workload: str
    sent_s: float  # seconds since the run started (actual send time)
    latency_s: float
    status: str  # ok | rejected | error
    message: str = ""
    late_s: float = 0.0  # how far behind its scheduled time the request was sent (client saturation)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def classify(err: Exception) -> tuple[str, str]:
    """(status, message) of a failed call: `rejected` for Triton's queue-policy shedding, else `error`."""
    from tritonclient.utils import InferenceServerException

    if isinstance(err, InferenceServerException):
        status, message = str(err.status() or ""), str(err.message() or "")
    else:
        status, message = type(err).__name__, str(err)
    if "UNAVAILABLE" in status and any(m in message for m in REJECT_MESSAGES):
        return "rejected", message
    return "error", f"{status} {message}".strip()[:300]


async def _call(client, workload: Workload, i: int, started: float, scheduled: float,
                timeout_s: float) -> Outcome:
    from tritonclient.grpc import aio as grpc_aio

    outputs = [grpc_aio.InferRequestedOutput(o) for o in workload.outputs] or None
    sent = time.perf_counter()
    try:
        result = await client.infer(workload.model, workload.inputs(i), outputs=outputs, client_timeout=timeout_s)
        workload.check(result, i)
        status, message = "ok", ""
    except Exception as err:  # every failure is an outcome to count, never a crash of the generator
        status, message = classify(err)
    return Outcome(workload.name, sent - started, time.perf_counter() - sent, status, message,
                   late_s=max(0.0, sent - scheduled))


async def open_loop_async(
    url: str,
    traffic: Sequence[tuple[Workload, float]],
    duration_s: float,
    arrivals: str = "poisson",
    seed: int = 0,
    request_timeout_s: float = 60.0,
    max_in_flight: int = 20_000,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> list[Outcome]:
    """Offer each workload at its rate (requests/s) for duration_s; returns every outcome.

    Arrivals are `poisson` (exponential gaps) or `constant`. Each workload has its own schedule, so a mixed run
    is the superposition of independent streams. A request the client could not even start because
    `max_in_flight` were outstanding counts as an `error` ("client in-flight limit"): with a bounded server
    queue that never happens; without one it keeps the client from growing without bound too.
    """
    from tritonclient.grpc import aio as grpc_aio

    client = grpc_aio.InferenceServerClient(url)
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task] = set()
    started = time.perf_counter()
    rng = random.Random(seed)

    def record(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if on_outcome is not None:
            on_outcome(outcome)

    async def stream(workload: Workload, rate: float, stream_seed: int) -> None:
        gaps = random.Random(stream_seed)
        t, i = 0.0, 0
        while True:
            t += gaps.expovariate(rate) if arrivals == "poisson" else 1.0 / rate
            if t >= duration_s:
                return
            delay = started + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(tasks) >= max_in_flight:
                record(Outcome(workload.name, time.perf_counter() - started, 0.0, "error", "client in-flight limit"))
            else:
                task = asyncio.ensure_future(_call(client, workload, i, started, started + t, request_timeout_s))
                tasks.add(task)
                task.add_done_callback(lambda done: (tasks.discard(done), record(done.result())))
            i += 1

    async def freeze_old_objects() -> None:
        # Outcomes pile up for minutes; without this every full GC rescans all of them and its pauses, which
        # grow with the run, show up as client-side latency in the late windows of a soak.
        while True:
            await asyncio.sleep(5.0)
            gc.freeze()

    freezer = asyncio.ensure_future(freeze_old_objects())
    try:
        await asyncio.gather(*(stream(w, r, rng.randrange(2**31)) for w, r in traffic if r > 0))
        while tasks:
            await asyncio.wait(set(tasks))
    finally:
        freezer.cancel()
        gc.unfreeze()
        await client.close()
    return outcomes


def open_loop(url: str, traffic: Sequence[tuple[Workload, float]], duration_s: float, **kwargs) -> list[Outcome]:
    """Synchronous wrapper of `open_loop_async` (its own event loop)."""
    return asyncio.run(open_loop_async(url, traffic, duration_s, **kwargs))


async def closed_loop_async(url: str, workload: Workload, concurrency: int, duration_s: float,
                            request_timeout_s: float = 60.0) -> list[Outcome]:
    """`concurrency` callers sending back to back for duration_s (the capacity probe)."""
    from tritonclient.grpc import aio as grpc_aio

    client = grpc_aio.InferenceServerClient(url)
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    counter = iter(range(10**12))

    async def caller() -> None:
        while time.perf_counter() - started < duration_s:
            now = time.perf_counter()
            outcomes.append(await _call(client, workload, next(counter), started, now, request_timeout_s))

    try:
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    finally:
        await client.close()
    return outcomes


def capacity(url: str, workload: Workload, concurrency: int = 16, duration_s: float = 10.0,
             warmup_s: float = 2.0) -> dict:
    """Sustainable throughput of `workload`: a closed loop at `concurrency` after a warm-up; only answered
    requests count (ok per second over the measured window)."""
    asyncio.run(closed_loop_async(url, workload, concurrency, warmup_s))
    outcomes = asyncio.run(closed_loop_async(url, workload, concurrency, duration_s))
    summary = summarize(outcomes, duration_s)
    summary["concurrency"] = concurrency
    return summary


def summarize(outcomes: Sequence[Outcome], duration_s: float) -> dict:
    """Counts, rates and latency percentiles (ms) of a run; `duration_s` is the offered window."""
    ok = [o.latency_s * 1e3 for o in outcomes if o.status == "ok"]
    rejected = [o.latency_s * 1e3 for o in outcomes if o.status == "rejected"]
    errors = [o for o in outcomes if o.status == "error"]
    messages: dict[str, int] = {}
    for o in outcomes:
        if o.status != "ok":
            messages[o.message] = messages.get(o.message, 0) + 1
    n = len(outcomes)
    return {
        "requests": n,
        "offered_per_s": n / duration_s if duration_s else float("nan"),
        "ok": len(ok),
        "rejected": len(rejected),
        "errors": len(errors),
        "rejected_fraction": len(rejected) / n if n else 0.0,
        "ok_per_s": len(ok) / duration_s if duration_s else float("nan"),
        "ok_p50_ms": percentile(ok, 50),
        "ok_p99_ms": percentile(ok, 99),
        "ok_max_ms": max(ok, default=float("nan")),
        "rejected_p50_ms": percentile(rejected, 50),
        "rejected_p99_ms": percentile(rejected, 99),
        "late_p99_ms": percentile([o.late_s * 1e3 for o in outcomes], 99),
        "messages": dict(sorted(messages.items(), key=lambda kv: -kv[1])[:8]),
    }


def by_window(outcomes: Sequence[Outcome], window_s: float, duration_s: float) -> list[dict]:
    """`summarize` per window of send time (e.g. per minute)."""
    windows = max(1, math.ceil(duration_s / window_s - 1e-9))
    buckets: list[list[Outcome]] = [[] for _ in range(windows)]
    for o in outcomes:
        buckets[min(windows - 1, int(o.sent_s // window_s))].append(o)
    out = []
    for k, bucket in enumerate(buckets):
        span = min(window_s, duration_s - k * window_s)
        out.append({"window": k, "start_s": k * window_s, **summarize(bucket, span)})
    return out


# -- Triton's own view ------------------------------------------------------------------------------------------

# -- memory of the server's process group ----------------------------------------------------------------------

def group_cpu_ticks(pgid: int) -> dict[int, int]:
    """The live processes of the group and the CPU (user + system clock ticks) each has used so far."""
    pids = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(stat[2]) == pgid:
            pids[int(entry)] = int(stat[11]) + int(stat[12])  # utime, stime
    return pids


def process_name(pid: int, pgid: int) -> str | None:
    """"tritonserver", a Python-backend stub's model (read from its argv), or the program; None once it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if pid == pgid:
        return "tritonserver"
    return Path(argv[1]).parent.parent.name if len(argv) > 1 and argv[0].endswith("_stub") else Path(argv[0]).name


def _rollup(pid: int) -> dict[str, int]:
    """Rss and Pss of one process in KiB (smaps_rollup; Pss splits shared pages, e.g. /dev/shm, fairly)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                out[key] = int(rest.split()[0])
    return out


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat; steal included: time another tenant took)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait


def group_memory(pgid: int) -> dict:
    """RSS and PSS (MiB) of every process in the group: the server and its Python-backend stubs, with a
    breakdown by model (a stub's model is read from its argv).

    RSS double-counts the shared-memory regions the server and its stubs both map; PSS does not, so PSS is the
    honest total and RSS the per-process figure operators see in `ps`/cgroups. `cpu_s`: CPU seconds (user +
    system) the group's live processes have used so far, from the same scan of /proc."""
    total_rss = total_pss = 0.0
    by_model: dict[str, float] = {}
    processes = 0
    ticks = group_cpu_ticks(pgid)
    for pid in ticks:
        roll = _rollup(pid)
        name = process_name(pid, pgid)
        if name is None or not roll:
            continue
        processes += 1
        rss, pss = roll.get("Rss", 0) / 1024, roll.get("Pss", 0) / 1024
        total_rss += rss
        total_pss += pss
        by_model[name] = by_model.get(name, 0.0) + pss
    return {"processes": processes, "rss_mib": total_rss, "pss_mib": total_pss,
            "pss_by_process_mib": {k: round(v, 1) for k, v in sorted(by_model.items())},
            "cpu_s": sum(ticks.values()) / os.sysconf("SC_CLK_TCK")}


@dataclass
class MemorySampler:
    """Samples `group_memory(pgid)` every `interval_s` in a thread; use as a context manager."""

    pgid: int
    interval_s: float = 10.0
    samples: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> dict:
        # CPU of the server group and of this (load-generating) process: on a shared 2-core machine a latency
        # change is only readable next to who had the cores.
        times = os.times()
        s = {"t_s": round(time.perf_counter() - self._started, 1), **group_memory(self.pgid),
             "client_cpu_s": times.user + times.system,
             "machine_busy_s": machine_busy_s()}
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self._started = time.perf_counter()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


# -- the project's real workloads --------------------------------------------------------------------------------

def text_workload(texts: Sequence[str], model: str = "text_embedding") -> Workload:
    """One real text per request; the answer must be a unit-norm 384-float embedding."""
    from tritonclient.grpc import aio as grpc_aio

    encoded = [np.array([[t.encode()]], dtype=np.object_) for t in texts]

    def inputs(i: int) -> list:
        inp = grpc_aio.InferInput("text", [1, 1], "BYTES")
        inp.set_data_from_numpy(encoded[i % len(encoded)])
        return [inp]

    def check(result, i: int) -> None:
        emb = result.as_numpy("embedding")
        if emb is None or emb.shape != (1, 384) or abs(float(np.linalg.norm(emb)) - 1.0) > 1e-2:
            raise ValueError(f"bad embedding {None if emb is None else emb.shape}")

    return Workload("text", model, inputs, check, outputs=("embedding",))


def image_workload(images: Sequence[bytes], model: str = "image_classification") -> Workload:
    """One encoded photo per request; the answer must be 1000 probabilities summing to 1."""
    from tritonclient.grpc import aio as grpc_aio

    encoded = [np.array([[b]], dtype=np.object_) for b in images]

    def inputs(i: int) -> list:
        inp = grpc_aio.InferInput("IMAGE", [1, 1], "BYTES")
        inp.set_data_from_numpy(encoded[i % len(encoded)])
        return [inp]

    def check(result, i: int) -> None:
        probs = result.as_numpy("PROBABILITIES")
        if probs is None or probs.shape != (1, 1000) or abs(float(probs.sum()) - 1.0) > 1e-2:
            raise ValueError(f"bad probabilities {None if probs is None else probs.shape}")

    return Workload("image", model, inputs, check, outputs=("PROBABILITIES",))


def real_images(quality: int = 90) -> list[bytes]:
    """The bundled real photos as JPEG q`quality`, as clients send them (lab, soak, perf gate)."""
    from tritonkit import kinds
    from tritonkit.serving import imaging

    spec = kinds.get("image_classification")

    return [imaging.encode(p.rgb, "JPEG", quality) for p in spec.photos()]


def to_jsonable(obj):
    """Outcomes/dicts → JSON-safe values (nan → None)."""
    if isinstance(obj, Outcome):
        return asdict(obj)
    if isinstance(obj, float):
        return None if math.isnan(obj) or math.isinf(obj) else round(obj, 3)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    return obj


def median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else float("nan")
