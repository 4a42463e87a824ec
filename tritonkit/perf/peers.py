"""Peers: what a user would run instead of tritonkit, measured the way our server is.

- Peer *servers* (Infinity, on sentence-transformers' own ONNX qint8 export of the same model),
  sentence-transformers' ONNX backend and its OpenVINO backend (FP32, and static INT8 by NNCF on calibration texts
  the caller passes) each live in their own virtualenv under build/peers/, installed on demand with uv from a
  committed lock (perf/peers/<name>.lock: every package pinned with hashes, torch the project's own CPU pin), so
  their dependencies never touch the project's venv and every machine measures the same releases.
- One native HTTP load generator for every server (`http_point`, driving wrk): closed loop, N keep-alive
  connections, one text per request, the same real texts; our server is called on Triton's HTTP/REST
  (KServe v2) infer endpoint of the ensemble, Infinity on its OpenAI-style /embeddings.
- In-process runners that must execute inside a peer venv (`python -m tritonkit.perf.peers st-run ...`) print one
  JSON PerfPoint timed by `tritonkit.perf.analyzer.time_in_process`, like every other baseline.

Only the standard library is imported at module level: the st-run entry point runs under the peer venv's Python.

    python -m tritonkit.perf.peers install infinity      # create build/peers/infinity from perf/peers/infinity.lock
    python -m tritonkit.perf.peers install st-openvino   # sentence-transformers on OpenVINO, NNCF
    python -m tritonkit.perf.peers status                # what is installed
    python -m tritonkit.perf.peers lock [names]          # re-resolve the locks (`make lock` runs it)

The locks' torch is the project's CPU build (requirements.lock), found where pip finds it (pip's find-links, as
`make setup` does), so no peer pulls the multi-GB CUDA wheels or needs an index beyond the project's own.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import TritonkitError
from tritonkit.perf.analyzer import PerfPoint, time_in_process

# Peer venvs, exports and logs; TRITONKIT_PEERS_DIR moves them (a disk with room: the venvs hold ~3 GB).
PEERS_DIR = Path(os.environ.get("TRITONKIT_PEERS_DIR") or paths.BUILD_OUTPUTS / "peers")
LOCKS_DIR = paths.ROOT / "perf" / "peers"  # committed locks, one per peer venv
INFINITY_VERSION = "0.0.78"
# sentence-transformers' x86 dynamic-qint8 exports (export_dynamic_quantized_onnx_model): every one runs on every
# x86 CPU, but their weights differ (u8 or s8, reduced range), so accuracy and speed differ per CPU class
# (without VNNI, s8 weights saturate in int16); the lab measures each and serves the best (choose_qint8).
# Values: the weights' type, which names the exported file (optimum's AutoQuantizationConfig: u8 for avx2).
QINT8_CONFIGS = {"avx2": "quint8", "avx512": "qint8", "avx512_vnni": "qint8"}
QINT8_EVAL_TEXTS = 512  # held-out validation texts each export is judged on against sentence-transformers FP32
ST_OV_FP32_FILE = "openvino/openvino_model.xml"  # where sentence-transformers saves its OpenVINO export
ST_OV_INT8_FILE = "openvino/openvino_model_int8_nncf.xml"  # beside it; "openvino*.xml" so ST's loader finds it
ST_OV_INT8_META = "openvino/openvino_model_int8_nncf.json"  # calibration and timing of the quantization
CALIBRATION_TEXTS = 300  # nncf.quantize's subset_size: NNCF's default, and what the lab passes
STARTUP_S = 240.0
ST_VERSION = "6.2.0"
ST_ONNX_VERSION = "5.7.0"
OPTIMUM_INTEL_VERSION = "2.2.0"
OPENVINO_VERSION = "2026.4.1"
NNCF_VERSION = "3.4.0"


# optimum 2 (optimum-onnx) rejects the file path Infinity passes, 1.27 imports torch.onnx internals torch 2.13 no
# longer has; 1.24 (Infinity's minimum) imports, with transformers<4.49.
INFINITY_REQUIREMENTS = (f"infinity-emb[server,optimum]=={INFINITY_VERSION}", "optimum[onnxruntime]==1.24.0",
                         "transformers<4.49")


class PeerUnavailable(TritonkitError, RuntimeError):
    """A peer cannot be measured here (not installed and cannot be, or it failed to start); says why."""


@dataclass(frozen=True)
class PeerEnv:
    name: str
    requirements: tuple[str, ...]  # top-level pins; `python -m tritonkit.perf.peers lock` resolves them into `lock`
    module: str  # imported to prove the venv works
    excludes: tuple[str, ...] = ()  # dependencies left out of the resolution (uv pip compile --excludes)

    @property
    def dir(self) -> Path:
        return PEERS_DIR / self.name

    @property
    def lock(self) -> Path:
        return LOCKS_DIR / f"{self.name}.lock"

    @property
    def python(self) -> Path:
        return self.dir / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.dir / ".tritonkit-installed"


ENVS = {
    "infinity": PeerEnv("infinity", INFINITY_REQUIREMENTS, "infinity_emb"),
    # Infinity's OpenVINO form: the same server on ONNX Runtime's OpenVINO execution provider, which its optimum
    # engine picks on a CPU whenever it is installed (onnxruntime-openvino ships the `onnxruntime` module itself).
    "infinity-openvino": PeerEnv("infinity-openvino", (*INFINITY_REQUIREMENTS, "onnxruntime-openvino"),
                                 "infinity_emb", excludes=("onnxruntime",)),
    # 5.7 is the newest release whose [onnx] extra resolves (6.x needs transformers 5, optimum-onnx caps it at 4.58).
    "sentence-transformers": PeerEnv("sentence-transformers", (f"sentence-transformers[onnx]=={ST_ONNX_VERSION}",),
                                     "sentence_transformers"),
    # Pinned to the releases the numbers were measured with (optimum-intel 2.2 caps transformers below 5.6).
    # torchvision is left out: optimum-intel requires it only for vision-language models, and PyPI's build links
    # CUDA torch, so beside a CPU torch it breaks `import transformers` (operator torchvision::nms does not exist).
    "st-openvino": PeerEnv("st-openvino", (f"sentence-transformers[openvino]=={ST_VERSION}",
                                           f"optimum-intel[openvino]=={OPTIMUM_INTEL_VERSION}",
                                           f"openvino=={OPENVINO_VERSION}", f"nncf=={NNCF_VERSION}"),
                           "sentence_transformers, optimum.intel.openvino, nncf", excludes=("torchvision",)),
}


# The peers `make perf-peers` measures (the names --skip-peer takes) and the venvs each needs.
PEERS = {"infinity": ("infinity", "sentence-transformers"),  # serves sentence-transformers' qint8 export
         "st-qint8": ("sentence-transformers",),
         "st-openvino-fp32": ("st-openvino",),
         "st-openvino-int8": ("st-openvino",)}


def prepare(names: Sequence[str], install: bool = True, progress: Callable[[str], None] = print) -> dict[str, str]:
    """Installs the venvs the peers `names` need (before any measuring, so a run that cannot have them stops at
    once); {peer: why it cannot be had} for those that fail."""
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    failed, broken = {}, {}
    for name in names:
        for env in PEERS[name]:
            if env not in broken:
                try:
                    ensure(env, install, progress)
                    broken[env] = ""
                except PeerUnavailable as e:
                    broken[env] = str(e)
            if broken[env]:
                failed[name] = broken[env]
                break
    return failed


def project_torch() -> str:
    """The torch pin of the project's own lock (requirements.lock): every peer venv gets the same CPU build."""
    lock = paths.ROOT / "requirements.lock"
    for line in lock.read_text().splitlines():
        if line.startswith("torch=="):
            return line.split()[0]
    raise PeerUnavailable(f"no torch pin in {paths.rel(lock)}")


