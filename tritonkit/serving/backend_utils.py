"""Pieces every Python-backend model of ours needs: config parameters, onnxruntime session options, the ORT
batching counters, and per-request errors. Used by backends/onnxruntime and the models in model_repository/.

Free of `triton_python_backend_utils` at import time (it exists only inside a stub): functions that build Triton
objects take the module as an argument, so this file imports, and is testable, anywhere.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from pathlib import Path

from tritonkit.serving.marks import INT8_SERVED_METRIC, INT8_SERVED_PARAMETER, PRECISION_PARAMETER


def pad_concat(arrays: list, name: str, ragged: bool, pad_value: float, error: type[Exception] = ValueError):
    """Requests' arrays of one input joined on the batch axis; a ragged input is right-padded with `pad_value` to
    the group's longest, a non-ragged one whose shapes differ raises `error` (as Triton does)."""
    import numpy as np

    target = np.max([a.shape[1:] for a in arrays], axis=0)
    parts = []
    for a in arrays:
        pad = [(0, 0)] + [(0, int(t - s)) for t, s in zip(target, a.shape[1:])]
        if any(p[1] for p in pad):
            if not ragged:
                raise error(f"input '{name}': shapes differ within a batch")
            a = np.pad(a, pad, constant_values=np.asarray(pad_value).astype(a.dtype))
        parts.append(a)
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def param(config: dict, key: str, default: str | None = None) -> str | None:
    """A config `parameters` string value; missing or empty → default."""
    value = config.get("parameters", {}).get(key, {}).get("string_value")
    return default if value in (None, "") else value


def instance_count(config: dict) -> int:
    return max(1, sum(int(g.get("count", 1)) for g in config.get("instance_group", [])) or 1)


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs granted by cgroup v2 `cpu.max` (quota / period, the tightest along the process's cgroup path up to
    the root), or None when there is no quota (`max`), no cgroup v2, or nothing readable."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    rel = next((line[3:] for line in lines if line.startswith("0::")), None)
    if rel is None:
        return None
    base = Path(root)
    node = base / rel.lstrip("/")
    limit = None
    while True:
        try:
            quota, period = (node / "cpu.max").read_text().split()[:2]
            if quota != "max":
                share = int(quota) / int(period)
                limit = share if limit is None else min(limit, share)
        except (OSError, ValueError):
            pass
        if node == base or base not in node.parents:
            return limit
        node = node.parent


