"""A replica serves what its CPU class proved: the INT8 file and runtime recorded for that class, else the model's
FP32 file on ONNX Runtime under the same name, loudly and on the gauge. Real tritonserver instances over a tiny
classifier whose INT8 file differs from its FP32 file, the CPU class faked through $TRITONKIT_CPU_CLASS."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient

from tests.support.tiny_sources import classifier_loader
from tritonkit import add, envinfo, kinds
from tritonkit.errors import CpuClassError
from tritonkit.export import export_onnx
from tritonkit.int8 import recipe
from tritonkit.kinds import spec as specs
from tritonkit.perf.analyzer import metrics_counters
from tritonkit.repository import generate, replica
from tritonkit.serving.marks import INT8_SERVED_PARAMETER

SIZE = 32
# Ten times the served-vs-file tolerance below: the tiny INT8 file answers apart from its FP32 twin by ~1e-3, a
# little less on an AMD EPYC with AVX2 only (9.4e-4) than on a Xeon.
APART = 1e-4
RECIPE = {"form": "int8", "note": "the tiny test's recipe"}  # what the committed vnni entry proved


def _int8(fp32, out) -> None:
    """A real static INT8 (Q/DQ) of the FP32 file: its outputs differ from FP32's by more than rounding."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.batches = iter([{"pixels": rng.normal(size=(4, 3, SIZE, SIZE)).astype(np.float32)}
                                 for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(fp32), str(out), Reader(), quant_format=QuantFormat.QDQ)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A spec, its generated repository, an FP32 file and an INT8 file, and records proving INT8 on vnni only."""
    root = tmp_path_factory.mktemp("replica")
    loader = classifier_loader(root / "src")
    table = add.image_spec("tiny_rep", loader, {}, SIZE, None, [127.0] * 3, [128.0] * 3,
                           str(root / "src" / "labels.txt"), 10, 8)
    kind = kinds.from_spec(specs.load(add.add(table, directory=root / "models")))
    repo = root / "repo"
    for entry in generate.repository(kind):
        entry.config.write(repo)
    kind.write_assets(repo)  # the classifiers' labels file, as the build writes it
    fp32 = export_onnx(kind.EXPORT, repo / kind.FP32_MODEL / "1" / "model.onnx")
    int8 = repo / kind.INT8_MODEL / "1" / "model.onnx"
    int8.parent.mkdir(parents=True, exist_ok=True)
    _int8(fp32, int8)
    recipe.mark_recipe(int8, RECIPE)  # as the build's replay marks the file it wrote
    recipe.recipe_path(kind).write_text(json.dumps({"served": {
        "vnni": {"status": "passed", "recipe": RECIPE},
        "avx512": {"status": recipe.FALLBACK, "recipe": None}}}))
    models = {kind.INT8_MODEL: {"runtime": "onnxruntime"}, kind.FP32_MODEL: {"runtime": "onnxruntime"}}
    (root / "models" / "tiny_rep.runtime.json").write_text(json.dumps({"classes": {"vnni": {"models": models}}}))
    pixels = np.random.default_rng(1).normal(size=(3, 3, SIZE, SIZE)).astype(np.float32)
    want = {name: ort.InferenceSession(str(path)).run(["logits"], {"pixels": pixels})[0]
            for name, path in (("fp32", fp32), ("int8", int8))}
    # The two files must answer apart, or the served answers below could not tell which one ran.
    assert np.abs(want["fp32"] - want["int8"]).max() > APART
    return kind, repo, pixels, want


def _serve(start_server, kind, repo, monkeypatch, cpu_class: str):
    monkeypatch.setenv(envinfo.CLASS_ENV, cpu_class)
    return start_server(repo, models=[kind.INT8_MODEL, kind.FP32_MODEL], per_replica=True, replica_kinds=[kind])


def _logits(server, model: str, pixels: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        inp = httpclient.InferInput("pixels", list(pixels.shape), "FP32")
        inp.set_data_from_numpy(pixels)
        return client.infer(model, [inp]).as_numpy("logits")
    finally:
        client.close()


def _gauge(server, model: str) -> float:
    """The documented gauge, as Prometheus scrapes it from the server's metrics port."""
    return metrics_counters(server.metrics_url, prefix="tritonkit_int8_served")[("tritonkit_int8_served", model)]


