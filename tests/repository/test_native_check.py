"""Native-load check: each rule fails on its own fixture and nowhere else; both views of the real repository pass
where they should, and the embedded repository's ragged text encoders are refused by the native rules; models on
OpenVINO are refused natively as generated and served by the NGC views in the native backend's form."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tritonkit import paths
from tritonkit.errors import EngineError
from tritonkit.release import ServerTarget
from tritonkit.repository import native_check, variants
from tritonkit.repository.config import check_config, parse_config

FIXTURES = Path(__file__).parents[1] / "fixtures" / "native"
RULE_FIXTURES = sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name != "base")
TARGET_TRT = "10.5.0"


def compose(tmp_path: Path, overlay: str) -> tuple[Path, str]:
    """base/ with the overlay's files on top and its DELETE list removed; the view named in VIEW (default GPU)."""
    repo = tmp_path / "repo"
    shutil.copytree(FIXTURES / "base", repo)
    src = FIXTURES / overlay
    for f in src.rglob("*"):
        if f.is_file() and f.parent == src and f.name in ("DELETE", "VIEW"):
            continue
        if f.is_file():
            (repo / f.relative_to(src)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, repo / f.relative_to(src))
    if (src / "DELETE").exists():
        for rel in (src / "DELETE").read_text().split():
            (repo / rel).unlink()
    view = (src / "VIEW").read_text().strip() if (src / "VIEW").exists() else "ngc-gpu"
    return repo, view


def test_every_rule_has_a_fixture_and_an_upstream_source():
    assert sorted(native_check.RULES) == RULE_FIXTURES
    for rule in native_check.RULES.values():
        repo, _, path = rule.source.partition("/")
        assert repo in ("core", "onnxruntime_backend", "tensorrt_backend", "python_backend", "openvino_backend")
        assert path.startswith("src/")
        assert rule.url.startswith(f"{native_check.UPSTREAM}/{repo}/blob/{native_check.RELEASE_BRANCH}/src/")


@pytest.mark.parametrize("view", sorted(native_check.VIEWS))
def test_base_fixture_passes_every_view(view):
    assert native_check.check_repository(FIXTURES / "base", view, TARGET_TRT) == []


@pytest.mark.parametrize("rule", RULE_FIXTURES)
def test_each_fixture_fails_exactly_its_rule(tmp_path, rule):
    repo, view = compose(tmp_path, rule)
    violations = native_check.check_repository(repo, view, TARGET_TRT)
    assert violations, f"{rule} fixture passed the {view} view"
    assert {v.rule for v in violations} == {rule}, [str(v) for v in violations]
    assert native_check.RULES[rule].source in str(violations[0])


def test_ragged_inputs_mean_padding_to_the_embedded_backend(tmp_path):
    """The same ragged config is fine for our Python-based ORT backend (it pads) and refused by the native one."""
    repo, _ = compose(tmp_path, "ort.ragged_input")
    assert native_check.check_repository(repo, "embedded", TARGET_TRT) == []


# The two pipelines `make build` has always built; other specs' models may be in the repository unbuilt.
PIPELINES = ("text_embedding", "text_embedding_fp32", "image_classification", "image_classification_fp32")


def _built_models() -> list[str]:
    """The pipelines' models (ensembles and their steps); skips until `make build` has produced them."""
    configs = native_check.load_repository(paths.MODEL_REPOSITORY)
    names = set(PIPELINES) | {s.model_name for p in PIPELINES for s in configs[p].ensemble_scheduling.step}
    unbuilt = [n for n in sorted(names) if native_check.is_onnxruntime(configs[n])
               and not (paths.MODEL_REPOSITORY / n / "1" / "model.onnx").exists()]
    if unbuilt:
        pytest.skip(f"`make build` has not produced {unbuilt} yet")
    return sorted(names)


def _subset(tmp_path: Path, names: list[str]) -> Path:
    repo = tmp_path / "embedded"
    for name in names:
        shutil.copytree(paths.MODEL_REPOSITORY / name, repo / name, symlinks=True)
    return repo