def pip_find_links() -> list[str]:
    """pip's configured find-links (where the CPU torch wheel of the project's lock comes from); uv reads no pip
    configuration, so they are handed to it, as scripts/lock.sh does for the project's own lock."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    links: list[str] = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in value.strip("'\"").split() if v not in links]
    return links


def _links_args() -> list[str]:
    return [arg for link in pip_find_links() for arg in ("--find-links", link)]


def _stamp(env: PeerEnv) -> str:
    import hashlib

    return hashlib.sha256(env.lock.read_bytes()).hexdigest() if env.lock.exists() else "no lock"


def installed(env: PeerEnv) -> bool:
    return env.python.exists() and env.marker.exists() and env.marker.read_text() == _stamp(env)


def _uv() -> list[str]:
    uv = paths.venv_bin() / "uv"
    if uv.exists():
        return [str(uv)]
    found = shutil.which("uv")
    if found:
        return [found]
    raise PeerUnavailable("uv is not installed (pip install uv); it creates the peer virtualenvs")


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-6:])
        raise PeerUnavailable(f"{what} failed:\n{tail}")


def write_lock(name: str, progress: Callable[[str], None] = print) -> Path:
    """Resolve peer `name`'s requirements (plus the project's torch pin) into its committed lock, hashes included,
    for the platform scripts/setup.sh supports."""
    env = ENVS[name]
    env.lock.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tritonkit-peers-") as tmp:
        requirements, excludes = Path(tmp) / f"{name}.in", Path(tmp) / "excludes.txt"
        requirements.write_text("".join(f"{r}\n" for r in (*env.requirements, project_torch())))
        excludes.write_text("".join(f"{e}\n" for e in env.excludes))
        # Run where the input lies, named relatively: the lock's "via" comments then name no temporary path.
        _run([*_uv(), "pip", "compile", requirements.name, "--output-file", str(env.lock.resolve()),
              "--generate-hashes", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_36", "--quiet",
              "--custom-compile-command", f"python -m tritonkit.perf.peers lock {name}", *_links_args(),
              *(["--excludes", str(excludes)] if env.excludes else [])], f"{name}: locking", cwd=Path(tmp))
    progress(f"[peers] wrote {paths.rel(env.lock)}")
    return env.lock


def ensure(name: str, install: bool = True, progress: Callable[[str], None] = print) -> Path:
    """The Python of peer venv `name`, installed from its committed lock if missing (or the lock changed) and
    `install`; PeerUnavailable says why not."""
    env = ENVS[name]
    if installed(env):
        return env.python
    if not install:
        raise PeerUnavailable(f"{name}: not installed in {paths.rel(env.dir)} (python -m tritonkit.perf.peers install "
                              f"{name}, or make perf-peers)")
    if not env.lock.exists():
        raise PeerUnavailable(f"{name}: no lock at {paths.rel(env.lock)} (python -m tritonkit.perf.peers lock {name})")
    uv = _uv()
    progress(f"[peers] installing {name} into {paths.rel(env.dir)} from {paths.rel(env.lock)} ...")
    _run([*uv, "venv", "--clear", str(env.dir), "--python", sys.executable], f"{name}: creating its venv")
    _run([*uv, "pip", "sync", "--python", str(env.python), "--require-hashes", str(env.lock), *_links_args()],
         f"{name}: installing {paths.rel(env.lock)} (offline, or a pinned file this index lacks?)")
    check = subprocess.run([str(env.python), "-c", f"import {env.module}"], capture_output=True, text=True)
    if check.returncode != 0:
        raise PeerUnavailable(f"{name}: installed but `import {env.module}` fails: "
                              f"{check.stderr.strip().splitlines()[-1:]}")
    env.marker.write_text(_stamp(env))
    return env.python


def peer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for peer processes: offline hub, caches under build/peers/, no telemetry, tritonkit importable."""
    env = dict(os.environ if base is None else base)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(PEERS_DIR / "hf-home"),
               INFINITY_ANONYMOUS_USAGE_STATS="0", DO_NOT_TRACK="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(paths.ROOT), env.get("PYTHONPATH", "")) if p)
    return env


