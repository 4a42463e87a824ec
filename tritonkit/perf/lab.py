"""The perf lab: perf_analyzer sweeps of each pipeline and its composing models, in-process baselines in the same
invocation, and one timestamped folder of CSV / JSON / Markdown / PNG.

    python perf/lab.py [--pipelines text image] [--quick] [--repeats 3] [--out perf/results/<stamp>]

Per pipeline: start the embedded tritonserver with the pipeline's models; for each workload (the INT8 ensemble, the
FP32 ensemble, each composing model alone with its own real inputs) a closed-loop concurrency sweep, then for the
ensembles an open-loop request-rate sweep at fractions of the peak just measured; every level repeated and
interleaved, median reported. Around every run the statistics API is read, so each point carries the server-side
queue vs compute time and the mean batch of every composing model. Then, with the server still up, the
contenders run on the same cores in interleaved rounds (median of `compare_repeats`): the in-process baselines of
tritonkit.perf.baselines (the model's own library; our own built ONNX models in-process, the ceiling a server must
approach) and, for text, our server through wrk (tritonkit.perf.peers); with --peers also the
peer servers, sentence-transformers' own ONNX qint8 and its OpenVINO backend in FP32 and NNCF static INT8
(tritonkit.perf.peers, each in its own venv, installed if missing). The summary states served / contender ratios and
the peer table, with our served models' and our in-process INT8 ceiling's ratio over each contender.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import csv
import dataclasses
import json
import math
import os
import platform
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import envinfo, paths
from tritonkit.perf.analyzer import PerfPoint, sweep, write_input_data
from tritonkit.perf.load import real_images

RESULTS = paths.ROOT / "perf" / "results"
RATE_FRACTIONS = (0.5, 0.75, 0.9, 1.0)


@dataclass
class Workload:
    model: str
    label: str
    rows: Callable[[], list[dict]]  # perf_analyzer --input-data rows (real inputs for this model)
    stats_models: Sequence[str]  # composing models whose queue/compute split is recorded
    ensemble: bool = False
    full_only: bool = False  # skipped by --quick


@dataclass
class Contender:
    """One thing the served pipeline is compared with, measured in the interleaved rounds."""

    key: str
    run: Callable[[], PerfPoint]
    where: str = "in-process"  # or "server": called over HTTP by wrk (tritonkit.perf.peers.http_point)


@dataclass
class Pipeline:
    name: str
    unit: str
    workloads: list[Workload]
    # (settings, the running server, exit stack for peer servers, progress) -> (contenders, skipped with reasons)
    contenders: Callable[..., tuple[list[Contender], list[dict]]]
    ratio_concurrency: int = 16
    serve: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.serve = self.serve or [w.model for w in self.workloads]


def _b64_bytes_rows(name: str, items: Sequence[bytes]) -> list[dict]:
    # A serialized BYTES tensor (4-byte little-endian length + payload) survives JSON as base64.
    return [{name: {"b64": base64.b64encode(struct.pack("<I", len(b)) + b).decode(), "shape": [1]}} for b in items]


def benchmark_text_rows() -> list[dict]:
    from tritonkit import data
    from tritonkit.perf.analyzer import text_rows

    return text_rows(data.split("benchmark"))


def benchmark_token_rows(name: str = "text_embedding") -> list[dict]:
    from tritonkit import data, kinds

    rows = []
    for enc in kinds.get(name).load_tokenizer().encode_batch(data.split("benchmark")):
        n = len(enc.ids)
        rows.append({"input_ids": {"content": list(enc.ids), "shape": [n]},
                     "attention_mask": {"content": [1] * n, "shape": [n]}})
    return rows


def _image_rows() -> list[dict]:
    return _b64_bytes_rows("IMAGE", real_images())


def _pixel_rows(name: str = "image_classification") -> list[dict]:
    from tritonkit import kinds
    from tritonkit.serving import imaging

    kind = kinds.get(name)
    size = kind.spec.facts.input_size
    return [{kind.INPUT: {"b64": base64.b64encode(imaging.preprocess_one(b, kind.PREPROCESS).astype("<f4").tobytes())
                          .decode(), "shape": [3, size, size]}} for b in real_images()]


def mean_tokens(name: str) -> float:
    """Mean tokens per benchmark text (special tokens included, truncated as served): tokens/s = texts/s × this,
    since every measurement cycles over the same texts."""
    from tritonkit import data, kinds

    return statistics.fmean(len(e.ids) for e in kinds.get(name).load_tokenizer().encode_batch(data.split("benchmark")))


def _text_contenders(name: str, settings: Settings, server, stack: contextlib.ExitStack,
                     progress: Callable[[str], None] = print) -> tuple[list[Contender], list[dict]]:
    from functools import partial

    from tritonkit import data, kinds
    from tritonkit.perf import baselines, peers

    texts, s, c = data.split("benchmark"), settings.baseline_seconds, pipeline(name).ratio_concurrency
    ours = peers.triton_http(server.http_url, name, f"tritonkit {name} (Triton HTTP/REST, wrk)")
    out = [
        Contender("served_http", lambda: peers.http_point(ours, texts, c, s), "server"),
        Contender("onnx_int8", lambda: baselines.onnx_text(texts, s, name, "int8")),
        Contender("onnx_int8_calls", lambda: baselines.onnx_text_calls(texts, s, name)),
        Contender("onnx_fp32", lambda: baselines.onnx_text(texts, s, name, "fp32")),
        Contender("st_best", lambda: baselines.st_best_batch(texts, s, name)),
        Contender("st_per_text", lambda: baselines.st_per_text(texts, c, s, name)),
    ]
    if kinds.get(name).spec.serving.fused:  # the same pipeline in one stub, same generator
        fused = peers.triton_http(server.http_url, f"{name}_fused",
                                  f"tritonkit {name}_fused (one stub, Triton HTTP/REST, wrk)")
        out.insert(1, Contender("served_fused_http", lambda: peers.http_point(fused, texts, c, s), "server"))
    skipped: list[dict] = []
    if not settings.peers:
        return out, [{"label": "peer servers and sentence-transformers ONNX qint8 / OpenVINO FP32 / OpenVINO INT8",
                      "reason": "run with --peers"}]
    kind, install = kinds.get(name), settings.install_peers
    wanted = [p for p in peers.PEERS if p not in settings.skip_peers]
    skipped += [{"label": p, "reason": "skipped as asked (--skip-peer)"} for p in peers.PEERS if p not in wanted]

    def failed(label: str, e: Exception) -> None:
        progress(f"[{name}] FAILED: {label}: {e}")
        skipped.append({"label": label, "reason": str(e), "failed": True})

    config = None
    if {"st-qint8", "infinity"} & set(wanted):
        try:
            choice = peers.choose_qint8(kind, install=install, progress=progress)
            config, settings.peer_forms["qint8"] = choice["chosen"], choice
        except peers.PeerUnavailable as e:
            for p in {"st-qint8", "infinity"} & set(wanted):
                failed(p, e)
    if config and "st-qint8" in wanted:
        out.append(Contender("st_qint8", lambda: peers.st_points(texts, kind.model_dir(), kind.MAX_LENGTH, "qint8",
                                                                 [32], s, install, quant_config=config)[0]))
    if config and "infinity" in wanted:
        try:
            inf, settings.peer_forms["infinity"] = best_infinity(kind, config, texts, c, s, stack, install, progress)
            out.append(Contender("infinity", lambda: peers.http_point(inf, texts, c, s), "server"))
        except peers.PeerUnavailable as e:
            failed("infinity", e)
    # Calibration comes from its own split: the INT8 peer never sees the texts it is timed on.
    calibration = data.split("calibration")[:peers.CALIBRATION_TEXTS]

    def ov(variant: str, secs: float) -> PerfPoint:
        return peers.st_points(texts, kind.model_dir(), kind.MAX_LENGTH, variant, [32], secs, install,
                               calibration=calibration)[0]

    for peer, variant, key, what in (("st-openvino-fp32", "openvino-fp32", "st_openvino_fp32", "OpenVINO FP32"),
                                     ("st-openvino-int8", "openvino-int8", "st_openvino_int8",
                                      "OpenVINO INT8 (NNCF static)")):
        if peer not in wanted:
            continue
        try:
            progress(f"[{name}] sentence-transformers {what}: export"
                     + (f", quantization on {len(calibration)} calibration texts" if "int8" in variant else "")
                     + " (cached under build/peers/) ...")
            ov(variant, 0.5)
            out.append(Contender(key, partial(ov, variant, s)))
        except peers.PeerUnavailable as e:
            failed(peer, e)
    skipped.append({"label": "TEI (text-embeddings-inference)",
                    "reason": "not installable from PyPI, npm or Debian (Docker images or a Rust source build)"})
    return out, skipped


# A qint8 export sits near 0.97-0.98 cosine min to FP32 on held-out texts; a wrong setting is far off (Infinity's
# default CLS pooling gave 0.42 on this model).
INFINITY_MIN_COSINE = 0.95


def best_infinity(kind, config: str, texts: Sequence[str], concurrency: int, seconds: float,
                  stack: contextlib.ExitStack, install: bool, progress: Callable[[str], None] = print,
                  rounds: int = 2):
    """Infinity in its fastest form on this CPU (peers.INFINITY_FORMS: ONNX Runtime's CPU or OpenVINO provider),
    both serving the chosen qint8 export: each form that starts and embeds like the model (cosine to
    sentence-transformers FP32 at least INFINITY_MIN_COSINE) is driven by wrk in `rounds` interleaved
    rounds; the faster stays up in `stack`, the other is stopped. Returns (server, record of every form)."""
    import numpy as np

    from tritonkit.perf import peers

    probe = list(texts[:16])
    want = kind.sentence_transformer().encode(probe, normalize_embeddings=True)
    bound = INFINITY_MIN_COSINE
    forms: dict[str, dict] = {}
    up: dict[str, tuple] = {}
    for form in peers.INFINITY_FORMS:
        progress(f"[{kind.NAME}] starting Infinity ({form}, qint8 {config} export) ...")
        own = contextlib.ExitStack()
        try:
            server = own.enter_context(peers.infinity(kind.model_dir(), kind.NAME, kind.spec.facts.pooling,
                                                      install=install, config=config, form=form))
            got = np.asarray([server.embedding(json.loads(peers._post(server, server.body(t)))) for t in probe],
                             np.float32)
            cos = float(((got / np.linalg.norm(got, axis=1, keepdims=True)) * want).sum(1).min())
            if cos < bound:
                raise peers.PeerUnavailable(f"Infinity ({form}) embeds unlike the model: cosine min {cos:.4f} "
                                            f"< {bound} on {len(probe)} texts")
            forms[form] = {"label": server.label, "cosine_min": round(cos, 5), "runs": []}
            up[form] = (server, own)
        except peers.PeerUnavailable as e:
            own.close()
            forms[form] = {"unavailable": str(e).splitlines()[0][:300]}
            progress(f"[{kind.NAME}] Infinity ({form}) unavailable: {e}")
    if not up:
        raise peers.PeerUnavailable("Infinity: no form started: " + "; ".join(
            f"{f}: {r['unavailable']}" for f, r in forms.items()))
    for _ in range(rounds if len(up) > 1 else 0):
        for form, (server, _own) in up.items():
            forms[form]["runs"].append(round(peers.http_point(server, texts, concurrency, seconds).throughput, 1))
    for form in up:
        forms[form]["texts_per_s"] = round(statistics.median(forms[form]["runs"]), 1) if forms[form]["runs"] else None
    chosen = max(up, key=lambda f: forms[f]["texts_per_s"] or 0.0)
    for form, (_server, own) in up.items():
        if form != chosen:
            own.close()
    stack.push(up[chosen][1])
    reason = ("the only form that started" if len(up) == 1
              else f"faster under wrk at c={concurrency} (median of {rounds} interleaved rounds)")
    return up[chosen][0], {"chosen": chosen, "reason": reason, "forms": forms}


def _image_contenders(name: str, settings: Settings, server, stack: contextlib.ExitStack,
                      progress: Callable[[str], None] = print) -> tuple[list[Contender], list[dict]]:
    from tritonkit.perf import baselines

    photos, s = real_images(), settings.baseline_seconds
    return [
        Contender("onnx_int8", lambda: baselines.onnx_image(photos, s, name, "int8")),
        Contender("onnx_fp32", lambda: baselines.onnx_image(photos, s, name, "fp32")),
        Contender("naive", lambda: baselines.image(photos, s, model=name)),
    ], []


# The kinds whose rows and contenders the lab has (embedding texts, image bytes); another kind is refused, not fed
# these: rerank and classification are timed by perf/bench_cross_encoders.py.
LAB_KINDS = ("text-embedding", "image-classification")


def pipeline(name: str) -> Pipeline:
    """The perf-lab pipeline of a spec of LAB_KINDS: its INT8 and FP32 ensembles (and fused model), each step alone,
    and what it is compared with (tritonkit.perf.baselines, tritonkit.perf.peers)."""
    from functools import partial

    from tritonkit import kinds
    from tritonkit.int8.report import served_label

    kind = kinds.get(name)
    if kind.spec.kind not in LAB_KINDS:
        raise ValueError(f"{name}: the perf lab has no workloads for a {kind.spec.kind} model (it has them for "
                         f"{', '.join(LAB_KINDS)}); perf/bench_cross_encoders.py times rerank and classification")
    n, pre, int8, fp32 = kind.NAME, kind.PREPROCESSOR, kind.INT8_MODEL, kind.FP32_MODEL
    served = served_label(kind.NAME)  # "INT8", or "FP32 fallback" where the search found no passing INT8 model
    if kind.spec.kind == "text-embedding":
        workloads = [
            Workload(n, f"{n} ({served} ensemble)", benchmark_text_rows, (pre, int8), True),
            Workload(f"{n}_fp32", f"{n}_fp32 (FP32 ensemble)", benchmark_text_rows, (pre, fp32), True, full_only=True),
            *([Workload(f"{n}_fused", f"{n}_fused ({served}, one stub)", benchmark_text_rows, (f"{n}_fused",), True)]
              if kind.spec.serving.fused else []),
            Workload(pre, f"{pre} alone", benchmark_text_rows, (pre,)),
            Workload(int8, f"{int8} alone (pre-tokenized)", partial(benchmark_token_rows, n), (int8,)),
        ]
        return Pipeline(n, "texts", workloads, partial(_text_contenders, n))
    workloads = [
        Workload(n, f"{n} ({served} ensemble)", _image_rows, (pre, int8), True),
        Workload(f"{n}_fp32", f"{n}_fp32 (FP32 ensemble)", _image_rows, (pre, fp32), True, full_only=True),
        *([Workload(f"{n}_fused", f"{n}_fused ({served}, one stub)", _image_rows, (f"{n}_fused",), True)]
          if kind.spec.serving.fused else []),
        Workload(pre, f"{pre} alone", _image_rows, (pre,)),
        Workload(int8, f"{int8} alone (pre-processed pixels)", partial(_pixel_rows, n), (int8,)),
    ]
    return Pipeline(n, "images", workloads, partial(_image_contenders, n))


def __getattr__(name: str):
    if name == "PIPELINES":  # the first two pipelines under their short names
        return {"text": pipeline("text_embedding"), "image": pipeline("image_classification")}
    raise AttributeError(name)


@dataclass
class Settings:
    concurrencies: Sequence[int] = (1, 4, 8, 16, 32)
    repeats: int = 3
    measurement_ms: int = 3000
    rate_fractions: Sequence[float] = RATE_FRACTIONS
    baseline_seconds: float = 8.0
    quick: bool = False
    protocol: str = "grpc"
    compare_repeats: int = 3  # interleaved rounds of the served-vs-contenders comparison
    peers: bool = False  # also peer servers and sentence-transformers' ONNX / OpenVINO backends, each in its own venv
    install_peers: bool = True  # create a missing peer venv (needs the package index); False: skip it, say why
    skip_peers: Sequence[str] = ()  # peers.PEERS the user chose not to measure; any other that fails fails the run
    peer_forms: dict = field(default_factory=dict)  # the form each peer ran in here, and why (filled by the run)

    @classmethod
    def quick_mode(cls) -> Settings:
        return cls(concurrencies=(1, 8, 16), repeats=1, measurement_ms=2000, rate_fractions=(0.5, 0.9),
                   baseline_seconds=4.0, quick=True)


def run_pipeline(pipe: Pipeline, settings: Settings, out_dir: Path, repository: Path | None = None,
                 progress: Callable[[str], None] = print) -> dict:
    """Sweeps of one pipeline on a fresh server, then the interleaved comparison rounds with the server still up;
    returns {"served": [...], "baseline": [...], "peers": [...], "skipped": [...]}."""
    from tritonkit import build
    from tritonkit.runtime.server import TritonServer

    build.build(pipe.name, progress=False, forms=("served",))  # only what the lab serves; no-op when current
    workloads = [w for w in pipe.workloads if not (settings.quick and w.full_only)]
    served: list[PerfPoint] = []
    kwargs = {"model_repository": repository} if repository else {}
    server = TritonServer.on_free_ports(model_control_mode="explicit", models=[w.model for w in workloads], **kwargs)
    progress(f"[{pipe.name}] starting tritonserver with {', '.join(server.models)} ...")
    with server, contextlib.ExitStack() as stack:
        url = server.grpc_url if settings.protocol == "grpc" else server.http_url
        for w in workloads:
            data = write_input_data(out_dir / "inputs" / f"{w.model}.json", w.rows())
            common = dict(repeats=settings.repeats, label=w.label, progress=progress, protocol=settings.protocol,
                          measurement_ms=settings.measurement_ms, stats_of=(server.http_url, w.stats_models))
            points = sweep(w.model, url, settings.concurrencies, data, **common)
            if w.ensemble and settings.rate_fractions:
                peak = max(p.throughput for p in points)
                rates = [round(peak * f, 1) for f in settings.rate_fractions]
                points += sweep(w.model, url, (), data, rates=rates, **common)
            served += points
        contenders, skipped = pipe.contenders(settings, server, stack, progress)
        measured = compare(pipe.name, contenders, settings.compare_repeats, progress)
    result = {"served": served, "baseline": [p for c, p in measured if c.where == "in-process"],
              "peers": [p for c, p in measured if c.where == "server"], "skipped": skipped,
              "compare_repeats": settings.compare_repeats, "peer_forms": dict(settings.peer_forms),
              # Beside the peers, our file is batched as they are: the arrival-order calls where measured.
              "ceiling": next((p.label for key in ("onnx_int8_calls", "onnx_int8") for c, p in measured
                               if c.key == key), None)}
    if pipe.unit == "texts":
        result["mean_tokens"] = mean_tokens(pipe.name)
    return result


def compare(name: str, contenders: Sequence[Contender], repeats: int,
            progress: Callable[[str], None] = print) -> list[tuple[Contender, PerfPoint]]:
    """Every contender once per round, `repeats` rounds, so drift hits each alike; the median of rounds each."""
    from tritonkit.perf.analyzer import median_point

    runs: dict[str, list[PerfPoint]] = {c.key: [] for c in contenders}
    for r in range(repeats):
        for c in contenders:
            point = c.run()
            runs[c.key].append(point)
            progress(f"  [{name}] round {r + 1}/{repeats} {point.label}: {point.throughput:.1f}/s "
                     f"p50 {point.p50_ms:.1f} ms p99 {point.p99_ms:.1f} ms")
    return [(c, median_point(runs[c.key])) for c in contenders]


def ratios(pipe: Pipeline, result: dict) -> list[dict]:
    """Served ensemble (best closed-loop point and the point at ratio_concurrency) / each baseline point."""
    out = []
    ensembles = {w.label for w in pipe.workloads if w.ensemble}
    for label in sorted(ensembles):
        closed = [p for p in result["served"] if p.label == label and not p.request_rate]
        if not closed:
            continue
        best = max(closed, key=lambda p: p.throughput)
        at = next((p for p in closed if p.concurrency == pipe.ratio_concurrency), best)
        for b in result["baseline"]:
            out.append({"served": label, "baseline": b.label, "served_at_c": at.concurrency,
                        "ratio_at_c": at.throughput / b.throughput, "served_best_c": best.concurrency,
                        "ratio_best": best.throughput / b.throughput})
    return out


def peer_table(pipe: Pipeline, result: dict) -> list[dict]:
    """The served INT8 ensemble at ratio_concurrency (perf_analyzer) and every contender: throughput, tokens/s
    (text), p50/p99, and served ÷ contender for the perf_analyzer point and, for text, for our server under the
    same wrk load as the peers; and our in-process INT8 ceiling (result["ceiling"]) ÷ contender."""
    label = pipe.workloads[0].label
    grpc = next((p for p in result["served"] if p.label == label and not p.request_rate
                 and p.concurrency == pipe.ratio_concurrency), None)
    http = next((p for p in result.get("peers", []) if p.label.startswith("tritonkit")), None)
    tokens = result.get("mean_tokens")
    ceiling = next((p for p in result["baseline"] if p.label == result.get("ceiling")), None)
    entries = ([("served", dataclasses.replace(grpc, label=f"{label}, perf_analyzer"))] if grpc else [])
    entries += [("server", p) for p in result.get("peers", [])] + [("in-process", p) for p in result["baseline"]]
    rows = []
    for where, p in entries:
        rows.append({"label": p.label, "where": where, "concurrency": p.concurrency, "throughput": p.throughput,
                     "tokens_per_s": p.throughput * tokens if tokens else None, "p50_ms": p.p50_ms,
                     "p99_ms": p.p99_ms,
                     "served_x": grpc.throughput / p.throughput if grpc and p.throughput else None,
                     "served_http_x": http.throughput / p.throughput if http and p.throughput else None,
                     "ceiling_x": ceiling.throughput / p.throughput if ceiling and p.throughput else None})
    return rows


def _x(v: float | None) -> str:
    return f"{v:.2f}×" if v is not None else "—"


def peer_markdown(pipe: Pipeline, result: dict) -> list[str]:
    rows = peer_table(pipe, result)
    if not rows:
        return peer_form_lines(result)
    text = result.get("mean_tokens") is not None
    head = f"| contender | where | c | {pipe.unit}/s |" + (" tokens/s |" if text else "") + " p50 ms | p99 ms |"
    head += f" served ÷ it (perf_analyzer, c={pipe.ratio_concurrency}) |"
    head += " served ÷ it (wrk over HTTP) |" if text else ""
    head += " our INT8 file in-process ÷ it |"
    rounds = result.get("compare_repeats")
    lines = [f"### {pipe.name}: peers and in-process baselines (median of {rounds or 'the'} interleaved rounds)", "",
             head,
             "|---|---|---:|---:|" + ("---:|" if text else "") + "---:|---:|---:|" + ("---:|" if text else "")
             + "---:|"]
    for r in rows:
        line = (f"| {r['label']} | {r['where']} | {r['concurrency']} | {r['throughput']:.1f} |"
                + (f" {r['tokens_per_s']:.0f} |" if text else "")
                + f" {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {_x(r['served_x'])} |"
                + (f" {_x(r['served_http_x'])} |" if text else "") + f" {_x(r.get('ceiling_x'))} |")
        lines.append(line)
    if text:
        lines += ["", f"tokens/s = {pipe.unit}/s × {result['mean_tokens']:.1f} mean tokens per benchmark text "
                      "(every measurement cycles over the same texts)."]
    return [*lines, "", *peer_form_lines(result)]


def peer_form_lines(result: dict) -> list[str]:
    """What the peers ran as on this CPU and why, then every peer left out: failed, or skipped and why."""
    lines = []
    qint8, inf = result.get("peer_forms", {}).get("qint8"), result.get("peer_forms", {}).get("infinity")
    if qint8:
        lines += [f"Peer forms on this CPU ({qint8['cpu']}): sentence-transformers qint8 export "
                  f"**{qint8['chosen']}**, {qint8['reason']}; judged on {qint8['eval_texts']} validation texts "
                  "against its FP32:", "",
                  "| qint8 export | cosine min | cosine mean | top-10 overlap | holds | texts/s (batch 32) |",
                  "|---|---:|---:|---:|---|---:|"]
        for config, f in qint8["forms"].items():
            a = f["accuracy"]
            speed = f"{f['texts_per_s']:.1f}" if f.get("texts_per_s") else "not timed"
            lines.append(f"| {config} | {a['cosine_min']:.4f} | {a['cosine_mean']:.5f} | {a['top10_overlap']:.3f} | "
                         f"{'yes' if f['holds'] else 'no: ' + '; '.join(f['why_not'])} | {speed} |")
        lines.append("")
    if inf:
        runs = "; ".join(f"{form} " + (f"{f['texts_per_s']} texts/s" if f.get("texts_per_s") else
                                       f.get("unavailable", "started"))
                         for form, f in inf["forms"].items())
        lines += [f"Infinity form: **{inf['chosen']}**, {inf['reason']} ({runs}).", ""]
    for s in result.get("skipped", []):
        lines.append(f"{'FAILED' if s.get('failed') else 'skipped'}: {s['label']}: {s['reason']}")
    return lines


CSV_FIELDS = ["pipeline", "label", "mode", "concurrency", "request_rate", "throughput", "p50_ms", "p95_ms", "p99_ms",
              "avg_ms", "repeats"]


def _split_text(p: PerfPoint) -> str:
    return "; ".join(f"{m} q {s['queue_ms']:.1f} / c {s['compute_ms']:.1f} ms, b {s['batch']:.1f}"
                     for m, s in p.stats.items())


def write_outputs(out_dir: Path, results: dict[str, dict], settings: Settings, command: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"csv": out_dir / "points.csv", "json": out_dir / "results.json", "md": out_dir / "summary.md"}
    with open(files["csv"], "w", newline="") as f:
        writer = csv.writer(f)
        models = sorted({m for r in results.values() for p in r["served"] for m in p.stats})
        writer.writerow(CSV_FIELDS + [f"{m}_{k}" for m in models for k in ("queue_ms", "compute_ms", "batch")])
        for name, r in results.items():
            for p in r["served"] + r.get("peers", []) + r["baseline"]:
                mode = "rate" if p.request_rate else "concurrency"
                row = [name, p.label, mode, p.concurrency, p.request_rate, f"{p.throughput:.2f}", f"{p.p50_ms:.2f}",
                       f"{p.p95_ms:.2f}", f"{p.p99_ms:.2f}", f"{p.avg_ms:.2f}", p.repeats]
                row += [f"{p.stats[m][k]:.3f}" if m in p.stats else ""
                        for m in models for k in ("queue_ms", "compute_ms", "batch")]
                writer.writerow(row)
    meta = {"command": command, "time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu_count": os.cpu_count(),
            "machine": platform.machine(), "cpu": envinfo.cpu_model(), "cpu_class": envinfo.int8_class(),
            "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "peer_forms"}}
    files["json"].write_text(json.dumps({
        "meta": meta,
        "pipelines": {name: {"served": [p.to_json() for p in r["served"]],
                             "baseline": [p.to_json() for p in r["baseline"]],
                             "peers": [p.to_json() for p in r.get("peers", [])],
                             "skipped": r.get("skipped", []), "mean_tokens": r.get("mean_tokens"),
                             "peer_forms": r.get("peer_forms", {}),
                             "compare_repeats": r.get("compare_repeats"), "ceiling": r.get("ceiling"),
                             "peer_table": peer_table(pipeline(name), r),
                             "ratios": ratios(pipeline(name), r)} for name, r in results.items()},
    }, indent=2))
    for name, r in results.items():
        files[f"png_{name}"] = plot(pipeline(name), r, out_dir / f"{name}.png")
    files["md"].write_text(summary(results, meta))
    return files


def summary(results: dict[str, dict], meta: dict) -> str:
    lines = [f"# perf lab — {meta['time']}", "", f"`{meta['command']}` on {meta['cpu_count']} cores "
             f"({meta['machine']}); perf_analyzer over {meta['settings']['protocol']}, median of "
             f"{meta['settings']['repeats']} interleaved repeats, {meta['settings']['measurement_ms']} ms windows.", ""]
    for name, r in results.items():
        pipe = pipeline(name)
        lines += [f"## {name}", "", f"![{name}]({name}.png)", "",
                  f"| workload | load | {pipe.unit}/s | p50 ms | p95 ms | p99 ms | server split per model "
                  "(queue / compute ms per request, mean batch) |", "|---|---|---:|---:|---:|---:|---|"]
        for p in r["served"]:
            load = f"rate {p.request_rate:g}/s" if p.request_rate else f"c={p.concurrency}"
            lines.append(f"| {p.label} | {load} | {p.throughput:.1f} | {p.p50_ms:.1f} | {p.p95_ms:.1f} | "
                         f"{p.p99_ms:.1f} | {_split_text(p)} |")
        for p in r["baseline"]:
            label = p.label if "in-process" in p.label else f"{p.label} (in-process)"
            lines.append(f"| {label} | c={p.concurrency} | {p.throughput:.1f} | {p.p50_ms:.1f} | "
                         f"{p.p95_ms:.1f} | {p.p99_ms:.1f} | |")
        for p in r.get("peers", []):
            lines.append(f"| {p.label} (wrk over HTTP) | c={p.concurrency} | {p.throughput:.1f} | "
                         f"{p.p50_ms:.1f} | {p.p95_ms:.1f} | {p.p99_ms:.1f} | |")
        lines += ["", *peer_markdown(pipe, r)]
        lines += ["", "| served | vs baseline | × at c | × best (c) |", "|---|---|---:|---:|"]
        for q in ratios(pipe, r):
            lines.append(f"| {q['served']} | {q['baseline']} | {q['ratio_at_c']:.2f} (c={q['served_at_c']}) | "
                         f"{q['ratio_best']:.2f} (c={q['served_best_c']}) |")
        lines.append("")
    return "\n".join(lines)


def plot(pipe: Pipeline, result: dict, path: Path) -> Path:
    """Left: the whole pipeline (served ensembles along the concurrency sweep, peer servers and in-process
    baselines as markers) on the same axes, throughput vs p99; middle: each composing step alone, log throughput
    (a tokenizer alone runs far faster than anything else); right: p99 vs offered request rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    fig, (whole, steps, right) = plt.subplots(1, 3, figsize=(18, 5.5))
    ensembles = {w.label for w in pipe.workloads if w.ensemble}
    for label in dict.fromkeys(p.label for p in result["served"]):
        ax = whole if label in ensembles else steps
        pts = sorted((p for p in result["served"] if p.label == label and not p.request_rate),
                     key=lambda p: p.concurrency)
        if pts:
            ax.plot([p.p99_ms for p in pts], [p.throughput for p in pts], marker="o", label=label)
            for p in pts:
                ax.annotate(f"c={p.concurrency}", (p.p99_ms, p.throughput), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
        rated = sorted((p for p in result["served"] if p.label == label and p.request_rate),
                       key=lambda p: p.request_rate)
        if rated:
            right.plot([p.request_rate for p in rated], [p.p99_ms for p in rated], marker="o", label=f"{label} p99")
    for p in result.get("peers", []):
        whole.scatter([p.p99_ms], [p.throughput], marker="*", s=140, label=f"{p.label}, c={p.concurrency}")
    for b in result["baseline"]:
        label = b.label if "in-process" in b.label else f"{b.label} (in-process)"
        whole.scatter([b.p99_ms], [b.throughput], marker="x", s=60, label=label)
    whole.set(xlabel="p99 latency (ms)", ylabel=f"{pipe.unit}/s",
              title=f"{pipe.name}: served vs peers and in-process (closed loop)")
    steps.set(xlabel="p99 latency (ms)", ylabel=f"{pipe.unit}/s (log)", title=f"{pipe.name}: each step alone")
    steps.set_yscale("log")
    for ax in (whole, steps):
        ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
    for axis in (whole.xaxis, steps.xaxis, steps.yaxis):  # log axes: plain numbers at 1-2-5 steps
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    if whole.lines or whole.collections:  # below the axes: inside, it hid the highest markers
        whole.legend(fontsize=7, loc="upper left", bbox_to_anchor=(0.0, -0.16))
    if steps.lines:
        steps.legend(fontsize=6)
    whole.set_ylim(bottom=0)
    right.set(xlabel="offered requests/s", ylabel="p99 latency (ms)", title=f"{pipe.name}: p99 vs offered load")
    right.grid(True, alpha=0.3)
    if right.lines:
        right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": the left legend sits below its axes
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--pipelines", nargs="+", default=["text", "image"],
                        help="spec names (models/*.toml) or text/image; make perf MODEL=<name> passes one")
    parser.add_argument("--quick", action="store_true", help="c=1,8,16, one repeat, no FP32 ensembles")
    parser.add_argument("--concurrency", type=int, nargs="+", help="closed-loop levels (default 1 4 8 16 32)")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--measurement-ms", type=int)
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    parser.add_argument("--out", type=Path, help="output folder (default perf/results/<stamp>)")
    parser.add_argument("--peers", action="store_true",
                        help="also peer servers (Infinity) and sentence-transformers' ONNX qint8, OpenVINO FP32 and "
                             "OpenVINO INT8 (NNCF static), each in its own venv under build/peers/ (installed if "
                             "missing; skipped with the reason when that fails)")
    parser.add_argument("--skip-peer", action="append", default=[], metavar="NAME",
                        help="with --peers: leave this peer out (repeatable; comma-separated names too; "
                             "tritonkit.perf.peers.PEERS); any other peer that cannot be had fails the run")
    parser.add_argument("--compare-repeats", type=int, help="interleaved rounds of the contenders (default 3)")
    parser.add_argument("--gate", type=int, metavar="N",
                        help="only the CI ratio gate, N times per pipeline, to see its spread (no folder)")
    args = parser.parse_args(argv)
    for name in args.pipelines:
        try:
            pipeline(name)
        except (KeyError, ValueError) as err:
            parser.error(str(err).strip("'\""))
    if args.gate:
        failed = False
        for name in args.pipelines:
            runs = [gate_ratios(name) for _ in range(args.gate)]
            for r in runs:
                failed |= r["ratio"] < r["min_ratio"]
                print(f"gate {name}: served {r['served']:.1f}/s, in-process INT8 {r['baseline']:.1f}/s, "
                      f"ratio {r['ratio']:.2f} (min {r['min_ratio']})", flush=True)
            ratios_ = [r["ratio"] for r in runs]
            print(f"gate {name}: ratio min {min(ratios_):.2f} median {statistics.median(ratios_):.2f} "
                  f"max {max(ratios_):.2f} over {len(runs)} runs")
        return 1 if failed else 0
    settings = Settings.quick_mode() if args.quick else Settings()
    settings.protocol = args.protocol
    settings.peers = args.peers
    settings.skip_peers = tuple(n for arg in args.skip_peer for n in arg.replace(",", " ").split())
    if args.peers:
        from tritonkit.perf import peers

        unknown = sorted(set(settings.skip_peers) - set(peers.PEERS))
        if unknown:
            parser.error(f"--skip-peer: unknown peer {', '.join(unknown)} (known: {', '.join(peers.PEERS)})")
        unavailable = peers.prepare([p for p in peers.PEERS if p not in settings.skip_peers])
        if unavailable:
            for peer, why in unavailable.items():
                print(f"error: peer {peer} cannot be had: {why}", file=sys.stderr)
            print(f"error: {len(unavailable)} peer(s) unavailable; nothing measured. Leave them out with --skip-peer "
                  f"(make perf-peers SKIP='{' '.join(unavailable)}')", file=sys.stderr)
            return 2
    if args.compare_repeats:
        settings.compare_repeats = args.compare_repeats
    for key in ("concurrency", "repeats", "measurement_ms"):
        value = getattr(args, key)
        if value:
            setattr(settings, "concurrencies" if key == "concurrency" else key, value)
    out_dir = args.out or RESULTS / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {name: run_pipeline(pipeline(name), settings, out_dir) for name in args.pipelines}
    command = "python perf/lab.py " + " ".join(sys.argv[1:] if argv is None else argv)
    files = write_outputs(out_dir, results, settings, command.strip())
    print(files["md"].read_text())
    print("wrote " + ", ".join(str(p.relative_to(paths.ROOT)) if p.is_relative_to(paths.ROOT) else str(p)
                               for p in files.values()))
    lost = [s for r in results.values() for s in r.get("skipped", []) if s.get("failed")]
    for s in lost:
        print(f"error: peer {s['label']} failed: {s['reason']}", file=sys.stderr)
    ok = all(not math.isnan(p.throughput) for r in results.values() for p in r["served"])
    return 0 if ok and not lost else 1


# CI gate: the served INT8 ensemble over the in-process INT8 ceiling of the same built model, measured in the same
# run (a busy machine slows both sides). min_ratio = the measured median ratio minus the measured run-to-run
# spread (perf/gate_noise.py; docs/performance.md, "CI perf gate"), never above the target (TARGET); the lowest over
# the CPU classes measured, since a class changes what the ensemble serves (image: INT8 on VNNI, FP32 on AVX2).
TARGET = 1.0  # served at least as fast as the same model called in-process
GATE = {"text": {"concurrency": 16, "min_ratio": 0.36}, "image": {"concurrency": 8, "min_ratio": 0.59}}


def gate_ratios(name: str, repeats: int = 2, measurement_ms: int = 2000, seconds: float = 4.0,
                repository: Path | None = None, build_first: bool = True) -> dict:
    """Served INT8 ensemble (perf_analyzer over gRPC at the gate's concurrency, from `repository` or the built
    one) vs the in-process INT8 ceiling (tritonkit.perf.baselines.onnx_text / onnx_image on the built model),
    `repeats` interleaved rounds; returns both medians and the ratio."""
    import statistics as st

    from tritonkit import build, data, kinds
    from tritonkit.perf import baselines
    from tritonkit.perf.analyzer import run_perf_analyzer
    from tritonkit.runtime.server import TritonServer

    pipe, spec = pipeline(name), GATE[name]
    if build_first:
        build.build(name, progress=False)
    kind = kinds.get(name)
    if kind.spec.kind == "text-embedding":
        texts = data.split("benchmark")
        ceiling = lambda: baselines.onnx_text(texts, seconds, kind.NAME, "int8")  # noqa: E731
    else:
        photos = real_images()
        ceiling = lambda: baselines.onnx_image(photos, seconds, kind.NAME, "int8")  # noqa: E731
    ensemble = pipe.workloads[0]
    served, base = [], []
    kwargs = {"model_repository": repository} if repository else {}
    with tempfile.TemporaryDirectory(prefix="tritonkit-gate-") as tmp:
        rows = write_input_data(Path(tmp) / "input.json", ensemble.rows())
        with TritonServer.on_free_ports(model_control_mode="explicit", models=[ensemble.model], **kwargs) as server:
            for _ in range(repeats):
                served.append(run_perf_analyzer(ensemble.model, server.grpc_url, spec["concurrency"], rows,
                                                protocol="grpc", measurement_ms=measurement_ms,
                                                stability_percentage=50).throughput)
                base.append(ceiling().throughput)
    out = {"served": st.median(served), "baseline": st.median(base), "served_runs": served, "baseline_runs": base}
    out["ratio"] = out["served"] / out["baseline"]
    out["min_ratio"] = spec["min_ratio"]
    return out