def test_embedded_repository_is_refused_by_the_native_backend_as_it_stands(tmp_path):
    repo = _subset(tmp_path, _built_models())
    assert native_check.check_repository(repo, "embedded", TARGET_TRT) == []
    refused = native_check.check_repository(repo, "ngc-gpu", TARGET_TRT)
    # Each model is refused by the rules of the backend its config names (the build's runtime choice): a batched
    # OpenVINO model for its fixed batch (embedded configs never ask for padding), a ragged input by either.
    expected = set()
    for m, cfg in native_check.load_repository(repo).items():
        ragged = any(t.allow_ragged_batch for t in cfg.input)
        if cfg.backend == "openvino":
            expected |= {("ov.fixed_batch", m)} | ({("ov.ragged_input", m)} if ragged else set())
        elif ragged:
            expected.add(("ort.ragged_input", m))
    assert {(v.rule, v.model) for v in refused} == expected


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_generated_ngc_views_pass(tmp_path, gpu):
    repo = paths.MODEL_REPOSITORY
    view = variants.ngc_view(tmp_path / "ngc", repo, gpu=gpu, only=_built_models())
    assert native_check.check_repository(view, "ngc-gpu" if gpu else "ngc-cpu", TARGET_TRT) == []
    cfg = native_check.load_repository(view)["text_encoder"]
    assert not any(t.allow_ragged_batch for t in cfg.input)
    assert not any(k.startswith(variants.EMBEDDED_ORT_PARAMETERS) for k in cfg.parameters)
    if (repo / "text_encoder" / "1" / "model.packed.onnx").exists():  # only our backend runs the packed graph
        assert not list(view.rglob("*.packed.onnx")) and (view / "text_encoder" / "1" / "model.onnx").exists()
    assert "Generated by" in (view / "text_encoder" / "config.pbtxt").read_text()
    for profile in (repo / "text_encoder" / "configs").glob("*.pbtxt"):  # named profiles get the same edit
        assert "allow_ragged_batch" not in (view / "text_encoder" / "configs" / profile.name).read_text()
    assert not (view / "text_encoder" / "1" / "model.onnx").is_symlink()  # a container mount needs real files


def test_ngc_view_keeps_tensorrt_only_for_gpus_and_refuses_foreign_plans(tmp_path):
    view = variants.ngc_view(tmp_path / "gpu", FIXTURES / "base", gpu=True,
                             target=ServerTarget("24.10", "2.51.0", TARGET_TRT))
    assert (view / "enc_trt" / "1" / "model_sm90.plan").exists() and (view / "pipe_trt").exists()
    cpu = variants.ngc_view(tmp_path / "cpu", FIXTURES / "base", gpu=False,
                            target=ServerTarget("24.10", "2.51.0", TARGET_TRT))
    assert not (cpu / "enc_trt").exists() and not (cpu / "pipe_trt").exists() and (cpu / "pipe").exists()
    with pytest.raises(EngineError, match=re.escape("built by TensorRT 10.5.0; NGC trt11 runs 11.0.0")):
        variants.ngc_view(tmp_path / "trt11", FIXTURES / "base", gpu=True,
                          target=ServerTarget("trt11", "?", "11.0.0"))


def test_ngc_view_never_overwrites_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    with pytest.raises(FileExistsError):
        variants.ngc_view(tmp_path / "mine", FIXTURES / "base")


# -- the openvino backend: our Python-based one in the embedded view, Triton's native one in the NGC views ---------