# -- sentence-transformers' own ONNX export (runs inside the sentence-transformers venv) ----------------------


def st_export_dir(model_dir: Path) -> Path:
    return PEERS_DIR / "st-onnx" / Path(model_dir).parent.name


def qint8_file(config: str) -> str:
    """Where sentence-transformers saves its qint8 export for `config` (QINT8_CONFIGS), inside the model folder."""
    return f"onnx/model_{QINT8_CONFIGS[config]}_{config}.onnx"


def st_export(model_dir: Path, out: Path, config: str) -> Path:
    """sentence-transformers' ONNX export of `model_dir` and its dynamic qint8 quantization for `config`, cached in
    `out` (the model's files + onnx/model.onnx + the file qint8_file names)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.backend import export_dynamic_quantized_onnx_model

    if not (out / qint8_file(config)).exists():
        model = SentenceTransformer(str(model_dir), backend="onnx", device="cpu")
        if not (out / "onnx" / "model.onnx").exists():
            model.save(str(out))
        export_dynamic_quantized_onnx_model(model, config, str(out))
    return out / qint8_file(config)


def st_openvino_dir(model_dir: Path) -> Path:
    return PEERS_DIR / "st-openvino-ir" / Path(model_dir).parent.name


def _ov_config(threads: int) -> dict:
    # Only the thread count is set: optimum-intel's own default hint (LATENCY, one stream) is what a user gets.
    return {"INFERENCE_NUM_THREADS": threads}


def st_openvino_export(model_dir: Path, out: Path, threads: int) -> Path:
    """sentence-transformers' OpenVINO export of `model_dir` (optimum-intel, FP32 IR), saved once in `out` (the
    model's files + openvino/openvino_model.xml)."""
    from sentence_transformers import SentenceTransformer

    if not (out / ST_OV_FP32_FILE).exists():
        model = SentenceTransformer(str(model_dir), backend="openvino", device="cpu",
                                    model_kwargs={"ov_config": _ov_config(threads)})
        model.save(str(out))
    return out / ST_OV_FP32_FILE


def _calibration_key(texts: Sequence[str], max_length: int) -> str:
    import hashlib

    from nncf import __version__ as nncf_version

    return hashlib.sha256(json.dumps([nncf_version, max_length, list(texts)]).encode()).hexdigest()


def st_openvino_quantize(out: Path, calibration: Sequence[str], max_length: int, threads: int) -> dict:
    """NNCF static INT8 of the FP32 IR in `out` (ModelType.TRANSFORMER: SmoothQuant + bias correction), calibrated
    on `calibration` (at most CALIBRATION_TEXTS), one text per sample tokenized by the model's own preprocessing
    into the feeds the IR takes; saved beside the FP32 IR. Cached while the calibration texts are the same; returns
    {"calibration_texts", "quantize_s", "nncf"} of the quantization that made the file."""
    import openvino as ov
    from nncf import Dataset, ModelType, quantize
    from nncf import __version__ as nncf_version
    from sentence_transformers import SentenceTransformer

    texts = list(calibration)[:CALIBRATION_TEXTS]
    if not texts:
        raise PeerUnavailable("OpenVINO INT8: no calibration texts (pass calibration=...)")
    key = _calibration_key(texts, max_length)
    meta_file = out / ST_OV_INT8_META
    if (out / ST_OV_INT8_FILE).exists() and meta_file.exists():
        meta = json.loads(meta_file.read_text())
        if meta.get("key") == key:
            return meta
    fp32 = SentenceTransformer(str(out), backend="openvino", device="cpu",
                               model_kwargs={"file_name": ST_OV_FP32_FILE, "ov_config": _ov_config(threads)})
    fp32.max_seq_length = max_length
    model = ov.Core().read_model(out / ST_OV_FP32_FILE)
    inputs = {i.get_any_name() for i in model.inputs}

    def feed(text: str) -> dict:
        # The tensors sentence-transformers itself hands the IR (input_ids, attention_mask, token_type_ids).
        return {k: v.numpy() for k, v in fp32.preprocess([text]).items() if k in inputs}

    start = time.perf_counter()
    quantized = quantize(model, Dataset(texts, feed), model_type=ModelType.TRANSFORMER, subset_size=len(texts))
    seconds = time.perf_counter() - start
    # FP32 storage as sentence-transformers' own export is saved (optimum-intel: compress_to_fp16=False).
    ov.save_model(quantized, out / ST_OV_INT8_FILE, compress_to_fp16=False)
    meta = {"key": key, "calibration_texts": len(texts), "quantize_s": round(seconds, 2), "nncf": nncf_version}
    meta_file.write_text(json.dumps(meta))
    return meta