def test_a_replica_of_an_unproven_class_serves_fp32_under_the_int8_name(start_server, tree, monkeypatch):
    kind, repo, pixels, want = tree
    server = _serve(start_server, kind, repo, monkeypatch, "avx2")
    got = _logits(server, kind.INT8_MODEL, pixels)
    np.testing.assert_allclose(got, want["fp32"], rtol=1e-5, atol=1e-5)
    assert np.abs(got - want["int8"]).max() > APART  # not the INT8 file vnni proved
    np.testing.assert_allclose(_logits(server, kind.FP32_MODEL, pixels), want["fp32"], rtol=1e-5, atol=1e-5)
    assert _gauge(server, kind.INT8_MODEL) == 0.0
    log = server.log_path.read_text()
    assert re.search(rf"{kind.INT8_MODEL}: SERVING FP32 UNDER AN INT8 NAME: .*CPU class avx2", log), log[-3000:]
    (decision,) = [d for d in server.replica_decisions if d.model == kind.INT8_MODEL]
    assert decision.loud and decision.variant == "onnxruntime" and "avx2" in decision.reason
    # The committed repository is left as it was: the view is a folder of its own.
    assert server.served_repository != repo and (repo / kind.INT8_MODEL / "1" / "model.onnx").is_file()


def test_a_replica_of_the_proven_class_serves_int8(start_server, tree, monkeypatch):
    kind, repo, pixels, want = tree
    server = _serve(start_server, kind, repo, monkeypatch, "vnni")
    np.testing.assert_allclose(_logits(server, kind.INT8_MODEL, pixels), want["int8"], rtol=1e-5, atol=1e-5)
    assert _gauge(server, kind.INT8_MODEL) == 1.0
    assert "SERVING FP32" not in server.log_path.read_text()


def test_the_rule_never_borrows_and_never_gives_bf16_to_a_cpu_without_it(tree):
    kind, repo, _, _ = tree
    entry = replica.record([kind], repo)["models"][kind.INT8_MODEL]
    assert replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=False).int8  # its runtime is f32 ONNX Runtime
    avx512 = replica.decide(entry, kind.INT8_MODEL, "avx512", bf16=True)
    assert not avx512.int8 and "runtime" in avx512.reason  # its search fell back, and no runtime was measured
    generic = replica.decide(entry, kind.INT8_MODEL, "generic", bf16=False)
    assert (generic.int8, generic.option, generic.variant) == (False, replica.FALLBACK, "onnxruntime")
    # A runtime proven in bf16 is not served where bf16 is not native.
    bf16 = {**entry, "classes": {"vnni": {**entry["classes"]["vnni"], "variant": "openvino-bf16",
                                          "needs_bf16": True}}}
    assert replica.decide(bf16, kind.INT8_MODEL, "vnni", bf16=True).int8
    no_bf16 = replica.decide(bf16, kind.INT8_MODEL, "vnni", bf16=False)
    assert (no_bf16.int8, no_bf16.variant) == (False, "onnxruntime") and "bf16" in no_bf16.reason


def test_an_int8_file_built_from_another_recipe_is_not_the_proven_one(tree, tmp_path):
    import shutil

    kind, repo, _, _ = tree
    other = tmp_path / "repo"
    shutil.copytree(repo, other)
    recipe.mark_recipe(other / kind.INT8_MODEL / "1" / "model.onnx", {**RECIPE, "note": "another class's"})
    entry = replica.record([kind], other)["models"][kind.INT8_MODEL]
    decision = replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=True)
    assert not decision.int8 and "not built from the recipe proven on vnni" in decision.reason


def test_the_cpu_class_is_faked_in_one_place(monkeypatch):
    monkeypatch.setenv(envinfo.CLASS_ENV, "avx2")
    assert envinfo.int8_class() == "avx2" and not envinfo.has_bf16()
    assert envinfo.int8_class(["avx512_vnni"]) == "vnni"  # a class of given flags is not faked
    monkeypatch.setenv(envinfo.CLASS_ENV, "zen9")
    with pytest.raises(CpuClassError, match="vnni, avx512, avx2, generic"):
        envinfo.int8_class()