def _openvino_repository(root: Path) -> Path:
    """An embedded-form repository served on OpenVINO, as tritonkit generates it: a ragged text model with our
    own parameters and a packed graph beside it, a fixed-shape model, and an ensemble over the text model."""
    from tests.support.tiny_models import linear_model, ragged_model

    ragged_model(root / "ov_text" / "1" / "model.onnx")
    (root / "ov_text" / "1" / "model.packed.onnx").write_bytes(b"only our backend reads this")
    linear_model(root / "ov_fixed" / "1" / "model.onnx")
    ours = ("packed_model", "model.packed.onnx"), ("packed_row_tokens", "128"), ("pad_value.TOKENS", "0"), \
        ("ragged_max_padding", "0.25"), ("tritonkit_precision", "int8"), ("PERFORMANCE_HINT", "LATENCY"), \
        ("INFERENCE_NUM_THREADS", "3"), ("HINT_BF16", "YES")  # bf16: what keeps a model on native openvino
    params = "".join(f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in ours)
    text = ('name: "ov_text"\nbackend: "openvino"\nmax_batch_size: 8\n'
            'input [ { name: "TOKENS" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]\n'
            'output [ { name: "TOTAL" data_type: TYPE_FP32 dims: [ 1 ] }, '
            '{ name: "SEEN_LEN" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
            'instance_group [ { count: 2 kind: KIND_CPU } ]\n')
    (root / "ov_text" / "config.pbtxt").write_text(text + "dynamic_batching { }\n" + params)
    (root / "ov_text" / "configs").mkdir()
    (root / "ov_text" / "configs" / "overload.pbtxt").write_text(
        text + "dynamic_batching { default_queue_policy { timeout_action: REJECT default_timeout_microseconds: "
        "300000 max_queue_size: 64 } }\n" + params)
    (root / "ov_fixed" / "config.pbtxt").write_text(
        'name: "ov_fixed"\nbackend: "openvino"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 3 ] }, '
        '{ name: "BATCH" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\ndynamic_batching { max_queue_delay_microseconds: 500 }\n'
        'parameters { key: "tritonkit_precision" value { string_value: "fp32" } }\n'
        'parameters { key: "INFERENCE_NUM_THREADS" value { string_value: "2" } }\n'
        'parameters { key: "HINT_BF16" value { string_value: "YES" } }\n')
    (root / "pipe").mkdir()
    (root / "pipe" / "1").mkdir()
    (root / "pipe" / "config.pbtxt").write_text(
        'name: "pipe"\nplatform: "ensemble"\nmax_batch_size: 8\n'
        'input [ { name: "tokens" data_type: TYPE_FP32 dims: [ -1 ] } ]\n'
        'output [ { name: "total" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "ov_text" model_version: -1 input_map { key: "TOKENS" value: '
        '"tokens" } output_map { key: "TOTAL" value: "total" } } ] }\n')
    return root


def test_openvino_models_as_generated_are_refused_by_the_native_backend(tmp_path):
    """Our backend pads ragged batches; the native one compiles a batching model at max_batch_size rows, has no
    ragged inputs and reads model.xml unless told otherwise."""
    repo = _openvino_repository(tmp_path / "embedded")
    assert native_check.check_repository(repo, "embedded") == []
    refused = {(v.rule, v.model) for v in native_check.check_repository(repo, "ngc-cpu")}
    both = {(rule, model) for rule in ("ov.fixed_batch", "ov.model_file") for model in ("ov_text", "ov_fixed")}
    assert refused == both | {("ov.ragged_input", "ov_text")}


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_ngc_views_serve_openvino_models_on_the_native_backend(tmp_path, gpu):
    repo = _openvino_repository(tmp_path / "embedded")
    view = variants.ngc_view(tmp_path / "ngc", repo, gpu=gpu)
    assert native_check.check_repository(view, "ngc-gpu" if gpu else "ngc-cpu", TARGET_TRT) == []
    configs = native_check.load_repository(view)
    for name in ("ov_text", "ov_fixed"):
        cfg = configs[name]
        assert cfg.backend == "openvino" and cfg.default_model_filename == "model.onnx"
        assert set(cfg.parameters) <= set(native_check.OPENVINO_PARAMETERS), sorted(cfg.parameters)
        assert not any(t.allow_ragged_batch for t in cfg.input) and not cfg.batch_input
        assert cfg.max_batch_size == 0 and all(t.dims[0] == -1 for t in (*cfg.input, *cfg.output))
        instances = sum(g.count for g in cfg.instance_group)
        assert cfg.parameters["NUM_STREAMS"].string_value == str(instances)  # ours: one stream per instance
    assert configs["ov_fixed"].parameters["INFERENCE_NUM_THREADS"].string_value == "2"  # 2 per instance, 1 instance
    assert configs["ov_text"].parameters["INFERENCE_NUM_THREADS"].string_value == "6"  # 3 per instance, 2 of them
    assert configs["ov_text"].parameters["PERFORMANCE_HINT"].string_value == "LATENCY"  # native ones stay
    assert not list(view.rglob("*.packed.onnx")) and (view / "ov_text" / "1" / "model.onnx").is_file()
    # The shedding profile keeps its queue policy: the batcher of a non-batching model sends one request at a time.
    overload = parse_config((view / "ov_text" / "configs" / "overload.pbtxt").read_text(), "ov_text")
    check_config(overload)
    assert overload.max_batch_size == 0 and overload.dynamic_batching.default_queue_policy.max_queue_size == 64
    assert not configs["ov_text"].HasField("dynamic_batching")  # an empty batcher is the default scheduler