def _st_model(args: argparse.Namespace, threads: int):
    """The SentenceTransformer of `args.variant` and its label (runtime, version, precision)."""
    from importlib.metadata import version

    from sentence_transformers import SentenceTransformer

    st = f"sentence-transformers {version('sentence-transformers')}"
    out = Path(args.cache)
    if args.variant == "qint8":
        st_export(Path(args.model_dir), out, args.quant_config)
        model = SentenceTransformer(str(out), backend="onnx", device="cpu",
                                    model_kwargs={"file_name": qint8_file(args.quant_config)})
        return model, f"{st} ONNX Runtime {version('onnxruntime')} qint8 ({args.quant_config} export)"
    if args.variant == "fp32":
        return SentenceTransformer(str(args.model_dir), device="cpu"), f"{st} torch {version('torch')} FP32"
    ov = f"{st} OpenVINO {version('openvino')}"
    st_openvino_export(Path(args.model_dir), out, threads)
    if args.variant == "openvino-fp32":
        file, label = ST_OV_FP32_FILE, f"{ov} FP32"
    else:
        calibration = json.loads(Path(args.calibration).read_text()) if args.calibration else []
        meta = st_openvino_quantize(out, calibration, args.max_length, threads)
        file = ST_OV_INT8_FILE
        label = (f"{ov} INT8 (NNCF {meta['nncf']} static, {meta['calibration_texts']} calibration texts, "
                 f"quantized in {meta['quantize_s']:.0f} s)")
    model = SentenceTransformer(str(out), backend="openvino", device="cpu",
                                model_kwargs={"file_name": file, "ov_config": _ov_config(threads)})
    return model, label


def _st_run(args: argparse.Namespace) -> int:
    """Times sentence-transformers (torch FP32, its ONNX qint8, its OpenVINO FP32 or NNCF static INT8) on the given
    texts; prints one PerfPoint per batch size as JSON lines, or with --embed writes the texts' embeddings."""
    import torch

    from tritonkit.serving.backend_utils import usable_cpus

    threads = usable_cpus()
    torch.set_num_threads(threads)
    texts = json.loads(Path(args.texts).read_text())
    model, label = _st_model(args, threads)
    model.max_seq_length = args.max_length
    if args.embed:
        embeddings = model.encode(texts, batch_size=32, normalize_embeddings=True)
        Path(args.embed).write_text(json.dumps({"label": label, "embeddings": embeddings.tolist()}))
        return 0
    _print_points(model.encode, texts, args.batches, args.seconds, label)
    return 0


def _print_points(run: Callable, items: Sequence, batches: Sequence[int], seconds: float, label: str) -> None:
    """One PerfPoint a batch size as a JSON line: run(batch of items, batch_size=b) back to back, items/s."""
    for batch in batches:
        groups = [items[i : i + batch] for i in range(0, len(items) - batch + 1, batch)]
        point = time_in_process(lambda g, b=batch: run(g, batch_size=b), groups, 1, duration_s=seconds, warmup=1,
                                items_per_call=batch, label=f"{label}, batch {batch}")
        print(json.dumps(point.to_json()), flush=True)


ST_VARIANTS = {  # st-run --variant -> the peer venv it runs in
    "qint8": "sentence-transformers",
    "fp32": "sentence-transformers",
    "openvino-fp32": "st-openvino",
    "openvino-int8": "st-openvino",
}


def _st_cache(variant: str, model_dir: Path) -> Path:
    return st_openvino_dir(model_dir) if variant.startswith("openvino") else st_export_dir(model_dir)


def _st_subprocess(variant: str, texts: Sequence[str], model_dir: Path, max_length: int, extra: Sequence[str],
                   calibration: Sequence[str], cache: Path | None, install: bool) -> str:
    """Runs `st-run` for `variant` in its peer venv, texts (and calibration texts) passed through files; its stdout."""
    import tempfile

    if variant not in ST_VARIANTS:
        raise ValueError(f"unknown sentence-transformers variant {variant!r} (known: {', '.join(ST_VARIANTS)})")
    if variant == "openvino-int8" and not calibration:
        raise ValueError("openvino-int8 needs calibration texts (disjoint from the timed texts)")
    python = ensure(ST_VARIANTS[variant], install)
    with tempfile.TemporaryDirectory(prefix="tritonkit-peers-") as tmp:
        texts_file = Path(tmp) / "texts.json"
        texts_file.write_text(json.dumps(list(texts)))
        cmd = [str(python), "-m", "tritonkit.perf.peers", "st-run", "--variant", variant, "--model-dir", str(model_dir),
               "--cache", str(cache or _st_cache(variant, model_dir)), "--texts", str(texts_file), "--max-length",
               str(max_length), *extra]
        if calibration:
            calibration_file = Path(tmp) / "calibration.json"
            calibration_file.write_text(json.dumps(list(calibration)))
            cmd += ["--calibration", str(calibration_file)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), cwd=paths.ROOT)
    if proc.returncode != 0:
        raise PeerUnavailable(f"sentence-transformers {variant} failed:\n"
                              + "\n".join(proc.stderr.strip().splitlines()[-8:]))
    return proc.stdout


def st_points(texts: Sequence[str], model_dir: Path, max_length: int, variant: str, batches: Sequence[int],
              seconds: float, install: bool = True, calibration: Sequence[str] = (),
              cache: Path | None = None, quant_config: str = "avx2") -> list[PerfPoint]:
    """sentence-transformers `variant` (ST_VARIANTS: "qint8" its ONNX qint8 export, "fp32" torch, "openvino-fp32"
    its OpenVINO export, "openvino-int8" that export statically quantized by NNCF on `calibration`) at each batch
    size, in its own venv; one PerfPoint per batch size. Exports are cached in `cache` (default under
    build/peers/)."""
    out = _st_subprocess(variant, texts, model_dir, max_length,
                         ["--seconds", str(seconds), "--batches", *map(str, batches), "--quant-config", quant_config],
                         calibration, cache, install)
    return [PerfPoint(**json.loads(line)) for line in out.splitlines() if line.startswith("{")]


