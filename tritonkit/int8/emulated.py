"""The served INT8 files' arithmetic on another x86 class's own kernels, on this machine: QEMU's user-mode emulator
(`qemu-x86_64 -cpu MODEL`, Debian's qemu-user) answers CPUID as that CPU, and onnxruntime's MLAS and OpenVINO's
oneDNN pick their kernels by CPUID, so the class's integer kernels really run (TCG emulates AVX2 since QEMU 7.2,
not AVX-512). Numerics only: emulated time says nothing about the class's speed.

    python -m tritonkit.int8.emulated check [MODEL ...] [--cpu-class avx2] [--rows N]   # make check-cpu-classes

Per model with an INT8 file under its INT8 name, a few rows of the test split run here (each runtime as served;
on a VNNI host onnxruntime's int8 products are summed exactly in int32) and under the emulator (each runtime as a
replica of the class serves it, the session an INT8 search there judges in, and onnxruntime's default session,
which sums u8s8 pairs in saturating int16 without VNNI). The report says which compute what onnxruntime computes
here (evaluate.EXACT_COSINE); 1 where onnxruntime as served there does not, 2 where the emulator is missing.
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
    """The file served under `kind`'s INT8 name where it holds INT8 nodes (None: unbuilt or an FP32 fallback)."""
    from tritonkit import paths
    from tritonkit.int8.checks import quantized_ops

    path = paths.model_file(kind.INT8_MODEL)
    return path if path.exists() and quantized_ops(path) else None


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


def check_model(kind, cpu_class: str, rows: int) -> dict:
    """One model's record: per way of computing on the emulated class, its outputs against onnxruntime as served
    here (on a VNNI host: int8 products summed exactly in int32) and, where it is a served runtime, against itself
    here."""
    from tritonkit import paths
    from tritonkit.int8.evaluate import EXACT_COSINE, cosine_min, run_variant

    path = int8_file(kind)
    if path is None:
        return {"skipped": "no INT8 file under its INT8 name (unbuilt, or an FP32 fallback)"}
    batches = pick_rows(kind, rows)
    here = {v: run_variant(v, path, batches, THREADS) for v in SERVED}
    exact = here["onnxruntime"]
    emulated = emulated_outputs(path, batches, cpu_class)
    record: dict = {"file": paths.rel(path), "rows": len(exact), "ways": {}}
    for way, got in emulated.items():
        cos = cosine_min(got, exact)
        entry = {"cosine_min": round(cos, 6), "max_abs": float(np.abs(got - exact).max()), "exact": cos >= EXACT_COSINE}
        if way in here:
            entry["max_abs_to_here"] = float(np.abs(got - here[way]).max())
        if any(t.metric == "top1_agreement" for t in kind.TARGETS):  # a classifier: does the answer move
            entry["top1_agreement"] = float((got.argmax(1) == exact.argmax(1)).mean())
        record["ways"][way] = entry
    return record


def table(report: Mapping) -> str:
    """The report as markdown: a row per model and way of computing."""
    how = "run natively" if report.get("native") else f"emulated as QEMU `{report['cpu_model']}`"
    lines = [f"CPU class {report['cpu_class']} {how} on {report['host']}, "
             f"{report['date']}, against onnxruntime as served here.", "",
             "| model (rows) | computed as | cosine min | largest difference | same runtime here | exact |",
             "|---|---|---:|---:|---:|---|"]
    for name, rec in report["models"].items():
        for way, e in rec.get("ways", {}).items():
            same = "" if "max_abs_to_here" not in e else ("bitwise" if e["max_abs_to_here"] == 0 else
                                                           f"{e['max_abs_to_here']:.2g}")
            top1 = f" (top-1 {e['top1_agreement']:.2f})" if "top1_agreement" in e else ""
            lines.append(f"| {name} ({rec['rows']}) | {way} | {e['cosine_min']:.6f}{top1} | {e['max_abs']:.3g} | "
                         f"{same} | {'yes' if e['exact'] else '**no**'} |")
        if "skipped" in rec:
            lines.append(f"| {name} | – | – | – | – | skipped: {rec['skipped']} |")
    return "\n".join(lines)


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
    served = [r["ways"]["onnxruntime"]["exact"] for r in report["models"].values() if "ways" in r]
    return 0 if all(served) else 1


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tritonkit.int8.emulated", description=__doc__.splitlines()[0])
    steps = parser.add_subparsers(dest="step", required=True)
    c = steps.add_parser("check", help="each model's served INT8 file on an emulated CPU class against exact int32")
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
