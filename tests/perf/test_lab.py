"""The perf lab: perf_analyzer's real CSV parsed in both load modes, and the lab's CSV / JSON / Markdown / PNG
written from real measurements."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.support.tiny_models import B, W
from tritonkit import paths
from tritonkit.perf import lab, stats
from tritonkit.perf.analyzer import (
    PerfPoint,
    run_perf_analyzer,
    time_in_process,
    write_input_data,
)

CONCURRENCY = 2
RATE = 40.0


@pytest.fixture(scope="module")
def measured(start_server, smoke_repository, tmp_path_factory) -> dict[str, PerfPoint]:
    """smoke_linear measured once closed-loop (gRPC) and once open-loop (HTTP), with the server-side split."""
    data = write_input_data(tmp_path_factory.mktemp("perf") / "input.json",
                            [{"X": {"content": [float(i), 0.5, -1.0, 2.0], "shape": [4]}} for i in range(4)])
    server = start_server(smoke_repository, models=["smoke_linear"])
    points = {}
    try:
        for mode, url, protocol, kwargs in (("concurrency", server.grpc_url, "grpc", {}),
                                            ("rate", server.http_url, "http", {"request_rate": RATE})):
            before = stats.read(server.http_url, ["smoke_linear"])
            point = run_perf_analyzer("smoke_linear", url, CONCURRENCY if mode == "concurrency" else 0, data,
                                      protocol=protocol, measurement_ms=500, label=f"smoke {mode}", **kwargs)
            point.stats = stats.between(before, stats.read(server.http_url, ["smoke_linear"]))
            points[mode] = point
    finally:
        server.stop()
    return points


def _check_latencies(p: PerfPoint) -> None:
    assert p.throughput > 0 and p.avg_ms > 0
    assert 0 < p.p50_ms <= p.p95_ms <= p.p99_ms, p
    assert p.p50_ms <= p.p90_ms <= p.p99_ms
    assert p.server["queue_us"] >= 0 and p.server["compute_infer_us"] > 0  # --verbose-csv server columns


def test_concurrency_run_parses_into_a_closed_loop_point(measured):
    p = measured["concurrency"]
    assert (p.label, p.concurrency, p.request_rate) == ("smoke concurrency", CONCURRENCY, 0.0)
    _check_latencies(p)


def test_request_rate_run_parses_into_an_open_loop_point(measured):
    p = measured["rate"]
    assert (p.label, p.concurrency, p.request_rate) == ("smoke rate", 0, RATE)
    _check_latencies(p)
    # Open loop: a tiny model keeps up, so what is served is about what is offered.
    assert 0.5 * RATE <= p.throughput <= 1.5 * RATE


def test_statistics_split_covers_the_measured_requests(measured):
    for p in measured.values():
        split = p.stats["smoke_linear"]
        assert split["requests"] > 0 and split["compute_ms"] > 0 and split["queue_ms"] >= 0
        assert split["batch"] >= 1


def _relabel(p: PerfPoint, label: str, **changes) -> PerfPoint:
    return dataclasses.replace(p, label=label, stats=dict(p.stats), server=dict(p.server), **changes)


@pytest.fixture(scope="module")
def lab_results(measured) -> dict[str, dict]:
    """The smoke measurements standing in for both pipelines (real labels, units and ratio rules), and a real
    in-process baseline: the same linear map in numpy."""
    conc, rate = measured["concurrency"], measured["rate"]
    rows = [[float(i), 0.5, -1.0, 2.0] for i in range(4)]
    results = {}
    for name, pipe in lab.PIPELINES.items():
        ensemble = pipe.workloads[0].label
        alone = next(w.label for w in pipe.workloads if not w.ensemble)
        served = [_relabel(conc, ensemble, concurrency=1, throughput=conc.throughput / 2),
                  _relabel(conc, ensemble), _relabel(rate, ensemble), _relabel(conc, alone)]
        base = time_in_process(lambda x: np.asarray([x], np.float32) @ W + B, rows, CONCURRENCY, duration_s=0.2,
                               label=f"{name} numpy")
        results[name] = {"served": served, "baseline": [base]}
    return results


def test_write_outputs_writes_csv_json_markdown_and_a_plot_per_pipeline(lab_results, tmp_path):
    settings = lab.Settings(concurrencies=(1, CONCURRENCY), repeats=1, measurement_ms=500)
    files = lab.write_outputs(tmp_path / "out", lab_results, settings, "python perf/lab.py --quick")
    assert set(files) == {"csv", "json", "md", "png_text", "png_image"}

    with open(files["csv"], newline="") as f:
        rows = list(csv.DictReader(f))
        header = list(rows[0])
    assert header == [*lab.CSV_FIELDS, "smoke_linear_queue_ms", "smoke_linear_compute_ms", "smoke_linear_batch"]
    assert len(rows) == sum(len(r["served"]) + len(r["baseline"]) for r in lab_results.values())
    text_rows = [r for r in rows if r["pipeline"] == "text"]
    assert [r["mode"] for r in text_rows] == ["concurrency", "concurrency", "rate", "concurrency", "concurrency"]
    assert float(text_rows[2]["request_rate"]) == RATE
    assert float(text_rows[0]["smoke_linear_batch"]) >= 1
    assert text_rows[-1]["smoke_linear_batch"] == ""  # the baseline has no server split

    doc = json.loads(files["json"].read_text())
    assert doc["meta"]["command"] == "python perf/lab.py --quick"
    assert doc["meta"]["settings"]["measurement_ms"] == 500
    for name, r in lab_results.items():
        out = doc["pipelines"][name]
        assert len(out["served"]) == len(r["served"]) and len(out["baseline"]) == 1
        (ratio,) = out["ratios"]  # one ensemble workload × one baseline point
        best = r["served"][1]  # no point at ratio_concurrency: the best closed-loop point stands in
        assert ratio["served"] == lab.PIPELINES[name].workloads[0].label
        assert ratio["served_best_c"] == ratio["served_at_c"] == CONCURRENCY
        assert ratio["ratio_best"] == pytest.approx(best.throughput / r["baseline"][0].throughput)

    md = files["md"].read_text()
    assert md.startswith("# perf lab")
    for name, pipe in lab.PIPELINES.items():
        assert f"## {name}" in md and f"![{name}]({name}.png)" in md
        assert f"| {pipe.workloads[0].label} | c={CONCURRENCY} |" in md
        assert f"| {pipe.workloads[0].label} | rate {RATE:g}/s |" in md
        assert f"| {name} numpy (in-process) | c={CONCURRENCY} |" in md
        assert f"| {pipe.workloads[0].label} | {name} numpy |" in md  # the ratio row
        assert "smoke_linear q " in md  # server split column

    for name in lab.PIPELINES:
        png = files[f"png_{name}"]
        assert png == tmp_path / "out" / f"{name}.png"
        assert png.stat().st_size > 20_000
        with Image.open(png) as img:
            assert img.format == "PNG" and img.width > 1000 and img.height > 400
            colors = img.convert("RGB").getcolors(maxcolors=1 << 20)
            assert colors is not None and len(colors) > 50  # curves, markers and text drawn, not a blank canvas


def test_lab_help_exits_zero():
    proc = subprocess.run([sys.executable, str(Path("perf") / "lab.py"), "--help"], cwd=paths.ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--pipelines" in proc.stdout and "--quick" in proc.stdout


@pytest.mark.parametrize("name", ["text_embedding", "image_classification"])
def test_an_fp32_fallback_is_not_labelled_int8(name):
    """The INT8 model name of an FP32 fallback holds the FP32 graph; the lab's rows must not call it INT8."""
    from tests.support.int8_support import holds_fp32_graph

    # What this machine's INT8 file holds, judged on the graph itself; unbuilt, what this CPU class's recipe says.
    from tritonkit import kinds
    from tritonkit.int8 import recipe
    spec = kinds.get(name)
    served, fp32 = (paths.MODEL_REPOSITORY / m / "1" / "model.onnx" for m in (spec.INT8_MODEL, spec.FP32_MODEL))
    fallback = holds_fp32_graph(served, fp32) if served.exists() and fp32.exists() else \
        getattr((recipe.load_recipes(spec) or {}).get("served"), "status", None) == recipe.FALLBACK
    label = lab.pipeline(name).workloads[0].label
    assert ("FP32 fallback" in label) == fallback, label
    assert ("INT8" in label) != fallback, label