def st_embeddings(texts: Sequence[str], model_dir: Path, max_length: int, variant: str, install: bool = True,
                  calibration: Sequence[str] = (), cache: Path | None = None,
                  quant_config: str = "avx2") -> tuple[str, list[list[float]]]:
    """The L2-normalised embeddings sentence-transformers `variant` gives `texts` in its venv, and its label."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="tritonkit-peers-") as tmp:
        embed = Path(tmp) / "embeddings.json"
        _st_subprocess(variant, texts, model_dir, max_length, ["--embed", str(embed), "--quant-config", quant_config],
                       calibration, cache, install)
        got = json.loads(embed.read_text())
    return got["label"], got["embeddings"]


def _median(values: Sequence[float]) -> float:
    import statistics

    return statistics.median(values)


def choose_qint8(kind, seconds: float = 3.0, rounds: int = 2, install: bool = True,
                 progress: Callable[[str], None] = print) -> dict:
    """sentence-transformers' qint8 export in its best form for this CPU. Every QINT8_CONFIGS export is judged on
    QINT8_EVAL_TEXTS held-out texts against sentence-transformers FP32 with the kind's gate metrics; an export
    holds when each metric is within the kind's floor slack of the most accurate export's (the peer is judged
    against its own best, as our INT8 is against its floor: a saturating export falls out). The fastest export
    that holds (batch 32, median of `rounds` interleaved runs) is chosen.
    Cached per CPU class under build/peers/ while the texts, the settings and the peer's lock are the same."""
    import datetime
    import hashlib

    import numpy as np

    from tritonkit import data, envinfo

    evaluation, timed = data.eval_texts("validation")[:QINT8_EVAL_TEXTS], data.split("benchmark")
    cpu = envinfo.int8_class()
    cache = st_export_dir(kind.model_dir()) / f"qint8-choice.{cpu}.json"
    key = hashlib.sha256(json.dumps([_stamp(ENVS["sentence-transformers"]), evaluation, timed, QINT8_CONFIGS,
                                     seconds, rounds, envinfo.cpu_flags()]).encode()).hexdigest()
    if cache.exists() and json.loads(cache.read_text()).get("key") == key:
        return json.loads(cache.read_text())
    progress(f"[peers] sentence-transformers qint8 exports {', '.join(QINT8_CONFIGS)}: accuracy on "
             f"{len(evaluation)} validation texts against its FP32 ...")
    ref = kind.sentence_transformer().encode(evaluation, batch_size=32, normalize_embeddings=True)
    forms: dict[str, dict] = {}
    for config in QINT8_CONFIGS:
        label, got = st_embeddings(evaluation, kind.model_dir(), kind.MAX_LENGTH, "qint8", install,
                                   quant_config=config)
        forms[config] = {"label": label, "accuracy": kind.gate_metrics(ref, np.asarray(got, np.float32))}
    best = {m: max(f["accuracy"][m] for f in forms.values()) for m in kind.FLOOR_SLACK}
    for f in forms.values():
        short = [f"{m} {f['accuracy'][m]:.4f} < {best[m] - slack:.4f} (best export {best[m]:.4f} - {slack})"
                 for m, slack in kind.FLOOR_SLACK.items() if f["accuracy"][m] < best[m] - slack]
        f["why_not"] = short
        f["holds"] = not f["why_not"]
    timed_forms = [c for c, f in forms.items() if f["holds"]]
    speeds: dict[str, list[float]] = {c: [] for c in timed_forms}
    for r in range(rounds):
        for config in timed_forms:
            progress(f"[peers] qint8 {config} export, batch 32, round {r + 1}/{rounds} ...")
            (point,) = st_points(timed, kind.model_dir(), kind.MAX_LENGTH, "qint8", [32], seconds, install,
                                 quant_config=config)
            speeds[config].append(point.throughput)
    for config, runs in speeds.items():
        forms[config]["texts_per_s"] = round(_median(runs), 1)
        forms[config]["runs"] = [round(v, 1) for v in runs]
    chosen = max(timed_forms, key=lambda c: forms[c]["texts_per_s"])
    held = timed_forms
    reason = f"the fastest of the exports whose accuracy holds ({', '.join(held)})"
    out = {"key": key, "cpu_class": cpu, "cpu": envinfo.cpu_model(), "date": datetime.date.today().isoformat(),
           "chosen": chosen, "reason": reason, "eval_texts": len(evaluation), "forms": forms}
    cache.write_text(json.dumps(out, indent=2))
    return out


# -- peer servers ------------------------------------------------------------------------------------------


