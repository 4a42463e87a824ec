"""Served rerankers and text classifiers against Infinity and sentence-transformers' CrossEncoder, same run.

    python perf/bench_cross_encoders.py [--tasks rerank classify] [--repeats 3] [--seconds 10] [--concurrency 16]

rerank (spec minilm_l6_rerank): a request is one query with DOCS documents (real queries and documents of the
eval corpus's test split, each pair within the model's 256 tokens, so no contender truncates). Our ensemble and
fused model on Triton's HTTP/REST infer endpoint (one request = DOCS rows of `query`, `document`), Infinity's
POST /rerank, all driven by wrk (tritonkit.perf.peers.http_point: closed loop, `--concurrency` keep-alive
connections), and CrossEncoder.predict in-process at its best batch size. Pairs/s.
classify (spec minilm_l6_classifier): one benchmark text per request; our models and Infinity's POST /classify
under the same wrk load. Texts/s.

Infinity runs on sentence-transformers' CrossEncoder ONNX export of the same directory (FP32, and its dynamic
qint8 exports), on ONNX Runtime's CPU provider and, where the infinity-openvino venv installs, its OpenVINO
provider; every form that starts is timed (a short wrk run each) and the fastest is the one measured, its rank /
top-1 agreement with CrossEncoder FP32 recorded beside it. Then every contender once per round, `--repeats`
interleaved rounds, median each; ratios are of medians within this run. Writes perf/results/<stamp>-cross-encoders/
(summary.md, results.json). The peer venvs are installed from perf/peers/*.lock when missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import data, envinfo, kinds, paths
from tritonkit.perf import peers
from tritonkit.perf.analyzer import PerfPoint
from tritonkit.perf.lab import Contender, compare

SPECS = {"rerank": "minilm_l6_rerank", "classify": "minilm_l6_classifier"}
DOCS = 20  # documents per rerank request
QUERIES = 64
INFINITY_FORMS = (("onnxruntime", "onnx"), ("onnxruntime", "avx512_vnni"), ("onnxruntime", "avx512"),
                  ("openvino", "onnx"), ("openvino", "avx512_vnni"))
CE_BATCHES = (8, 16, 32, 64)
AGREEMENT_ROWS = 16 * DOCS  # whole queries


def rerank_requests(kind) -> list[tuple[str, list[str]]]:
    """(query, DOCS documents) per request: each query's ranking group of the test split, pairs past the model's
    max length dropped (so neither side truncates: Infinity cuts at 512 positions, we and CrossEncoder at 256)."""
    from tritonkit.kinds.rerank import ranking_items

    rows = ranking_items("test", queries=QUERIES, group=DOCS + 8)
    tok = kind._tokenizer(10_000)
    fits = [len(e.ids) <= kind.MAX_LENGTH for e in tok.encode_batch(rows)]
    by_query: dict[str, list[str]] = {}
    for (query, doc), ok in zip(rows, fits, strict=True):
        if ok:
            by_query.setdefault(query, []).append(doc)
    return [(q, docs[:DOCS]) for q, docs in by_query.items() if len(docs) >= DOCS]


def workload(task: str, kind) -> tuple[list, int, str, list]:
    """(requests, rows per request, unit, rows): a rerank request is one query's DOCS pairs, a classify request one
    benchmark text."""
    if task == "rerank":
        items = rerank_requests(kind)
        return items, DOCS, "pairs", [(q, d) for q, docs in items for d in docs]
    items = [[t] for t in data.split("benchmark")]
    return items, 1, "texts", [t[0] for t in items]


def token_lengths(kind, rows: list) -> dict[str, float]:
    """Tokens per row as the model reads them (special tokens included): what a throughput in rows/s is made of."""
    import numpy as np

    lengths = np.array([len(e.ids) for e in kind._tokenizer(10_000).encode_batch(rows)])
    return {"mean": round(float(lengths.mean()), 1), **{f"p{q}": float(np.percentile(lengths, q)) for q in (50, 90)},
            "max": float(lengths.max())}


def triton_rerank(http_url: str, model: str, label: str) -> peers.PeerServer:
    host, port = http_url.rsplit(":", 1)

    def body(item: tuple[str, list[str]]) -> bytes:
        query, docs = item
        n = len(docs)
        return json.dumps({"inputs": [
            {"name": "query", "shape": [n, 1], "datatype": "BYTES", "data": [query] * n},
            {"name": "document", "shape": [n, 1], "datatype": "BYTES", "data": list(docs)}],
            "outputs": [{"name": "score"}]}).encode()

    return peers.PeerServer(label, host, int(port), f"/v2/models/{model}/infer", body,
                            lambda r: r["outputs"][0]["data"])


def triton_classify(http_url: str, model: str, label: str) -> peers.PeerServer:
    host, port = http_url.rsplit(":", 1)

    def body(texts: list[str]) -> bytes:
        return json.dumps({"inputs": [{"name": "text", "shape": [len(texts), 1], "datatype": "BYTES",
                                       "data": list(texts)}], "outputs": [{"name": "scores"}]}).encode()

    return peers.PeerServer(label, host, int(port), f"/v2/models/{model}/infer", body,
                            lambda r: r["outputs"][0]["data"])


def scaled(point: PerfPoint, per_request: int) -> PerfPoint:
    """A wrk point in items/s (pairs or texts) rather than requests/s."""
    return dataclasses.replace(point, throughput=point.throughput * per_request)


def agreement(task: str, kind, ref, server: peers.PeerServer, items: list) -> dict:
    """A server's answers to `items` against FP32 transformers' logits `ref` (one row per pair or text): rank
    agreement per query (rerank) or top-1 agreement (classify)."""
    import numpy as np

    from tritonkit.kinds.rerank import ranking_agreement

    got = [server.embedding(json.loads(peers._post(server, server.body(item)))) for item in items]
    if task == "rerank":
        m = ranking_agreement(ref, np.asarray([s for g in got for s in g]), group=DOCS)
        return {k: round(m[k], 4) for k in ("kendall_tau_mean", "top1_agreement")}
    labels = kind.spec.facts.labels
    # Ours answers the scores in label order, Infinity {label, score} records.
    top = [int(np.argmax(row)) if isinstance(row[0], float) else
           labels.index(max(row[0], key=lambda x: x["score"])["label"]) for row in got]
    return {"top1_agreement": round(float(np.mean(np.asarray(top) == ref.argmax(1))), 4)}


def best_infinity(task: str, kind, items: list, per_request: int, ref, args, stack,
                  progress=print) -> tuple[peers.PeerServer | None, dict]:
    """Every Infinity form that starts, timed by one short wrk run each; the fastest stays up in `stack`."""
    forms: dict[str, dict] = {}
    best: tuple[float, peers.PeerServer, contextlib.ExitStack, str] | None = None
    for provider, form in (tuple(f.split("/")) for f in args.infinity_forms):
        key = f"{provider}/{form}"
        own = contextlib.ExitStack()
        try:
            peers.ce_prepare(kind.model_dir(), form)
            progress(f"[{task}] Infinity {key} starting ...")
            server = own.enter_context(peers.infinity_task(kind.model_dir(), kind.NAME, task, form, provider))
            acc = agreement(task, kind, ref, server, items[: len(ref) // per_request])
            rate = scaled(peers.http_point(server, items, args.concurrency, args.pick_seconds, args.warmup),
                          per_request).throughput
            forms[key] = {"label": server.label, "per_s": round(rate, 1), **acc}
            progress(f"[{task}] Infinity {key}: {rate:.1f}/s {acc}")
            if best is None or rate > best[0]:
                if best is not None:
                    best[2].close()
                best = (rate, server, own, key)
            else:
                own.close()
        except peers.PeerUnavailable as e:
            own.close()
            forms[key] = {"unavailable": str(e).splitlines()[0][:300]}
            progress(f"[{task}] Infinity {key} unavailable: {str(e)[:300]}")
    if best is None:
        return None, {"forms": forms}
    stack.push(best[2])
    return best[1], {"chosen": best[3], "forms": forms,
                     "reason": f"fastest under wrk at c={args.concurrency} ({args.pick_seconds:.0f} s each)"}


def run_task(task: str, args, progress=print) -> dict:
    from tritonkit import build
    from tritonkit.runtime.server import TritonServer

    name = SPECS[task]
    kind = kinds.get(name)
    build.build(name, progress=False, forms=("served",))  # a no-op when current
    items, per_request, unit, pairs = workload(task, kind)
    # FP32 transformers on the first rows (what CrossEncoder computes): Infinity's forms are read against it.
    ref = kind.hf_logits(pairs[:AGREEMENT_ROWS])
    result: dict = {"task": task, "spec": name, "unit": unit, "per_request": per_request, "requests": len(items),
                    "tokens": token_lengths(kind, pairs)}
    models = [kind.PREPROCESSOR, kind.INT8_MODEL, name, f"{name}_fused"]
    server = TritonServer.on_free_ports(model_control_mode="explicit", models=models)
    progress(f"[{task}] starting tritonserver with {', '.join(server.models)} ...")
    with server, contextlib.ExitStack() as stack:
        ours = triton_rerank if task == "rerank" else triton_classify

        def wrk(target: peers.PeerServer):
            return lambda: scaled(peers.http_point(target, items, args.concurrency, args.seconds, args.warmup),
                                  per_request)

        contenders = [
            Contender("fused", wrk(ours(server.http_url, f"{name}_fused",
                                        f"tritonkit {name}_fused (Triton HTTP, wrk)")), "server"),
            Contender("ensemble", wrk(ours(server.http_url, name, f"tritonkit {name} (Triton HTTP, wrk)")), "server"),
        ]
        result["agreement"] = {c.key: agreement(task, kind, ref, ours(server.http_url, m, m),
                                                items[: len(ref) // per_request])
                               for c, m in zip(contenders, (f"{name}_fused", name), strict=True)}
        inf, result["infinity"] = best_infinity(task, kind, items, per_request, ref, args, stack, progress)
        if inf is not None:
            contenders.append(Contender("infinity", wrk(inf), "server"))
        if task == "rerank":
            progress(f"[{task}] CrossEncoder batch sizes {CE_BATCHES} ...")
            sizes = peers.ce_points(pairs, kind.model_dir(), peers.CE_FP32, CE_BATCHES, args.pick_seconds)
            best = max(zip(CE_BATCHES, sizes, strict=True), key=lambda bp: bp[1].throughput)
            result["crossencoder_batches"] = {b: round(p.throughput, 1) for b, p in zip(CE_BATCHES, sizes,
                                                                                          strict=True)}
            contenders.append(Contender("crossencoder", lambda b=best[0]: peers.ce_points(
                pairs, kind.model_dir(), peers.CE_FP32, [b], args.seconds)[0]))
        measured = compare(task, contenders, args.repeats, progress)
    result["points"] = {c.key: p.to_json() for c, p in measured}
    return result


def markdown(results: list[dict], meta: dict) -> str:
    lines = [f"# Cross-encoders against their peers ({meta['date']})", "",
             f"`{meta['command']}` at {meta['commit']}; {meta['cpu']} ({meta['cores']} cores, INT8 class "
             f"`{meta['int8_class']}`), load {meta['load_before']} before, {meta['load_after']} after.", ""]
    for r in results:
        pts = r["points"]
        lines += [f"## {r['task']} ({r['spec']}; {r['per_request']} {r['unit']} per request, c={meta['c']})", "",
                  f"| contender | {r['unit']}/s | p50 ms | p99 ms | fused ÷ it | ensemble ÷ it |",
                  "|---|---:|---:|---:|---:|---:|"]
        for p in pts.values():
            fx = pts["fused"]["throughput"] / p["throughput"] if p["throughput"] else 0
            ex = pts["ensemble"]["throughput"] / p["throughput"] if p["throughput"] else 0
            lines.append(f"| {p['label']} | {p['throughput']:.1f} | {p['p50_ms']:.1f} | {p['p99_ms']:.1f} | "
                         f"{fx:.2f}× | {ex:.2f}× |")
        if "tokens" in r:
            lines += ["", f"Tokens per row: {json.dumps(r['tokens'])}"]
        lines += ["", f"Agreement with FP32 transformers on the first {AGREEMENT_ROWS} rows: "
                  + json.dumps(r.get("agreement", {}))]
        inf = r.get("infinity", {})
        lines += ["", f"Infinity forms ({inf.get('reason', 'none started')}; chosen {inf.get('chosen')}):", ""]
        lines += [f"- {k}: {json.dumps(v)}" for k, v in inf.get("forms", {}).items()]
        if "crossencoder_batches" in r:
            lines += [f"- CrossEncoder FP32 {r['unit']}/s by batch: {json.dumps(r['crossencoder_batches'])}"]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--pick-seconds", type=float, default=12.0, help="each Infinity form's and batch size's run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=float, default=5.0, help="wrk warm-up before each timed run (seconds)")
    parser.add_argument("--infinity-forms", nargs="+", default=[f"{p}/{f}" for p, f in INFINITY_FORMS],
                        help="Infinity's forms to time (provider/export), the fastest measured")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--lengths", action="store_true", help="print each task's tokens per row and exit")
    args = parser.parse_args(argv)
    if args.lengths:
        for task in args.tasks:
            kind = kinds.get(SPECS[task])
            print(task, json.dumps(token_lengths(kind, workload(task, kind)[3])))
        return 0
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out or paths.ROOT / "perf" / "results" / f"{stamp}-cross-encoders"
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=paths.ROOT)
    meta = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "c": args.concurrency,
            "command": "python perf/bench_cross_encoders.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "commit": commit.stdout.strip(), "cpu": envinfo.cpu_model(), "cores": os.cpu_count(),
            "int8_class": envinfo.int8_class(), "load_before": os.getloadavg()[0]}
    start = time.monotonic()
    results = [run_task(task, args) for task in args.tasks]
    meta.update(load_after=os.getloadavg()[0], minutes=round((time.monotonic() - start) / 60, 1))
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    (out / "summary.md").write_text(markdown(results, meta))
    print(markdown(results, meta))
    print(f"wrote {paths.rel(out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
