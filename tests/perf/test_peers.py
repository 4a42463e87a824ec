"""Peers and the perf lab's peer table: the one HTTP load generator against our real server (and Infinity when its
venv is installed), sentence-transformers on OpenVINO FP32 and NNCF INT8 (when their venv is installed), the
in-process ceiling, and the table's ratios."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import types

import numpy as np
import pytest

from tritonkit import data, kinds, paths
from tritonkit.perf import baselines, lab, peers
from tritonkit.perf.analyzer import PerfPoint

TEXT = "text_embedding"


def _point(label: str, throughput: float, concurrency: int = 16, **kw) -> PerfPoint:
    return PerfPoint(label=label, concurrency=concurrency, throughput=throughput, p50_ms=10.0, p99_ms=20.0, **kw)


def test_peer_table_states_served_over_every_contender_and_tokens():
    pipe = lab.pipeline(TEXT)
    ensemble = pipe.workloads[0].label
    result = {
        "served": [_point(ensemble, 600.0), _point(ensemble, 300.0, concurrency=1),
                   _point(ensemble, 700.0, request_rate=650.0, concurrency=0)],
        "peers": [_point("tritonkit text_embedding (Triton HTTP/REST)", 550.0), _point("Infinity", 275.0)],
        "baseline": [_point("in-process INT8", 500.0, concurrency=1)],
        "skipped": [{"label": "TEI", "reason": "not installable"}],
        "mean_tokens": 12.5,
        "ceiling": "in-process INT8",
    }
    rows = {r["label"]: r for r in lab.peer_table(pipe, result)}
    served = rows[f"{ensemble}, perf_analyzer"]
    assert served["throughput"] == 600.0 and served["served_x"] == pytest.approx(1.0)  # the c=16 point, not c=1
    assert rows["Infinity"]["served_x"] == pytest.approx(600 / 275)
    assert rows["Infinity"]["served_http_x"] == pytest.approx(550 / 275)
    assert rows["in-process INT8"]["served_x"] == pytest.approx(600 / 500)
    assert rows["in-process INT8"]["tokens_per_s"] == pytest.approx(500 * 12.5)
    assert rows["Infinity"]["ceiling_x"] == pytest.approx(500 / 275)
    assert rows["in-process INT8"]["ceiling_x"] == pytest.approx(1.0)
    assert [r["where"] for r in rows.values()] == ["served", "server", "server", "in-process"]
    md = "\n".join(lab.peer_markdown(pipe, result))
    assert "| Infinity | server | 16 | 275.0 | 3438 | 10.0 | 20.0 | 2.18× | 2.00× | 1.82× |" in md
    assert "our INT8 file in-process ÷ it |" in md
    assert "skipped: TEI: not installable" in md


def test_a_missing_peer_venv_is_reported_not_installed(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS_DIR", tmp_path)
    with pytest.raises(peers.PeerUnavailable, match="infinity: not installed"):
        peers.ensure("infinity", install=False)


def test_openvino_int8_peer_needs_calibration_texts_apart_from_the_timed_ones():
    kind = kinds.get(TEXT)
    with pytest.raises(ValueError, match="calibration texts"):
        peers.st_points(data.split("benchmark")[:32], kind.model_dir(), kind.MAX_LENGTH, "openvino-int8", [32], 0.1)
    with pytest.raises(ValueError, match="unknown sentence-transformers variant"):
        peers.st_points([], kind.model_dir(), kind.MAX_LENGTH, "openvino-fp16", [32], 0.1)


def _built(model: str) -> None:
    if not (paths.MODEL_REPOSITORY / model / "1" / "model.onnx").exists():
        pytest.skip(f"{model} is not built (make build)")


@pytest.mark.slow
def test_load_generator_gets_real_embeddings_from_our_server(start_server):
    kind = kinds.get(TEXT)
    _built(kind.INT8_MODEL)
    server = start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=[TEXT], per_replica=True,
                          replica_kinds=[kind])  # as `make serve` serves it on this CPU
    ours = peers.triton_http(server.http_url, TEXT)
    texts = data.split("benchmark")
    got = np.asarray(ours.embedding(json.loads(peers._post(ours, ours.body(texts[0])))), np.float32)
    sess = kind.session(baselines.onnx_file(TEXT, "int8"))
    want = sess.run(["embedding"], kind.encode(texts[:1]))[0][0]
    assert got.shape == (kind.DIM,) and float(got @ want) > 0.999  # both L2-normalised

    point = peers.http_point(ours, texts, concurrency=4, seconds=1.5)
    assert point.concurrency == 4 and point.throughput > 10 and 0 < point.p50_ms <= point.p99_ms

    broken = peers.triton_http(server.http_url, "no_such_model")
    with pytest.raises(peers.PeerUnavailable, match=r"HTTP 404.*unknown model"):
        peers.http_point(broken, texts, concurrency=2, seconds=0.5)
    # Requests that fail under load (the first one succeeds) fail the point too: wrk counts the 400s.
    bad = dataclasses.replace(ours, body=lambda t: ours.body(t) if t == texts[0] else b'{"inputs": 1}')
    with pytest.raises(peers.PeerUnavailable, match=r"requests failed under wrk.*'status': [1-9]"):
        peers.http_point(bad, texts[:8], concurrency=2, seconds=1)


@pytest.mark.slow
def test_in_process_ceiling_runs_the_built_int8_model():
    from tests.support.int8_support import assert_fp32_fallback, fell_back

    kind = kinds.get(TEXT)
    _built(kind.INT8_MODEL)
    point = baselines.onnx_text(data.split("benchmark"), 1.5, TEXT, "int8")
    fallback = fell_back(kind)
    if fallback:  # this CPU's INT8 class has no passing recipe: the INT8 file is the FP32 graph, said so
        assert_fp32_fallback(paths.MODEL_REPOSITORY / kind.INT8_MODEL / "1" / "model.onnx",
                             paths.MODEL_REPOSITORY / kind.FP32_MODEL / "1" / "model.onnx")
    assert ("FP32 fallback" if fallback else "INT8") in point.label, point.label
    assert point.throughput > 0 and point.p50_ms <= point.p99_ms


@pytest.mark.slow
def test_infinity_serves_the_same_model_under_the_same_load_generator():
    for name in ("infinity", "sentence-transformers"):
        if not peers.installed(peers.ENVS[name]):
            reason = f"{name} venv not installed ({paths.rel(peers.ENVS[name].dir)}; make perf-peers installs it)"
            print(f"skipped: {reason}")
            pytest.skip(reason)
    kind = kinds.get(TEXT)
    texts = data.split("benchmark")
    (st,) = peers.st_points(texts, kind.model_dir(), kind.MAX_LENGTH, "qint8", [32], 1.0, install=False)
    assert "qint8" in st.label and st.throughput > 0
    with peers.infinity(kind.model_dir(), TEXT, kind.spec.facts.pooling, install=False) as inf:
        got = np.asarray(inf.embedding(json.loads(peers._post(inf, inf.body(texts[0])))), np.float32)
        want = kind.sentence_transformer().encode(texts[:1], normalize_embeddings=True)[0]
        assert float(got @ want) / float(np.linalg.norm(got)) > 0.98  # qint8 vs FP32, same model
        point = peers.http_point(inf, texts, concurrency=4, seconds=1.5)
    assert point.throughput > 10 and point.p50_ms <= point.p99_ms


def _need_venv(name: str) -> None:
    if not peers.installed(peers.ENVS[name]):
        env = peers.ENVS[name]
        reason = f"{name} venv not installed ({paths.rel(env.dir)}; python -m tritonkit.perf.peers install {name})"
        print(f"skipped: {reason}")
        pytest.skip(reason)


def _fake_quantize_ops(xml) -> int:
    import openvino as ov

    return sum(op.get_type_name() == "FakeQuantize" for op in ov.Core().read_model(xml).get_ops())


@pytest.mark.slow
def test_openvino_peers_embed_like_torch_fp32_and_int8_is_quantized(tmp_path):
    """Both peers really run in their venv on a handful of texts: OpenVINO FP32 matches sentence-transformers' torch
    FP32, the NNCF INT8 IR holds quantize ops, is calibrated on texts apart from the embedded ones and stays close."""
    _need_venv("st-openvino")
    kind = kinds.get(TEXT)
    texts, calibration = data.split("benchmark")[:16], data.split("calibration")[:48]
    want = kind.sentence_transformer().encode(texts, normalize_embeddings=True)
    args = (texts, kind.model_dir(), kind.MAX_LENGTH)

    label, fp32 = peers.st_embeddings(*args, "openvino-fp32", install=False, cache=tmp_path)
    cos = (np.asarray(fp32, np.float32) * want).sum(1)
    assert "OpenVINO" in label and "FP32" in label and float(cos.min()) >= 0.999, (label, cos)

    label, int8 = peers.st_embeddings(*args, "openvino-int8", install=False, calibration=calibration, cache=tmp_path)
    cos = (np.asarray(int8, np.float32) * want).sum(1)
    assert "INT8" in label and "48 calibration texts" in label, label
    assert float(cos.mean()) >= 0.98, cos
    assert _fake_quantize_ops(tmp_path / peers.ST_OV_INT8_FILE) > 0
    assert _fake_quantize_ops(tmp_path / peers.ST_OV_FP32_FILE) == 0
    meta = json.loads((tmp_path / peers.ST_OV_INT8_META).read_text())
    assert meta["calibration_texts"] == 48 and meta["quantize_s"] > 0


@pytest.mark.slow
def test_lab_lists_and_times_the_openvino_peers_beside_the_others():
    """The lab's text contenders with --peers hold both OpenVINO peers (batch 32, calibrated on the calibration
    split) and each measures; the peers left out are reported skipped as asked."""
    _need_venv("st-openvino")
    # The qint8 peers are left out: choosing their export times three of them (tested above with Infinity).
    settings = lab.Settings(peers=True, install_peers=False, baseline_seconds=0.3,
                            skip_peers=("infinity", "st-qint8"))
    # Only its URL is read while the contenders are listed; none of ours is run here.
    server = types.SimpleNamespace(http_url="127.0.0.1:1")
    with contextlib.ExitStack() as stack:
        contenders, skipped = lab.pipeline(TEXT).contenders(settings, server, stack, print)
        by_key = {c.key: c for c in contenders}
        assert {"onnx_int8", "st_openvino_fp32", "st_openvino_int8"} <= set(by_key)
        assert "st_qint8" not in by_key and "infinity" not in by_key
        assert {"infinity", "st-qint8"} <= {s["label"] for s in skipped if "as asked" in s["reason"]}, skipped
        assert not any(s.get("failed") for s in skipped), skipped
        measured = lab.compare(TEXT, [by_key["st_openvino_fp32"], by_key["st_openvino_int8"]], 1)
    (_, fp32), (_, int8) = measured
    assert "OpenVINO" in fp32.label and "FP32" in fp32.label and fp32.label.endswith("batch 32")
    assert f"{peers.CALIBRATION_TEXTS} calibration texts" in int8.label and int8.label.endswith("batch 32")
    assert fp32.throughput > 0 and int8.throughput > 0


def test_a_peer_that_cannot_be_installed_fails_the_lab_before_it_measures(tmp_path):
    """`make perf-peers` with every peer unobtainable (uv offline with an empty cache, a fresh peers folder): the
    run exits non-zero at once, naming each peer and why, and measures nothing; an unknown --skip-peer is a usage
    error."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITONKIT_PEERS_DIR=str(tmp_path / "peers"), UV_OFFLINE="1",
               UV_CACHE_DIR=str(tmp_path / "uv-cache"), UV_NO_CONFIG="1")
    cmd = [sys.executable, "perf/lab.py", "--peers", "--quick", "--pipelines", "text", "--out", str(tmp_path / "out")]
    run = subprocess.run([*cmd, "--skip-peer", "st-openvino-int8"], capture_output=True, text=True, env=env,
                         cwd=paths.ROOT, timeout=300)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    for peer in ("infinity", "st-qint8", "st-openvino-fp32"):
        assert f"error: peer {peer} cannot be had:" in run.stderr, run.stderr
    assert "peer st-openvino-int8 cannot" not in run.stderr  # left out as asked, so not reported as missing
    assert "nothing measured" in run.stderr and "--skip-peer" in run.stderr
    assert not (tmp_path / "out" / "summary.md").exists() and not (tmp_path / "out" / "inputs").exists()

    bad = subprocess.run([*cmd, "--skip-peer", "tei"], capture_output=True, text=True, env=env, cwd=paths.ROOT,
                         timeout=120)
    assert bad.returncode == 2 and "unknown peer tei" in bad.stderr, bad.stderr