def test_an_ngc_view_carries_the_record_and_the_supervisor_serves_this_cpus_view(tree, tmp_path, monkeypatch):
    from tritonkit.repository import native_check, variants
    from tritonkit.repository.config import parse_config
    from tritonkit.runtime import supervisor

    kind, repo, _, _ = tree
    ngc = variants.ngc_view(tmp_path / "ngc", repo, gpu=False, kinds=[kind])
    monkeypatch.setenv(envinfo.CLASS_ENV, "avx2")
    view = tmp_path / "view"
    command, decisions = supervisor.replica_command(["tritonserver", "--model-repository", str(ngc), "--x=1"], view)
    assert command == ["tritonserver", "--x=1", f"--model-repository={view}"]
    (decision,) = [d for d in decisions if d.model == kind.INT8_MODEL]
    assert not decision.int8 and decision.loud
    # The FP32 twin's files under the INT8 name, its config in the native ONNX Runtime form, marked.
    assert (view / kind.INT8_MODEL / "1").resolve() == (ngc / kind.FP32_MODEL / "1").resolve()
    cfg = parse_config((view / kind.INT8_MODEL / "config.pbtxt").read_text(), kind.INT8_MODEL)
    assert cfg.backend == "onnxruntime" and cfg.parameters[INT8_SERVED_PARAMETER].string_value == "0"
    assert native_check.check_repository(view, "ngc-cpu") == []  # what the NGC server will load
    monkeypatch.setenv(envinfo.CLASS_ENV, "vnni")
    _, decisions = supervisor.replica_command(["tritonserver", f"--model-repository={ngc}"], tmp_path / "vnni")
    assert [d.int8 for d in decisions if d.model == kind.INT8_MODEL] == [True]
    assert (tmp_path / "vnni" / kind.INT8_MODEL / "1").resolve() == (ngc / kind.INT8_MODEL / "1").resolve()
    assert native_check.check_repository(tmp_path / "vnni", "ngc-cpu") == []


def test_a_build_on_another_class_rewrites_nothing_committed(tree, monkeypatch):
    """On a class with no runtime entry the build measures nothing and writes nothing, and the generated configs
    are the same whatever class generates them."""
    from tritonkit.repository import runtime_choice

    kind, repo, _, _ = tree
    monkeypatch.setenv(envinfo.CLASS_ENV, "vnni")
    as_vnni = {e.config.name: e.config.to_pbtxt() for e in generate.repository(kind)}
    choices = runtime_choice.choice_path(kind)
    before = choices.read_bytes()
    monkeypatch.setenv(envinfo.CLASS_ENV, "avx2")
    logged = []
    int8 = repo / kind.INT8_MODEL / "1" / "model.onnx"
    assert runtime_choice.choose(kind, repo / kind.FP32_MODEL / "1" / "model.onnx", int8, log=logged.append) == {}
    assert choices.read_bytes() == before and "--choose-runtime" in logged[0]
    # Even where this class has a choice of its own, the committed configs stay the committed class's.
    data = json.loads(before)
    data["classes"]["avx2"] = {"models": {kind.INT8_MODEL: {"runtime": "openvino"}}}
    try:
        choices.write_text(json.dumps(data))
        assert runtime_choice.variant_for(kind, kind.INT8_MODEL) == "openvino"  # what this class measured
        assert {e.config.name: e.config.to_pbtxt() for e in generate.repository(kind)} == as_vnni
    finally:
        choices.write_bytes(before)