def _free_port() -> int:
    from tritonkit.runtime.server import free_port

    return free_port()


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Poll `url` until it answers 200; PeerUnavailable (with the log's tail) if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            raise PeerUnavailable(f"peer server exited with {proc.returncode} before it was ready:\n{tail}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                return
        time.sleep(1.0)
    raise PeerUnavailable(f"peer server not ready at {url} after {timeout_s:.0f} s (log: {paths.rel(log)})")


@dataclass
class PeerServer:
    """A running HTTP embedding server and how to call it with one text."""

    label: str
    host: str
    port: int
    path: str
    body: Callable[[str], bytes]
    embedding: Callable[[dict], list[float]]  # the one embedding out of a response


def infinity_model_dir(model_dir: Path, config: str) -> Path:
    """The model directory Infinity serves: the sentence-transformers files and only the qint8 ONNX file of
    `config` (its optimum engine picks the single .onnx it finds)."""
    src = st_export_dir(model_dir)
    out = PEERS_DIR / "infinity-model" / f"{src.name}-{config}"
    if (out / qint8_file(config)).exists():
        return out
    for f in src.rglob("*"):
        if f.is_file() and not (f.suffix == ".onnx" and f.name != Path(qint8_file(config)).name):
            dst = out / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    return out


INFINITY_FORMS = {"onnxruntime": "infinity", "openvino": "infinity-openvino"}  # form -> its peer venv


@contextlib.contextmanager
def infinity(model_dir: Path, name: str, pooling: str = "mean", batch_size: int = 32, install: bool = True,
             log_dir: Path | None = None, config: str = "avx2",
             form: str = "onnxruntime") -> Iterator[PeerServer]:
    """Infinity's server (optimum engine, CPU) on sentence-transformers' qint8 export `config` of `model_dir`, on a
    free loopback port, in `form` (INFINITY_FORMS: ONNX Runtime's CPU provider, or its OpenVINO provider); stopped
    on exit. `pooling` is the model's own (its optimum engine otherwise falls back to CLS pooling, whose
    embeddings disagree with the model's)."""
    python = ensure(INFINITY_FORMS[form], install)
    if not (st_export_dir(model_dir) / qint8_file(config)).exists():
        raise PeerUnavailable(f"the sentence-transformers qint8 export {config} is missing "
                              "(st_points(..., 'qint8') makes it)")
    served = infinity_model_dir(model_dir, config)
    with _infinity_process(python, served, name, form, ["--pooling-method", pooling], batch_size,
                           (log_dir or PEERS_DIR) / f"infinity-{form}.log") as port:
        provider = "OpenVINO EP" if form == "openvino" else "CPU EP"
        yield PeerServer(f"Infinity {INFINITY_VERSION} (ONNX Runtime {provider}, qint8 {config} export, "
                         "HTTP /embeddings)", "127.0.0.1", port,
                         "/embeddings", lambda t: json.dumps({"model": name, "input": [t]}).encode(),
                         lambda r: r["data"][0]["embedding"])


@contextlib.contextmanager
def _infinity_process(python: Path, served: Path, name: str, form: str, extra: Sequence[str], batch_size: int,
                      log: Path) -> Iterator[int]:
    """Infinity's server (optimum engine, CPU) on the directory `served`, on a free loopback port (yielded) until
    it answers /health; stopped on exit."""
    port = _free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [str(python.parent / "infinity_emb"), "v2", "--model-id", str(served), "--served-model-name", name,
           "--engine", "optimum", "--device", "cpu", *extra, "--batch-size", str(batch_size),
           "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=peer_env(), cwd=PEERS_DIR,
                                start_new_session=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, log, STARTUP_S)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- sequence classifiers: rerankers and text classifiers (perf/bench_cross_encoders.py) ---------------------

CE_FP32 = "fp32"  # a CrossEncoder form: torch FP32, "onnx" its ONNX export, or a QINT8_CONFIGS name (qint8 export)


def ce_export_dir(model_dir: Path) -> Path:
    return PEERS_DIR / "ce-onnx" / Path(model_dir).name


def ce_onnx_file(form: str) -> str:
    """The file of CrossEncoder `form` ("onnx" or a QINT8_CONFIGS name) inside its export directory."""
    return "onnx/model.onnx" if form == "onnx" else qint8_file(form)


def ce_export(model_dir: Path, out: Path, form: str) -> Path:
    """sentence-transformers' CrossEncoder ONNX export of `model_dir` (optimum) and, for a QINT8_CONFIGS `form`,
    its dynamic qint8 quantization, cached in `out` (the model's files + the file ce_onnx_file names)."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.backend import export_dynamic_quantized_onnx_model

    if not (out / ce_onnx_file(form)).exists():
        model = CrossEncoder(str(model_dir), backend="onnx", device="cpu")
        if not (out / "onnx" / "model.onnx").exists():
            model.save(str(out))
        if form != "onnx":
            export_dynamic_quantized_onnx_model(model, form, str(out))
    return out / ce_onnx_file(form)


def _ce_run(args: argparse.Namespace) -> int:
    """Times sentence-transformers' CrossEncoder.predict on the given (query, document) pairs at each batch size
    (one PerfPoint per batch size, pairs/s, as JSON lines); with --export only makes the ONNX export of --form."""
    import torch
    from sentence_transformers import CrossEncoder

    from tritonkit.serving.backend_utils import usable_cpus

    torch.set_num_threads(usable_cpus())
    model_dir, cache = Path(args.model_dir), Path(args.cache)
    if args.form == CE_FP32:
        model = CrossEncoder(str(model_dir), device="cpu")
        label = f"torch {torch.__version__.split('+')[0]} FP32"
    else:
        ce_export(model_dir, cache, args.form)
        if args.export:
            return 0
        model = CrossEncoder(str(cache), backend="onnx", device="cpu",
                             model_kwargs={"file_name": ce_onnx_file(args.form)})
        label = f"ONNX Runtime {'FP32' if args.form == 'onnx' else f'qint8 ({args.form} export)'}"
    from importlib.metadata import version

    label = f"sentence-transformers {version('sentence-transformers')} CrossEncoder, {label}"
    pairs = [tuple(p) for p in json.loads(Path(args.pairs).read_text())]
    _print_points(model.predict, pairs, args.batches, args.seconds, label)
    return 0


def _ce_subprocess(pairs: Sequence[tuple[str, str]], model_dir: Path, form: str, extra: Sequence[str],
                   install: bool) -> str:
    """Runs `ce-run` for `form` in the sentence-transformers venv, the pairs passed through a file; its stdout."""
    python = ensure("sentence-transformers", install)
    with tempfile.TemporaryDirectory(prefix="tritonkit-peers-") as tmp:
        pairs_file = Path(tmp) / "pairs.json"
        pairs_file.write_text(json.dumps([list(p) for p in pairs]))
        cmd = [str(python), "-m", "tritonkit.perf.peers", "ce-run", "--form", form, "--model-dir", str(model_dir),
               "--cache", str(ce_export_dir(model_dir)), "--pairs", str(pairs_file), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=peer_env(), cwd=paths.ROOT)
    if proc.returncode != 0:
        raise PeerUnavailable(f"CrossEncoder {form} failed:\n" + "\n".join(proc.stderr.strip().splitlines()[-8:]))
    return proc.stdout


def ce_points(pairs: Sequence[tuple[str, str]], model_dir: Path, form: str, batches: Sequence[int] = (32,),
              seconds: float = 8.0, install: bool = True) -> list[PerfPoint]:
    """CrossEncoder.predict on `pairs` in `form` (CE_FP32, "onnx" or a QINT8_CONFIGS name) in the
    sentence-transformers venv: one PerfPoint (pairs/s) per batch size."""
    out = _ce_subprocess(pairs, model_dir, form, ["--seconds", str(seconds), "--batches", *map(str, batches)],
                         install)
    return [PerfPoint(**json.loads(line)) for line in out.splitlines() if line.startswith("{")]


def ce_prepare(model_dir: Path, form: str, install: bool = True) -> Path:
    """CrossEncoder's ONNX export `form` ("onnx" or a QINT8_CONFIGS name) of `model_dir`, made once (cached)."""
    if not (ce_export_dir(model_dir) / ce_onnx_file(form)).exists():
        _ce_subprocess([], model_dir, form, ["--export"], install)
    return ce_export_dir(model_dir) / ce_onnx_file(form)


def ce_infinity_dir(model_dir: Path, form: str) -> Path:
    """The directory Infinity serves for CrossEncoder export `form`: the model's files and that one ONNX file
    (its optimum engine takes the single .onnx it finds)."""
    src = ce_export_dir(model_dir)
    if not (src / ce_onnx_file(form)).exists():
        raise PeerUnavailable(f"the CrossEncoder ONNX export {form} is missing (ce_prepare makes it)")
    out = PEERS_DIR / "infinity-model" / f"{src.name}-{form}"
    if (out / ce_onnx_file(form)).exists():
        return out
    keep = Path(ce_onnx_file(form)).name
    for f in src.rglob("*"):
        if f.is_file() and not (f.suffix == ".onnx" and f.name != keep):
            dst = out / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    return out


@contextlib.contextmanager
def infinity_task(model_dir: Path, name: str, task: str, form: str, provider: str = "onnxruntime",
                  batch_size: int = 32, install: bool = True, log_dir: Path | None = None) -> Iterator[PeerServer]:
    """Infinity serving the CrossEncoder ONNX export `form` of `model_dir` for `task`: "rerank" (one request = a
    query and its documents, POST /rerank) or "classify" (one request = texts, POST /classify), on ONNX Runtime's
    CPU provider or (provider "openvino") its OpenVINO provider."""
    python = ensure(INFINITY_FORMS[provider], install)
    served = ce_infinity_dir(model_dir, form)
    ep = "OpenVINO EP" if provider == "openvino" else "CPU EP"
    what = "FP32 ONNX export" if form == "onnx" else f"qint8 {form} export"
    log = (log_dir or PEERS_DIR) / f"infinity-{task}-{provider}-{form}.log"
    # Its warmup sends 512-token pairs, past BERT's positions once [CLS]/[SEP] are added; our pairs stay within 256.
    with _infinity_process(python, served, name, provider, ["--no-model-warmup"], batch_size, log) as port:
        label = f"Infinity {INFINITY_VERSION} (ONNX Runtime {ep}, CrossEncoder {what}, HTTP /{task})"
        if task == "rerank":
            yield PeerServer(label, "127.0.0.1", port, "/rerank",
                             lambda item: json.dumps({"model": name, "query": item[0], "documents": list(item[1]),
                                                      "return_documents": False}).encode(),
                             lambda r: [x["relevance_score"] for x in sorted(r["results"], key=lambda x: x["index"])])
        else:
            yield PeerServer(label, "127.0.0.1", port, "/classify",
                             lambda texts: json.dumps({"model": name, "input": list(texts)}).encode(),
                             lambda r: r["data"])


def triton_http(http_url: str, model: str, label: str | None = None) -> PeerServer:
    """Our server's HTTP/REST (KServe v2) infer endpoint for a text ensemble, asking for the embedding only."""
    host, port = http_url.rsplit(":", 1)

    def body(text: str) -> bytes:
        return json.dumps({"inputs": [{"name": "text", "shape": [1, 1], "datatype": "BYTES", "data": [text]}],
                           "outputs": [{"name": "embedding"}]}).encode()

    return PeerServer(label or f"tritonkit {model} (Triton HTTP/REST)", host, int(port),
                      f"/v2/models/{model}/infer", body, lambda r: r["outputs"][0]["data"])


# wrk's Lua: each thread reads the bodies once, cycles through them, and prints one JSON line when done.
_WRK_SCRIPT = r"""
local bodies, i = {}, 0
function init(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
function request()
  i = i % #bodies + 1
  return wrk.format(nil, nil, nil, bodies[i])
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\n{"requests": %d, "duration_us": %d, "status": %d, "connect": %d, "read": %d, "write": %d, "timeout": %d, '
    .. '"p50_us": %d, "p90_us": %d, "p95_us": %d, "p99_us": %d, "mean_us": %f}\n',
    summary.requests, summary.duration, e.status, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(95), latency:percentile(99), latency.mean))
end
"""


def wrk_binary() -> str:
    found = shutil.which("wrk")
    if not found:
        raise PeerUnavailable("wrk (the native HTTP load generator) is not installed; `make setup` installs it")
    return found


def _wrk(server: PeerServer, bodies_file: Path, script: Path, concurrency: int, seconds: float) -> dict:
    url = f"http://{server.host}:{server.port}{server.path}"
    cmd = [wrk_binary(), "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "--timeout", "60s",
           "-s", str(script), url, "--", str(bodies_file)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 90)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("{")]
    if run.returncode or not lines:
        raise PeerUnavailable(f"{server.label}: wrk failed ({run.returncode}): {(run.stderr or run.stdout)[-300:]}")
    return json.loads(lines[-1])


