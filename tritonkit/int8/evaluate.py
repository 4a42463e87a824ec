"""Running ONNX graphs on CPU for accuracy: the sessions and batched runs that the INT8 search, the half-precision
floor, the runtime choice and the packed-graph proof share (the gate checks are tritonkit.kinds.gates)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from tritonkit.int8.records import SearchSpec

Feeds = Mapping[str, np.ndarray]
# Without VNNI an INT8 file is served on a runtime only if it computes what exact int32 arithmetic of the file does:
# float summation order moves an output row by ~1e-6 in cosine, saturating int16 pair sums by far more.
EXACT_COSINE = 0.9999
# FP32 outputs per (model, file version, split): a build's replay and packed-graph proof score against the same ones.
_REFERENCES: dict[tuple, np.ndarray] = {}


def session(model, threads: int = 0, exact: bool = False):
    """A CPU session; `exact`: int8 products summed exactly in int32 on every x86 class, as served sessions sum them
    (backend_utils.EXACT_INT8_ENTRY; with VNNI the fused kernels already do), not in the saturating int16 pairs of
    onnxruntime's u8s8 kernels without VNNI. The served arithmetic itself, fused kernels included (the unfused Q/DQ
    graph rounds differently, enough to move a worst-case gate): on emulated AVX2 kernels it computes what VNNI's
    do (tritonkit.int8.emulated)."""
    import onnxruntime as ort

    from tritonkit.serving.backend_utils import exact_int8

    options = exact_int8(ort.SessionOptions(), exact)
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    data = model.SerializeToString() if hasattr(model, "SerializeToString") else str(model)
    return ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])


def run_batches(sess, batches: Sequence[Feeds]) -> np.ndarray:
    """The session's first output over `batches`, concatenated (inputs the graph lacks are dropped)."""
    name = sess.get_outputs()[0].name
    inputs = {i.name for i in sess.get_inputs()}
    return np.concatenate([sess.run([name], {k: v for k, v in b.items() if k in inputs})[0] for b in batches])


def row_count(batches: Sequence[Feeds]) -> int:
    """Rows in `batches` (each batch's first feed's leading axis)."""
    return sum(len(next(iter(b.values()))) for b in batches)


def as_file(model, directory: Path) -> Path:
    """`model` as a file the runtimes can open: itself when it is one, else saved in `directory`."""
    import onnx

    if isinstance(model, str | Path):
        return Path(model)
    path = Path(directory) / "candidate.onnx"
    onnx.save(model, str(path))
    return path


def run_variant(variant: str, model, batches: Sequence[Feeds], threads: int) -> np.ndarray:
    """What `model` (a file, or a graph in memory) computes over `batches` run as `variant` serves it
    (tritonkit.serving.runtimes.VARIANTS), first output, concatenated."""
    import tempfile

    from tritonkit.serving.runtimes import open_variant

    with tempfile.TemporaryDirectory(prefix="tritonkit-variant-") as tmp:
        sess = open_variant(variant, as_file(model, Path(tmp)), threads)
        output = sess.runner.output_names[0]
        return np.concatenate([sess.run([output], b)[0] for b in batches])


def cosine_min(x: np.ndarray, y: np.ndarray) -> float:
    """The lowest cosine between matching rows of two outputs (each row flattened)."""
    x, y = (np.asarray(a, np.float64).reshape(len(a), -1) for a in (x, y))
    cos = (x * y).sum(1) / np.maximum(np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1), 1e-30)
    return float(cos.min())


def reference(kind, fp32: Path, split: str, batches: Sequence[Feeds] | None = None) -> np.ndarray:
    """The FP32 graph's outputs over `kind.eval_batches(split)` (rows in that order), computed once per process and
    file version; `batches` when the caller already holds that split's batches. A project build's graph keeps them
    on disk too (cached_reference): MPNet's cost ~2 minutes a split on 2 cores, in every search and replay."""
    key = _reference_key(kind, fp32, split)
    if key not in _REFERENCES:
        batches = batches if batches is not None else kind.eval_batches(split)
        file = cached_reference(kind, fp32, split, batches)
        if file is not None and file.exists():
            _REFERENCES[key] = np.load(file)
        else:
            _REFERENCES[key] = run_batches(session(fp32), batches)
            if file is not None:
                file.parent.mkdir(parents=True, exist_ok=True)
                for old in file.parent.glob(f"{file.name.rsplit('-', 1)[0]}-*.npy"):  # earlier graphs' or data's
                    old.unlink()
                np.save(file, _REFERENCES[key])
    return _REFERENCES[key]


def _reference_key(kind, fp32: Path, split: str) -> tuple:
    stat = Path(fp32).stat()
    return getattr(kind, "NAME", id(kind)), str(Path(fp32).resolve()), stat.st_mtime_ns, stat.st_size, split