def test_the_summary_names_failed_and_skipped_peers_and_the_forms_chosen():
    pipe = lab.pipeline(TEXT)
    accuracy = {"cosine_min": 0.98, "cosine_mean": 0.991, "top10_overlap": 0.88}
    result = {
        "served": [_point(pipe.workloads[0].label, 600.0)], "peers": [], "baseline": [],
        "peer_forms": {
            "qint8": {"cpu": "some CPU, 2 cores, avx2", "chosen": "avx2", "reason": "the fastest of ...",
                      "eval_texts": 512,
                      "forms": {"avx2": {"accuracy": accuracy, "holds": True, "why_not": [], "texts_per_s": 140.0},
                                "avx512_vnni": {"accuracy": {**accuracy, "cosine_min": 0.9},
                                                "holds": False, "why_not": ["cosine_min 0.9000 < 0.9750"]}}},
            "infinity": {"chosen": "onnxruntime", "reason": "faster",
                         "forms": {"onnxruntime": {"texts_per_s": 160.0}, "openvino": {"unavailable": "no EP"}}}},
        "skipped": [{"label": "st-openvino-int8", "reason": "skipped as asked (--skip-peer)"},
                    {"label": "infinity", "reason": "exited with 1", "failed": True}],
    }
    md = "\n".join(lab.peer_markdown(pipe, result))
    assert "qint8 export **avx2**" in md and "some CPU, 2 cores, avx2" in md
    assert "| avx2 | 0.9800 | 0.99100 | 0.880 | yes | 140.0 |" in md
    assert "| avx512_vnni | 0.9000 |" in md and "no: cosine_min 0.9000 < 0.9750 | not timed |" in md
    assert "Infinity form: **onnxruntime**, faster (onnxruntime 160.0 texts/s; openvino no EP)." in md
    assert "skipped: st-openvino-int8: skipped as asked (--skip-peer)" in md
    assert "FAILED: infinity: exited with 1" in md