def http_point(server: PeerServer, texts: Sequence, concurrency: int, seconds: float,
               warmup_s: float = 1.0) -> PerfPoint:
    """Closed loop driven by wrk (native, one thread): `concurrency` keep-alive connections POST one text (or
    whatever server.body takes) per request back to back for `seconds` after a `warmup_s` warm-up, cycling through
    the same real texts. Any non-2xx response, socket error or timeout fails the point: the first request's error
    is raised as it came. Requests the warm-up left in flight are waited out (its p99) before the timed run."""
    first = json.loads(_post(server, server.body(texts[0])))
    if not server.embedding(first):
        raise PeerUnavailable(f"{server.label}: no embedding in the response {str(first)[:300]}")
    with tempfile.TemporaryDirectory(prefix="wrk-") as tmp:
        bodies, script = Path(tmp) / "bodies.jsonl", Path(tmp) / "cycle.lua"
        bodies.write_bytes(b"\n".join(server.body(t) for t in texts) + b"\n")
        script.write_text(_WRK_SCRIPT)
        warm = _wrk(server, bodies, script, concurrency, warmup_s)
        # A slow server still works through the warm-up's abandoned requests; the timed run would pay for them.
        time.sleep(min(60.0, warm["p99_us"] / 1e6 if warm["requests"] else 2 * warmup_s))
        out = _wrk(server, bodies, script, concurrency, seconds)
    errors = {k: out[k] for k in ("status", "connect", "read", "write", "timeout")}  # wrk's error counters
    if sum(errors.values()) or not out["requests"]:
        raise PeerUnavailable(f"{server.label}: {sum(errors.values())} of {out['requests']} requests failed under "
                              f"wrk ({errors})")
    return PerfPoint(label=server.label, concurrency=concurrency,
                     throughput=out["requests"] / (out["duration_us"] / 1e6),
                     p50_ms=out["p50_us"] / 1e3, p90_ms=out["p90_us"] / 1e3, p95_ms=out["p95_us"] / 1e3,
                     p99_ms=out["p99_us"] / 1e3, avg_ms=out["mean_us"] / 1e3)