def reference_ready(kind, fp32: Path, split: str, batches: Sequence[Feeds] | None = None) -> bool:
    """Whether reference() would return without running the graph (computed in this process, or kept on disk)."""
    if _reference_key(kind, fp32, split) in _REFERENCES:
        return True
    file = cached_reference(kind, fp32, split, batches if batches is not None else kind.eval_batches(split))
    return file is not None and file.exists()


def cached_reference(kind, fp32: Path, split: str, batches: Sequence[Feeds]) -> Path | None:
    """Where a graph under the build outputs keeps its reference outputs of `split`, named by what they depend on:
    the graph's bytes, the split's feeds, the packages and the CPU's features (FP32 kernels differ by CPU). None
    for a graph elsewhere (a test's)."""
    import hashlib
    import json

    from tritonkit import envinfo, paths
    from tritonkit.int8.params import file_digest

    where = Path(fp32).resolve()
    if not any(where.is_relative_to(d.resolve()) for d in (paths.BUILD_OUTPUTS, paths.MODEL_REPOSITORY)):
        return None
    h = hashlib.sha256(json.dumps([file_digest(fp32), split, envinfo.fingerprint()], sort_keys=True).encode())
    for b in batches:
        for name in sorted(b):
            h.update(name.encode() + np.ascontiguousarray(b[name]).tobytes())
    name = getattr(kind, "NAME", "model")
    return paths.BUILD_OUTPUTS / "cache" / "references" / f"{name}-{split}-{h.hexdigest()[:16]}.npy"


class Evaluator:
    """FP32 reference outputs of one split, computed once; `metrics(model)` scores an INT8 candidate on it."""

    def __init__(self, spec: SearchSpec, fp32: Path, split: str, stride: int = 1,
                 extra_rows: dict[int, list[int]] | None = None):
        self.spec, self.split, self.extra_rows = spec, split, dict(extra_rows or {})
        batches = spec.eval_batches(split)
        # Every stride-th batch: a cheaper sample for ranking many candidates; gates always use the whole split.
        picked = [(i, None) for i in range(0, len(batches), stride)]
        # Plus, from the other batches, only the rows `extra_rows` names ({batch: rows}): the outliers that decide
        # worst-case gates ride along at the cost of those rows, not of their whole batches.
        picked += [(i, rows) for i, rows in sorted((extra_rows or {}).items()) if i % stride]
        self.batches = [batches[i] if rows is None else {k: v[rows] for k, v in batches[i].items()}
                        for i, rows in picked]
        if stride == 1 and not extra_rows:
            self.ref = reference(spec, fp32, split, self.batches)
        elif reference_ready(spec, fp32, split, batches):  # the whole split's, computed already: its rows
            whole, starts = reference(spec, fp32, split, batches), np.cumsum([0] + [row_count([b]) for b in batches])
            self.ref = np.concatenate([whole[starts[i]:starts[i + 1]][slice(None) if rows is None else rows]
                                       for i, rows in picked])
        else:
            self.ref = run_batches(session(fp32), self.batches)

    def metrics(self, model, exact: bool = False) -> dict[str, float]:
        return self.spec.gate_metrics(self.ref, run_batches(session(model, exact=exact), self.batches))

    def served_problems(self, model, variant: str, judge: Callable[[dict[str, float]], list[str]], threads: int,
                        exact: bool = False) -> tuple[dict[str, float], list[str]]:
        """(metrics, what `model` misses) run as `variant` serves it: `judge`'s lines on its metrics against the FP32
        outputs (the search's gates with its margin, which left its candidates room for the held-out split), and,
        where the search judges exact int32 arithmetic (a CPU without VNNI), agreement with it (the runtime
        choice's rule)."""
        got = run_variant(variant, model, self.batches, threads)
        metrics = self.spec.gate_metrics(self.ref, got)
        problems = judge(metrics)
        if exact:
            agreement = cosine_min(got, run_batches(session(model, exact=True), self.batches))
            if agreement < EXACT_COSINE:
                problems.append(f"not exact int32 arithmetic: cosine min {agreement:.6f} (< {EXACT_COSINE})")
        return metrics, problems

    def worst_rows(self, model, share: float = 0.01, exact: bool = False) -> dict[int, list[int]]:
        """{batch index: row indices} of the `share` of rows `model` gets most wrong (relative L2 error), so a
        sample can carry the outliers that decide worst-case gates."""
        got = run_batches(session(model, exact=exact), self.batches)
        err = np.linalg.norm(got - self.ref, axis=1) / np.maximum(np.linalg.norm(self.ref, axis=1), 1e-12)
        bounds = np.cumsum([len(next(iter(b.values()))) for b in self.batches])
        out: dict[int, list[int]] = {}
        for row in sorted(int(r) for r in np.argsort(-err)[: max(1, int(len(err) * share))]):
            batch = int(np.searchsorted(bounds, row, side="right"))
            out.setdefault(batch, []).append(row - (int(bounds[batch - 1]) if batch else 0))
        return out