def usable_cpus() -> int:
    """CPUs this process may really run on: its affinity mask (taskset, cpusets) capped by the cgroup v2 quota
    (container and Kubernetes CPU limits). `os.cpu_count()` counts the host's cores and oversubscribes both."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, math.ceil(limit))
    return max(1, cpus)


# onnxruntime's kOrtSessionOptionsAvx2PrecisionMode: int8 weights outside ±64 become uint8 so its x86 kernels sum
# products in int32 (u8u8), not in saturating int16 pairs as its u8s8 kernels do without VNNI.
EXACT_INT8_ENTRY = "session.x64quantprecision"


def exact_int8(options, exact: bool | None = None):
    """`options` asking for exact int8 sums (EXACT_INT8_ENTRY) where `exact` says so or, by default, where this CPU's
    u8s8 sums are not exact (no VNNI), as every served session does: with VNNI the u8u8 path would only be slower."""
    from tritonkit import envinfo

    wanted = (not envinfo.int8_sums_exact()) if exact is None else exact
    if wanted:
        options.add_session_config_entry(EXACT_INT8_ENTRY, "1")
    return options


def session_options(config: dict):
    """onnxruntime SessionOptions from config parameters, same keys as the native ORT backend where one exists.

    intra_op_thread_count (default: usable CPUs / instances), inter_op_thread_count (default 1), allow_spinning
    (default "0": spinning threads steal the other stubs' cores on small machines). On a CPU whose int8 sums are
    not exact (no VNNI) the session takes the exact path (EXACT_INT8_ENTRY), so a served INT8 file computes what
    its recipe was proven with on every x86 class.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    default_intra = str(max(1, usable_cpus() // instance_count(config)))
    options.intra_op_num_threads = int(param(config, "intra_op_thread_count", default_intra))
    options.inter_op_num_threads = int(param(config, "inter_op_thread_count", "1"))
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", param(config, "allow_spinning", "0"))
    return exact_int8(options)


def index_limits(model_path) -> dict[str, tuple[int, str]]:
    """Graph inputs used directly as Gather indices into a constant table (an embedding lookup), e.g.
    `input_ids` → (30522, table name): the rows a request's values must stay below. The table may be behind a
    DequantizeLinear (INT8 models). Lets a backend reject an out-of-range id as the client's error, naming the
    limit, before it reaches `session.run`."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    tables = {t.name: (int(t.dims[0]) if t.dims else 0) for t in graph.initializer}
    producers = {out: node for node in graph.node for out in node.output}
    inputs = {i.name for i in graph.input} - set(tables)
    limits: dict[str, tuple[int, str]] = {}
    for node in graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in inputs:
            continue
        if any(a.name == "axis" and a.i != 0 for a in node.attribute):
            continue
        data = node.input[0]
        source = producers.get(data)
        if data not in tables and source is not None and source.op_type == "DequantizeLinear":
            data = source.input[0]
        if data in tables and tables[data] > 0:
            rows = min(tables[data], limits.get(node.input[1], (tables[data], ""))[0])
            limits[node.input[1]] = (rows, data)
    return limits


ORT_COUNTERS = (
    ("session_runs", "onnxruntime session.run calls"),
    ("batched_requests", "requests served by those calls"),
    ("input_elements", "input elements fed to session.run, padding included"),
    ("padding_elements", "of those, elements added by ragged right-padding"),
    ("arena_releases", "times the CPU memory arena was handed back to the OS after a burst (ArenaRelease)"),
    ("failed_runs", "session.run calls that raised (not counted in session_runs)"),
    ("retried_runs", "session.run calls over half of a group whose batched run failed (bisecting to the bad one)"),
    ("warmup_runs", "runs over a made-up batch at load, before the first request (parameter warmup_runs)"),
)


# How often a stub hands its counters to Triton's metrics (Counters); perf.analyzer.metrics_counters waits 2x.
COUNTER_FLUSH_S = 0.25


class Counters:
    """Counters kept in the stub and handed to Triton's metrics every COUNTER_FLUSH_S by a thread of their own.

    Every `Metric.increment` is a synchronous round trip to the server process, which the request path should not
    wait on five times a run (docs/performance.md). The stub's message queue is locked, so the thread may send
    while `execute` runs."""

    def __init__(self, families: dict, metrics: dict, flush_s: float = COUNTER_FLUSH_S):
        self._families, self._metrics = families, metrics  # a family must outlive its metrics
        self._pending = dict.fromkeys(metrics, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(flush_s,), name="tritonkit-counters", daemon=True)
        self._thread.start()

    def add(self, key: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._pending[key] += n

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, dict.fromkeys(self._metrics, 0)
        for key, n in pending.items():
            if n:
                self._metrics[key].increment(n)

    def _loop(self, flush_s: float) -> None:
        while not self._stop.wait(flush_s):
            self.flush()

    def close(self) -> None:
        """Flush what is pending and stop the thread (the model's finalize)."""
        self._stop.set()
        self._thread.join()
        self.flush()
        self._metrics.clear()
        self._families.clear()


def ort_metrics(pb_utils, labels: dict[str, str]) -> Counters:
    """`tritonkit_ort_<counter>_total` on the metrics port, counted through `Counters`; close them in finalize."""
    families, metrics = {}, {}
    for key, desc in ORT_COUNTERS:
        families[key] = pb_utils.MetricFamily(
            name=f"tritonkit_ort_{key}_total", description=desc, kind=pb_utils.MetricFamily.COUNTER
        )
        metrics[key] = families[key].Metric(labels=labels)
    return Counters(families, metrics)


def announce_precision(pb_utils, config: dict, name: str, metadata: dict | None = None):
    """Log loudly when an INT8-named model serves FP32 (the config's mark from a replica's view or of every class's
    fallback, or the graph's own mark from this machine's build), and publish `tritonkit_int8_served{model}` where
    a view marked the model. Returns what must live as long as the model (the gauge), or None."""
    precision = param(config, PRECISION_PARAMETER, "") or (metadata or {}).get(PRECISION_PARAMETER, "")
    if precision:
        pb_utils.Logger.log_warn(f"{name}: SERVING FP32 UNDER AN INT8 NAME: {precision}")
    served = param(config, INT8_SERVED_PARAMETER)
    if served is None:
        return None
    family = pb_utils.MetricFamily(name=INT8_SERVED_METRIC, kind=pb_utils.MetricFamily.GAUGE,
                                   description="1: this INT8-named model serves the INT8 graph proven on this CPU's "
                                               "class; 0: it serves FP32")
    metric = family.Metric(labels={"model": name})
    metric.set(1.0 if served == "1" and not precision else 0.0)
    return family, metric  # a family must outlive its metric


def error_response(pb_utils, message: str, client: bool = True):
    """A per-request error; bad input gets the client-error status (INVALID_ARG: HTTP 400 / gRPC
    INVALID_ARGUMENT), not the default INTERNAL."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG", None) if client else None
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(error=error)


class ArenaRelease:
    """When to hand onnxruntime's CPU arena back to the OS.

    The arena keeps its high-water mark: one burst of max-size batches (a backlog after a stall) pins their
    activations for the life of the stub. ORT's run option `memory.enable_memory_arena_shrinkage` frees unused
    chunks, but makes the run that re-grows them slower, so it is applied once, on the `calm_runs`-th consecutive
    run at or below `rows` after a run above it: sustained overload (only big batches) never pays for it, and
    memory returns when the burst ends.

    The arena's chunks come from malloc, and glibc keeps freed ones below its (self-raising, up to 32 MiB) mmap
    threshold in the heap, so each release is followed by `malloc_trim`, or the floor creeps up burst after burst.
    Measurements: docs/performance.md ("Memory").

    Config parameter `arena_release_batch` (rows; default max_batch_size // 4, "0" turns this off).
    """

    def __init__(self, config: dict, calm_runs: int = 4):
        default = str(max(1, int(config.get("max_batch_size", 0)) // 4))
        self.rows = int(param(config, "arena_release_batch", default))
        self.calm_runs = calm_runs
        self.calm = 0
        self.pending = False
        self.releases = 0

    def run_options(self, rows: int):
        """RunOptions for a session.run over `rows` rows, or None (the default options)."""
        if self.rows <= 0:
            return None
        if rows > self.rows:
            self.pending, self.calm = True, 0
            return None
        if not self.pending:
            return None
        self.calm += 1
        if self.calm < self.calm_runs:
            return None
        import onnxruntime as ort

        self.pending, self.calm = False, 0
        self.releases += 1
        options = ort.RunOptions()
        options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        return options

    def run(self, session, output_names: list[str] | None, feeds: dict, rows: int) -> tuple[list, bool]:
        """`session.run` over `rows` rows, releasing the arena (and the heap it sat in) when due.
        Returns (outputs, whether this run released)."""
        options = self.run_options(rows)
        outputs = session.run(output_names, feeds, options)
        if options is not None:
            trim_heap()
        return outputs, options is not None


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)


def trim_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim`); False where libc has none (musl)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