def _post(server: PeerServer, body: bytes) -> bytes:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    try:
        conn.request("POST", server.path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        payload = response.read()
        if response.status != 200:
            raise PeerUnavailable(f"{server.label}: HTTP {response.status}: {payload[:300]!r}")
        return payload
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    inst = sub.add_parser("install", help="create a peer virtualenv under build/peers/")
    inst.add_argument("names", nargs="+", choices=list(ENVS))
    sub.add_parser("status", help="which peer virtualenvs are installed")
    lock = sub.add_parser("lock", help="re-resolve the peers' locks under perf/peers/ (commit them)")
    lock.add_argument("names", nargs="*", metavar="name", help=f"default: every peer ({', '.join(ENVS)})")
    run = sub.add_parser("st-run", help="(inside a sentence-transformers peer venv) time sentence-transformers")
    run.add_argument("--variant", choices=list(ST_VARIANTS), required=True)
    run.add_argument("--model-dir", required=True)
    run.add_argument("--cache", required=True)
    run.add_argument("--texts", required=True)
    run.add_argument("--max-length", type=int, required=True)
    run.add_argument("--seconds", type=float, default=4.0)
    run.add_argument("--batches", type=int, nargs="+", default=[32])
    run.add_argument("--calibration", help="JSON list of calibration texts (openvino-int8)")
    run.add_argument("--quant-config", choices=list(QINT8_CONFIGS), default="avx2", help="qint8: which export")
    run.add_argument("--embed", help="write the texts' normalised embeddings as JSON here instead of timing")
    ce = sub.add_parser("ce-run", help="(inside the sentence-transformers peer venv) time CrossEncoder.predict")
    ce.add_argument("--form", choices=[CE_FP32, "onnx", *QINT8_CONFIGS], required=True)
    ce.add_argument("--model-dir", required=True)
    ce.add_argument("--cache", required=True)
    ce.add_argument("--pairs", required=True, help="JSON list of [query, document]")
    ce.add_argument("--seconds", type=float, default=8.0)
    ce.add_argument("--batches", type=int, nargs="+", default=[32])
    ce.add_argument("--export", action="store_true", help="only make the ONNX export of --form")
    args = parser.parse_args(argv)
    if args.cmd == "st-run":
        return _st_run(args)
    if args.cmd == "ce-run":
        return _ce_run(args)
    if args.cmd == "status":
        for env in ENVS.values():
            print(f"{env.name}: {'installed' if installed(env) else 'missing'} ({paths.rel(env.dir)})")
        return 0
    if args.cmd == "lock":
        unknown = set(args.names) - set(ENVS)
        if unknown:
            parser.error(f"unknown peer {', '.join(sorted(unknown))} (known: {', '.join(ENVS)})")
        for name in args.names or ENVS:
            write_lock(name)
        return 0
    failed = 0
    for name in args.names:
        try:
            print(f"{name}: {ensure(name)}")
        except PeerUnavailable as e:
            print(f"{name}: unavailable: {e}", file=sys.stderr)
            failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