def test_openvino_fixes_a_batching_model_at_max_batch_size(tmp_path):
    """What ov.fixed_batch and the NGC view rest on, on the real OpenVINO runtime and the native backend's load
    steps (read_model, the config's element types, set_batch when max_batch_size > 0, compile): a batching
    model refuses a smaller batch; the view's non-batching form runs each request at its own batch and length."""
    ov = pytest.importorskip("openvino")
    import numpy as np

    repo = _openvino_repository(tmp_path / "embedded")
    view = variants.ngc_view(tmp_path / "ngc", repo, gpu=False)

    def compiled(model_dir: Path):
        cfg = native_check.load_repository(model_dir.parent)[model_dir.name]
        model = ov.Core().read_model(model_dir / "1" / "model.onnx")
        ppp = ov.preprocess.PrePostProcessor(model)
        for t in cfg.input:
            ppp.input(t.name).tensor().set_element_type(ov.Type.f32)
            if cfg.max_batch_size:
                ppp.input(t.name).tensor().set_layout(ov.Layout("N..."))
        model = ppp.build()
        if cfg.max_batch_size:
            ov.set_batch(model, cfg.max_batch_size)
        return ov.Core().compile_model(model, "CPU").create_infer_request()

    embedded = compiled(repo / "ov_text")
    with pytest.raises(RuntimeError):
        embedded.infer({"TOKENS": np.ones((3, 5), np.float32)})
    native = compiled(view / "ov_text")
    for rows, length in ((1, 3), (3, 5), (11, 2)):  # 11 > the embedded max_batch_size: one client request
        out = native.infer({"TOKENS": np.ones((rows, length), np.float32)})
        seen = out["SEEN_LEN"]
        assert seen.shape == (rows, 1) and (seen == length).all()


def test_ngc_views_keep_openvino_only_where_bf16_is_asked_for():
    """Native openvino cannot be held to f32 on a BF16 CPU, so an f32 openvino config is served by native ONNX
    Runtime in the NGC views; one that asks for bf16 (HINT_BF16) stays on native openvino."""
    from tritonclient.grpc import model_config_pb2 as mc

    from tritonkit.repository.variants import f32_on_onnxruntime

    def config(**params: str) -> mc.ModelConfig:
        cfg = mc.ModelConfig(name="enc", backend="openvino", default_model_filename="model.onnx")
        for key, value in {"INFERENCE_NUM_THREADS": "1", "packed_width_multiple": "16", **params}.items():
            cfg.parameters[key].string_value = value
        return cfg

    f32 = config()
    assert f32_on_onnxruntime(f32)
    assert f32.backend == "onnxruntime" and not f32.default_model_filename
    assert f32.parameters["intra_op_thread_count"].string_value == "1" and "INFERENCE_NUM_THREADS" not in f32.parameters
    bf16 = config(HINT_BF16="YES")
    assert not f32_on_onnxruntime(bf16) and bf16.backend == "openvino"


def test_check_native_names_unbuilt_specs_instead_of_refusing_them(capsys):
    """`make check-native` on model_repository: a spec whose files `make build` has not written is named as not
    built, and only what is built is held to the rules."""
    unbuilt = native_check.unbuilt_models()
    repo = str(paths.MODEL_REPOSITORY)
    assert native_check.main([repo, "--view", "embedded", "--skip-unbuilt"]) == 0
    out = capsys.readouterr().out
    for spec in unbuilt:
        assert f"not built: {spec} " in out, out
    if unbuilt:  # held to the rules, their missing files are refusals
        assert native_check.main([repo, "--view", "embedded"]) == 1
