"""The served INT8 files' arithmetic on another x86 class's own kernels, on this machine: QEMU's user-mode emulator
(`qemu-x86_64 -cpu MODEL`, Debian's qemu-user) answers CPUID as that CPU, and onnxruntime's MLAS and OpenVINO's
oneDNN pick their kernels by CPUID, so the class's integer kernels really run (TCG emulates AVX2 since QEMU 7.2,
not AVX-512). Numerics only: emulated time says nothing about the class's speed.

    python -m tritonkit.int8.emulated check [MODEL ...] [--cpu-class avx2] [--rows N]   # make check-cpu-classes

Per model with an INT8 file under its INT8 name, a few rows of the test split run here (each runtime as served;
on a VNNI host onnxruntime's int8 products are summed exactly in int32) and under the emulator (each runtime as a
replica of the class serves it, the session an INT8 search there judges in, and onnxruntime's default session,
which sums u8s8 pairs in saturating int16 without VNNI). Each file is judged by one of two rules, which the report
names:
- `exact`, a file whose every int8 operand is fixed by the graph (static Q/DQ): it must compute what onnxruntime
  computes here (cosine min >= evaluate.EXACT_COSINE; only float summation order may differ).
- `gates`, a file with run-time quantized nodes (tritonkit.int8.granularity's MatMulNBits and MatMulInteger
  schemes, onnxruntime's dynamic quantization): each block's scale comes from float activations, so a float
  rounding that differs between ISAs moves an int8 code and the class computes another result. Its outputs,
  scored against the FP32 graph's on the same rows (kind.gate_metrics), must hold each of the served form's
  accuracy gates (tritonkit.int8.gates.for_form, as the runtime choice judges) that this host's outputs hold there.
Exit 1 where onnxruntime as served on the class misses its file's rule, 2 where the emulator is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

QEMU = "qemu-x86_64"
# A QEMU CPU model per class it can present: AMD Rome has AVX2 and no AVX-512, VNNI or bf16.
CPU_MODELS: Mapping[str, str] = {"avx2": "EPYC-Rome"}
# How each run computes: the runtimes as served (tritonkit.serving.runtimes.VARIANTS) and the default session.
SERVED = ("onnxruntime", "openvino")
DEFAULT_SESSION = "onnxruntime-default-session"
# The session an INT8 search judges accuracy in off VNNI (evaluate.session(exact=True)).
JUDGED_SESSION = "onnxruntime-judged-session"
THREADS = 2
# The share of a split's batches, shortest first, that rows are picked from.
SPREAD = 0.5
# The rules a file is judged by (module docstring).
EXACT, GATES = "exact", "gates"
# onnxruntime's dynamic quantization ops beside the project's run-time schemes: their codes come from float scales.
DYNAMIC_OPS = ("DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulIntegerToFloat")


def native(cpu_class: str) -> bool:
    """Whether this host already is a `cpu_class` CPU: its own kernels then run without the emulator (real
    numerics of the class, and nothing of QEMU's instruction translation in between)."""
    return cpuid_class() == cpu_class


def unavailable(cpu_class: str = "avx2") -> str | None:
    """Why `cpu_class` cannot be run here (None: it can, natively or emulated)."""
    if not native(cpu_class) and shutil.which(QEMU) is None:
        return f"{QEMU} is not installed (Debian: apt-get install qemu-user; make setup installs it)"
    return None


# numpy's CPUID feature names beside the /proc/cpuinfo flags envinfo.int8_class reads.
CPUID_FLAGS: Mapping[str, str] = {"AVX512VNNI": "avx512_vnni", "AVX512BW": "avx512bw", "AVX2": "avx2"}


def cpuid_class() -> str:
    """This process's INT8 class (envinfo.int8_class) from CPUID as it sees it (numpy's runtime dispatch), not
    /proc/cpuinfo, which the emulator does not rewrite: what MLAS and oneDNN see."""
    from numpy.core._multiarray_umath import __cpu_features__ as has

    from tritonkit import envinfo

    return envinfo.int8_class([flag for name, flag in CPUID_FLAGS.items() if has.get(name)])


def emulate(cpu_class: str, argv: Sequence[str]) -> subprocess.CompletedProcess:
    """Run this interpreter with `argv` under the emulator as a `cpu_class` CPU; the tritonkit process inside acts
    as that class ($TRITONKIT_CPU_CLASS, no bf16), as a replica there does."""
    from tritonkit import envinfo

    env = {**os.environ, envinfo.CLASS_ENV: cpu_class, envinfo.NO_BF16_ENV: "1"}
    prefix = [] if native(cpu_class) else [QEMU, "-cpu", CPU_MODELS[cpu_class]]
    return subprocess.run([*prefix, sys.executable, *argv], env=env, capture_output=True, text=True)


def int8_file(kind) -> Path | None:
    """The file served under `kind`'s INT8 name where it holds INT8 nodes, static or run-time quantized (None:
    unbuilt or an FP32 fallback)."""
    from tritonkit import paths
    from tritonkit.int8.checks import quantized_ops

    path = paths.model_file(kind.INT8_MODEL)
    return path if path.exists() and (quantized_ops(path) or runtime_quantized(path)) else None


def pick_rows(kind, rows: int, split: str = "test") -> list[dict[str, np.ndarray]]:
    """About `rows` rows of `split` as batches: a few rows from each of batches spread over its shorter half (text
    batches are length-sorted; a 256-token row costs the emulator minutes)."""
    batches = kind.eval_batches(split)
    taken = min(len(batches), max(1, rows // 4))
    each = max(1, rows // taken)
    return [{k: v[:each] for k, v in batches[int(i)].items()}
            for i in np.linspace(0, (len(batches) - 1) * SPREAD, taken)]


def _save(directory: Path, batches: Sequence[Mapping[str, np.ndarray]]) -> None:
    np.savez(directory / "feeds.npz", **{f"{i}:{k}": v for i, b in enumerate(batches) for k, v in b.items()})


def _load(directory: Path) -> list[dict[str, np.ndarray]]:
    arrays, out = np.load(directory / "feeds.npz"), {}
    for key in arrays.files:
        i, name = key.split(":", 1)
        out.setdefault(int(i), {})[name] = arrays[key]
    return [out[i] for i in sorted(out)]


def run(directory: Path, cpu_class: str) -> None:
    """Inside the emulator: each way of computing over the bundle's rows, saved beside it."""
    from tritonkit.int8.evaluate import run_batches, run_variant, session

    seen = cpuid_class()
    if seen != cpu_class:
        raise SystemExit(f"the emulator presented a {seen} CPU, not {cpu_class}: its kernels would not be the class's")
    model, batches = (directory / "model.onnx").resolve(), _load(directory)
    outputs = {v: run_variant(v, model, batches, THREADS) for v in SERVED}
    outputs[DEFAULT_SESSION] = run_batches(session(model, THREADS), batches)
    outputs[JUDGED_SESSION] = run_batches(session(model, THREADS, exact=True), batches)
    np.savez(directory / "emulated.npz", **outputs)


def emulated_outputs(path: Path, batches: Sequence[Mapping[str, np.ndarray]], cpu_class: str) -> dict:
    """{way of computing: first output over `batches`} of the graph at `path` on an emulated `cpu_class` CPU."""
    with tempfile.TemporaryDirectory(prefix="tritonkit-emulated-") as tmp:
        (Path(tmp) / "model.onnx").symlink_to(Path(path).resolve())
        _save(Path(tmp), batches)
        done = emulate(cpu_class, ["-m", "tritonkit.int8.emulated", "run", tmp, "--cpu-class", cpu_class])
        if done.returncode != 0:
            raise RuntimeError(f"{path}: the emulated run failed ({done.returncode}): {done.stderr[-2000:]}")
        return dict(np.load(Path(tmp) / "emulated.npz"))


def runtime_quantized(path: Path) -> dict[str, int]:
    """{op type: count} of the nodes in the graph at `path` that quantize activations at run time (empty: every
    int8 operand is fixed by the graph, so the file's arithmetic is exact on every class)."""
    import onnx

    from tritonkit.int8.checks import RUNTIME_QUANTIZED

    ops: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.op_type in (*RUNTIME_QUANTIZED, *DYNAMIC_OPS):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def gate_metrics(kind, ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    """The kind's gate metrics of `got` against the FP32 outputs `ref` (rounded as reports keep them)."""
    return {k: round(float(v), 6) for k, v in kind.gate_metrics(ref, got).items()}


def gated(gates, metrics: Mapping[str, float]) -> dict[str, float]:
    """Of `metrics`, those the test split's gates bound (the report's columns)."""
    return {t.metric: metrics[t.metric] for t in gates.targets["test"] if t.metric in metrics}


def judge_gates(gates, metrics: Mapping[str, float], here: Mapping[str, float]) -> dict:
    """The `gates` rule on one way of computing: the served form's test-split gates that this host's `here`
    metrics hold must hold on `metrics` too; one that `here` misses on these rows is listed, not charged to the
    class (a few rows decide no split-wide gate the file was proven on)."""
    from tritonkit.kinds.gates import missed

    # A deferred floor is measured here only where the absolute bounds cannot decide (gates.Gates.holds).
    gates.holds("test", metrics)
    gates.holds("test", here)
    targets = gates.targets["test"]
    lost = missed([t for t in targets if t.met(here)], dict(metrics))
    entry = {"metrics": gated(gates, metrics), "holds": not lost, "missed": lost}
    if any(not t.met(here) for t in targets):
        entry["missed_here_too"] = missed([t for t in targets if not t.met(here)], dict(metrics))
    return entry


def judge_way(kind, got: np.ndarray, served: np.ndarray, rule: str, gates=None, ref: np.ndarray | None = None,
              here: Mapping[str, float] | None = None) -> dict:
    """One way of computing on the class (`got`) against onnxruntime as served here (`served`), judged by `rule`;
    the `gates` rule needs the served form's `gates`, the FP32 outputs `ref` and this host's metrics `here`."""
    from tritonkit.int8.evaluate import EXACT_COSINE, cosine_min

    cos = cosine_min(got, served)
    entry = {"cosine_min": round(cos, 6), "max_abs": float(np.abs(got - served).max()), "exact": cos >= EXACT_COSINE}
    if any(t.metric == "top1_agreement" for t in kind.TARGETS):  # a classifier: does the answer move
        entry["top1_agreement"] = float((got.argmax(1) == served.argmax(1)).mean())
    if rule == GATES:
        entry["gates"] = judge_gates(gates, gate_metrics(kind, ref, got), here)
    entry["holds"] = entry["gates"]["holds"] if rule == GATES else entry["exact"]
    return entry


def check_model(kind, cpu_class: str, rows: int, path: Path | None = None, fp32: Path | None = None,
                gates=None) -> dict:
    """One model's record: per way of computing on the emulated class, its outputs against onnxruntime as served
    here (on a VNNI host: int8 products summed exactly in int32) and, where it is a served runtime, against itself
    here; each judged by the file's rule. `path`, `fp32`, `gates`: the INT8 file, the FP32 graph and the served
    form's gates (default: the model's served files, gates.for_form)."""
    from tritonkit import paths
    from tritonkit.int8 import gates as int8_gates
    from tritonkit.int8.evaluate import run_batches, run_variant, session

    path = path or int8_file(kind)
    if path is None:
        return {"skipped": "no INT8 file under its INT8 name (unbuilt, or an FP32 fallback)"}
    ops = runtime_quantized(path)
    rule = GATES if ops else EXACT
    record: dict = {"file": paths.rel(path), "rule": rule, "ways": {}}
    ref = here = None
    if rule == GATES:
        fp32 = fp32 or paths.model_file(kind.FP32_MODEL)
        if not Path(fp32).exists():
            return {**record, "error": f"its FP32 graph {paths.rel(fp32)} is not built: no gates to judge by"}
        record["runtime_quantized"] = ops
    batches = pick_rows(kind, rows)
    served_here = {v: run_variant(v, path, batches, THREADS) for v in SERVED}
    served = served_here["onnxruntime"]
    record["rows"] = len(served)
    if rule == GATES:
        gates = gates or int8_gates.for_form(kind, fp32, "served", log=lambda line: print(f"[emulated] {line}"),
                                             defer=True)
        ref = run_batches(session(fp32, THREADS), batches)
        here = gate_metrics(kind, ref, served)
        record["here"] = gated(gates, here)
    emulated = emulated_outputs(path, batches, cpu_class)
    for way, got in emulated.items():
        entry = judge_way(kind, got, served, rule, gates, ref, here)
        if way in served_here:
            entry["max_abs_to_here"] = float(np.abs(got - served_here[way]).max())
        record["ways"][way] = entry
    return record


def _verdict(rule: str, e: Mapping) -> str:
    if rule == EXACT:
        return "yes" if e["holds"] else "**no**"
    g = e["gates"]
    said = "yes" if g["holds"] else f"**no**: {'; '.join(g['missed'])}"
    return said + (f" (here too on these rows: {'; '.join(g['missed_here_too'])})" if g.get("missed_here_too")
                   else "")


def table(report: Mapping) -> str:
    """The report as markdown: a row per model and way of computing, with the rule it was judged by."""
    from tritonkit.int8.evaluate import EXACT_COSINE

    how = "run natively" if report.get("native") else f"emulated as QEMU `{report['cpu_model']}`"
    lines = [f"CPU class {report['cpu_class']} {how} on {report['host']}, "
             f"{report['date']}, against onnxruntime as served here. Rules: `{EXACT}`, cosine min >= "
             f"{EXACT_COSINE} to it (static int8 operands); `{GATES}`, the served accuracy gates against the FP32 "
             "graph (run-time quantized nodes, whose codes follow float rounding).", "",
             "| model (rows) | computed as | cosine min | largest difference | same runtime here | rule | "
             "gate metrics | holds |",
             "|---|---|---:|---:|---:|---|---|---|"]
    for name, rec in report["models"].items():
        for way, e in rec.get("ways", {}).items():
            same = "" if "max_abs_to_here" not in e else ("bitwise" if e["max_abs_to_here"] == 0 else
                                                           f"{e['max_abs_to_here']:.2g}")
            top1 = f" (top-1 {e['top1_agreement']:.2f})" if "top1_agreement" in e else ""
            metrics = ", ".join(f"{k} {v:.4f}" for k, v in e["gates"]["metrics"].items()) if "gates" in e else ""
            lines.append(f"| {name} ({rec['rows']}) | {way} | {e['cosine_min']:.6f}{top1} | {e['max_abs']:.3g} | "
                         f"{same} | {rec['rule']} | {metrics} | {_verdict(rec['rule'], e)} |")
        if "here" in rec:
            here = ", ".join(f"{k} {v:.4f}" for k, v in rec["here"].items())
            lines.append(f"| {name} ({rec['rows']}) | onnxruntime as served here | – | – | – | {rec['rule']} | "
                         f"{here} | (reference) |")
        for why in ("skipped", "error"):
            if why in rec:
                lines.append(f"| {name} | – | – | – | – | {rec.get('rule', '–')} | – | {why}: {rec[why]} |")
    return "\n".join(lines)


def failed(report: Mapping) -> list[str]:
    """The models onnxruntime as served on the class fails by their file's rule (or that could not be judged)."""
    return [name for name, rec in report["models"].items()
            if "error" in rec or ("ways" in rec and not rec["ways"]["onnxruntime"]["holds"])]


def check(names: Sequence[str], cpu_class: str = "avx2", rows: int = 16) -> int:
    import datetime

    from tritonkit import envinfo, kinds, paths

    why = unavailable(cpu_class)
    if why is not None:
        print(f"[emulated] cannot emulate a {cpu_class} CPU: {why}", file=sys.stderr)
        return 2
    report = {"cpu_class": cpu_class, "cpu_model": CPU_MODELS[cpu_class], "date": datetime.date.today().isoformat(),
              "host": envinfo.cpu_model(), "rows": rows, "native": native(cpu_class), "models": {}}
    for name in names or kinds.names():
        how = "natively (this host is one)" if report["native"] else "emulated"
        print(f"[emulated] {name}: running its INT8 file on a {cpu_class} CPU, {how}", flush=True)
        report["models"][name] = check_model(kinds.get(name), cpu_class, rows)
    out = paths.BUILD_OUTPUTS / "reports" / f"int8_{cpu_class}_emulated.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(table(report) + f"\n\n[emulated] report -> {paths.rel(out)}")
    bad = failed(report)
    if bad:
        print(f"[emulated] onnxruntime as served on a {cpu_class} CPU misses its file's rule: {', '.join(bad)}")
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.emulated", description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    c = steps.add_parser("check", help="each model's served INT8 file on an emulated CPU class, judged exact or "
                         "by its accuracy gates")
    c.add_argument("names", nargs="*", help="model specs (default: all)")
    c.add_argument("--cpu-class", default="avx2", choices=sorted(CPU_MODELS))
    c.add_argument("--rows", type=int, default=16, help="test-split rows per model (emulation runs ~200x slower)")
    r = steps.add_parser("run", help="inside the emulator: the bundle's rows computed every way")
    r.add_argument("directory", type=Path)
    r.add_argument("--cpu-class", default="avx2", choices=sorted(CPU_MODELS))
    args = parser.parse_args(argv)
    if args.step == "run":
        run(args.directory, args.cpu_class)
        return 0
    return check(args.names, args.cpu_class, args.rows)


if __name__ == "__main__":
    sys.exit(main())