def test_the_container_supervisor_serves_fp32_on_a_mismatched_node(tree, tmp_path):
    """The container's command over an NGC view on a faked avx2 node, with the embedded server's binary (whose
    Python-based onnxruntime backend takes the native form) in place of the image's."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tritonkit import paths
    from tritonkit.repository import variants
    from tritonkit.runtime.server import TritonServer, prepare_backend_dir, server_env

    kind, repo, pixels, want = tree
    ngc = variants.ngc_view(tmp_path / "ngc", repo, gpu=False, kinds=[kind])
    spec = TritonServer.on_free_ports(model_repository=ngc, models=[kind.INT8_MODEL, kind.FP32_MODEL],
                                      exit_timeout_s=5)
    prepare_backend_dir(Path(spec.backend_dir))
    env = {**server_env(), envinfo.CLASS_ENV: "avx2", "TRITONKIT_REPLICA_DIR": str(tmp_path / "view")}
    log = tmp_path / "supervisor.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tritonkit.runtime.supervisor", "--", *spec.command()],
                                env=env, cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not spec.is_ready():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        np.testing.assert_allclose(_logits(spec, kind.INT8_MODEL, pixels), want["fp32"], rtol=1e-5, atol=1e-5)
        assert _gauge(spec, kind.INT8_MODEL) == 0.0
        assert f"supervisor: WARNING: {kind.INT8_MODEL} SERVES FP32 on this CPU (class avx2)" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def outrun(tree):
    """The records of a vnni search whose accurate candidate lost its speed race only to FP32 on OpenVINO bf16: the
    INT8 name serves the FP32 file on openvino-bf16 there, and the repository's INT8 file is that candidate (a build
    on a vnni CPU without native bf16 replays it)."""
    from tritonkit.repository import runtime_choice

    kind = tree[0]
    paths = (recipe.recipe_path(kind), runtime_choice.choice_path(kind))
    before = [p.read_text() for p in paths]
    entry = {"status": recipe.FALLBACK, "recipe": None, "speed_against": "openvino-bf16",
             "accurate": {"recipe": RECIPE, "validation": {}, "speed": {}}}
    paths[0].write_text(json.dumps({"served": {"vnni": entry}}))
    models = {kind.INT8_MODEL: {"runtime": "openvino-bf16"}, kind.FP32_MODEL: {"runtime": "onnxruntime"}}
    paths[1].write_text(json.dumps({"classes": {"vnni": {"models": models}}}))
    try:
        yield tree
    finally:
        for path, text in zip(paths, before, strict=True):
            path.write_text(text)


def test_a_cpu_without_bf16_serves_its_classes_candidate_once_a_build_proved_it(outrun, tmp_path):
    import shutil

    from tritonkit.repository.config import parse_config

    kind, repo, _, _ = outrun
    record = replica.record([kind], repo)
    entry = record["models"][kind.INT8_MODEL]
    with_bf16 = replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=True)
    assert (with_bf16.int8, with_bf16.variant) == (False, "openvino-bf16")  # the race's winner: FP32 in bf16
    without = replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=False)
    assert (without.int8, without.variant, without.loud) == (True, "onnxruntime", False)
    view = tmp_path / "view"
    replica.view(repo, view, record, cpu_class="vnni", bf16=False)
    assert (view / kind.INT8_MODEL / "1").resolve() == (repo / kind.INT8_MODEL / "1").resolve()
    cfg = parse_config((view / kind.INT8_MODEL / "config.pbtxt").read_text(), kind.INT8_MODEL)
    assert cfg.parameters[INT8_SERVED_PARAMETER].string_value == "1" and cfg.backend == "onnxruntime"
    replica.view(repo, tmp_path / "bf16", record, cpu_class="vnni", bf16=True)
    assert (tmp_path / "bf16" / kind.INT8_MODEL / "1").resolve() == (repo / kind.FP32_MODEL / "1").resolve()
    # A repository whose INT8 file is not that candidate serves FP32 and says how to build the INT8 one.
    other = tmp_path / "other"
    shutil.copytree(repo, other)
    recipe.mark_recipe(other / kind.INT8_MODEL / "1" / "model.onnx", {**RECIPE, "note": "another recipe"})
    entry = replica.record([kind], other)["models"][kind.INT8_MODEL]
    decision = replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=False)
    assert not decision.int8 and decision.variant == "onnxruntime"
    assert "no native bf16" in decision.reason and f"make build MODEL={kind.NAME}" in decision.reason
    # A class whose INT8 passed on openvino-bf16 serves its proven file on ONNX Runtime on such a CPU.
    recipe.recipe_path(kind).write_text(json.dumps({"served": {"vnni": {"status": "passed", "recipe": RECIPE}}}))
    entry = replica.record([kind], repo)["models"][kind.INT8_MODEL]
    assert replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=True).variant == "openvino-bf16"
    proven = replica.decide(entry, kind.INT8_MODEL, "vnni", bf16=False)
    assert (proven.int8, proven.variant) == (True, "onnxruntime")
    # ... but only the file that class proved.
    assert not replica.decide(replica.record([kind], other)["models"][kind.INT8_MODEL], kind.INT8_MODEL, "vnni",
                              bf16=False).int8


def test_a_replica_without_bf16_serves_the_candidate_int8_file(start_server, outrun, monkeypatch):
    kind, repo, pixels, want = outrun
    monkeypatch.setenv(envinfo.NO_BF16_ENV, "1")
    server = _serve(start_server, kind, repo, monkeypatch, "vnni")
    # The INT8 file on ONNX Runtime, the arithmetic its gates judged.
    np.testing.assert_allclose(_logits(server, kind.INT8_MODEL, pixels), want["int8"], rtol=1e-5, atol=1e-5)
    assert _gauge(server, kind.INT8_MODEL) == 1.0 and "SERVING FP32" not in server.log_path.read_text()
