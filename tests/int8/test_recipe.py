"""INT8 gates: measured here on the held-out test split (never read back from a report), against the spec's
constants, which are the project's stated gates; and the refusal of a model that must not be served."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.support.zoo import ZOO  # built by `make test-zoo` only (tens of minutes on 2 cores)
from tritonkit import data, envinfo, kinds, paths
from tritonkit.export import row_metric
from tritonkit.int8.budget import AFTER_SEARCH_SHARE

# The gates the project states per kind (README, docs/int8-search.md); a spec may tighten them, never loosen them.
STATED = {
    "text-embedding": {"cosine_min": 0.99, "cosine_mean": 0.996, "top10_overlap": 0.93, "int8_speedup": 1.0},
    "image-classification": {"top1_agreement": 0.98, "top1_agreement_margin0.05": 1.0, "top5_agreement": 0.95,
                             "int8_speedup": 1.0},
    "text-rerank": {"kendall_tau_mean": 0.95, "kendall_tau_worst10": 0.8, "top1_agreement": 0.95, "int8_speedup": 1.0},
    "text-classification": {"top1_agreement": 0.98, "top1_agreement_margin0.05": 1.0, "kl_mean": 0.01,
                            "int8_speedup": 1.0},
}
SPECS = kinds.names()
# How far under the FP32 graph's own bf16 result INT8 may fall, and the bounds no floor loosens (docs/int8-search.md).
SLACK = {"top1_agreement": 0.02, "top1_agreement_margin0.05": 0.01, "top5_agreement": 0.02}
CATASTROPHE = {"top1_agreement_margin0.1": 0.99, "fp32_top1_in_int8_top5": 0.995}


TEXT_SLACK = {"cosine_min": 0.005, "cosine_mean": 0.001, "top10_overlap": 0.03}
TEXT_CATASTROPHE = {"cosine_min": 0.98, "cosine_mean": 0.995}


def _bf16(fp32):
    """The FP32 graph with bf16 rounding emulated (tritonkit.int8.floor.emulate_bf16, checked against torch's bf16
    arithmetic in tests/int8/test_floor.py) on onnxruntime: the served form's floor on every CPU, as the build's."""
    import onnx

    from tritonkit.int8 import evaluate, floor

    return evaluate.session(floor.emulate_bf16(onnx.load(str(fp32))))


def _bf16_outputs(fp32, x):
    sess = _bf16(fp32)
    return np.concatenate([sess.run(None, {"pixels": x[i : i + 64]})[0] for i in range(0, len(x), 64)])


def _specs(kind: str) -> list:
    return [pytest.param(n, marks=[pytest.mark.zoo] if n in ZOO else []) for n in SPECS
            if kinds.get(n).spec.kind == kind]


TEXT, IMAGE = _specs("text-embedding"), _specs("image-classification")


@pytest.mark.parametrize("name", SPECS)
def test_spec_gates_are_at_least_the_stated_ones(name):
    kind = kinds.get(name)
    for metric, value in STATED[kind.spec.kind].items():
        # An upper gate (a divergence) is tightened by lowering it.
        assert (kind.gate(metric) <= value) if metric in kind.UPPER_GATES else (kind.gate(metric) >= value), metric


def _fallback(kind, built) -> bool:
    """True when this machine's build serves FP32 under the INT8 name (no candidate for this CPU's INT8 class):
    the INT8 name must then hold the FP32 graph, marked in its metadata, and in its config when every class fell
    back; the gates are not claimed."""
    from tests.support.int8_support import assert_fp32_fallback, fell_back
    from tritonkit.int8 import recipe
    from tritonkit.repository import generate

    if not fell_back(kind):
        return False
    assert_fp32_fallback(built.int8, built.fp32)
    if recipe.all_classes_fall_back(kind):
        config = generate.files([kind])[paths.MODEL_REPOSITORY / kind.INT8_MODEL / "config.pbtxt"]
        assert "tritonkit_precision" in config and "fp32-fallback" in config
    return True



@pytest.mark.slow
@pytest.mark.parametrize("name", TEXT)
def test_text_int8_meets_its_gates_on_the_test_split(name):
    from tritonkit import build

    built = build.build(name, progress=False)
    kind = kinds.get(name)
    if _fallback(kind, built):
        pytest.skip(f"{name} serves FP32 on this CPU's INT8 class (its fallback checked above)")
    texts = data.eval_texts("test")
    ref = kind.embed_onnx(kind.session(built.fp32), texts)
    sim_ref = ref @ ref.T  # unit vectors: cosine similarity
    np.fill_diagonal(sim_ref, -np.inf)
    top_ref = np.argsort(-sim_ref, axis=1)[:, :10]

    def metrics(got):
        cos = row_metric("cosine", ref, got)
        sim_got = got @ got.T
        np.fill_diagonal(sim_got, -np.inf)
        top_got = np.argsort(-sim_got, axis=1)[:, :10]
        return {"cosine_min": cos.min(), "cosine_mean": cos.mean(), "worst": texts[int(cos.argmin())][:80],
                "top10_overlap": np.mean([len(set(a) & set(b)) / 10 for a, b in zip(top_ref, top_got)])}

    got = metrics(kind.embed_onnx(kind.session(built.int8), texts))
    floor = metrics(kind.embed_onnx(_bf16(built.fp32), texts))
    for metric, slack in TEXT_SLACK.items():
        bound = max(min(kind.gate(metric), floor[metric] - slack) if metric in floor else kind.gate(metric),
                    TEXT_CATASTROPHE.get(metric, 0.0))
        assert got[metric] >= bound - 1e-9, (metric, got[metric], "floor", floor.get(metric), "bound", bound,
                                              got["worst"])


@pytest.mark.slow
@pytest.mark.parametrize("name", IMAGE)
def test_image_int8_meets_its_gates_on_the_test_split(name):
    from tritonkit import build
    from tritonkit.kinds.image import run_onnx, softmax

    built = build.build(name, progress=False)
    kind = kinds.get(name)
    if _fallback(kind, built):
        pytest.skip(f"{name} serves FP32 on this CPU's INT8 class (its fallback checked above)")
    x = kind.pixels("test")
    ref = run_onnx(kind.session(built.fp32, threads=2), x)
    p = np.sort(softmax(ref.astype(np.float64)), axis=1)
    ref_top = np.argsort(-ref, axis=1)[:, :5]

    def metrics(got):
        got_top = np.argsort(-got, axis=1)[:, :5]
        agree = ref_top[:, 0] == got_top[:, 0]
        return {"top1_agreement": agree.mean(), "top5_agreement": np.mean(
                    [len(set(a) & set(b)) / 5 for a, b in zip(ref_top, got_top)]),
                "top1_agreement_margin0.05": agree[p[:, -1] - p[:, -2] >= 0.05].mean(),
                "top1_agreement_margin0.1": agree[p[:, -1] - p[:, -2] >= 0.1].mean(),
                "fp32_top1_in_int8_top5": np.mean([a in b for a, b in zip(ref_top[:, 0], got_top)])}

    got = metrics(run_onnx(kind.session(built.int8, threads=2), x))
    floor = metrics(_bf16_outputs(built.fp32, x))
    for metric, slack in SLACK.items():
        bound = min(kind.gate(metric), floor[metric] - slack) if metric in floor else kind.gate(metric)
        assert got[metric] >= bound - 1e-9, (metric, got[metric], "floor", floor.get(metric), "bound", bound)
    for metric, bound in CATASTROPHE.items():
        assert got[metric] >= bound, (metric, got[metric])


def _check(tmp_path, report: dict | None) -> subprocess.CompletedProcess:
    reports = tmp_path / "reports"
    reports.mkdir(exist_ok=True)
    path = reports / "text_embedding_int8.json"
    if report is None:
        path.unlink(missing_ok=True)
    else:
        path.write_text(json.dumps(report))
    env = {**os.environ, "TRITONKIT_BUILD_OUTPUTS": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "tritonkit.int8.report", "check", "text_embedding"], env=env,
                          cwd=paths.ROOT, capture_output=True, text=True, timeout=120)


def test_serving_refuses_a_failed_or_foreign_int8_model(tmp_path):
    here = envinfo.fingerprint()
    ok = _check(tmp_path, {"status": "passed", "passed": True, "env": here})
    assert ok.returncode == 0, ok.stderr
    failed = _check(tmp_path, {"status": "failed", "passed": False, "env": here,
                               "missed": ["test: cosine_min 0.9800 (gate >= 0.99)"]})
    assert failed.returncode == 2 and "cosine_min 0.9800" in failed.stderr
    assert "python -m tritonkit.build text_embedding --search" in failed.stderr
    other_cpu = {**here, "cpu_int8_features": [f for f in here["cpu_int8_features"] if "vnni" not in f] + ["x"]}
    foreign = _check(tmp_path, {"status": "passed", "passed": True, "env": other_cpu})
    assert foreign.returncode == 2 and "CPU INT8 features" in foreign.stderr and "make build" in foreign.stderr
    other_pkg = {**here, "packages": {**here["packages"], "onnxruntime": "0.0.1"}}
    stale = _check(tmp_path, {"status": "passed", "passed": True, "env": other_pkg})
    assert stale.returncode == 2 and "onnxruntime 0.0.1 -> " in stale.stderr
    missing = _check(tmp_path, None)
    assert missing.returncode == 2 and "no INT8 report" in missing.stderr
    fallback = _check(tmp_path, {"status": "fp32-fallback", "passed": False, "env": other_pkg})
    assert fallback.returncode == 0, "an FP32 fallback is served (loudly), not refused"


def test_the_build_commands_help_renders():
    """`python -m tritonkit.build --help` once died formatting a percentage in a help string (argparse's %)."""
    from tritonkit import build

    text = build.arguments().format_help()
    assert "--budget-minutes" in text and f"{AFTER_SEARCH_SHARE * 100:.0f}% of M" in text
