"""image_classification end to end on the real tritonserver: bytes in → labels out, FP32 and INT8.

Artefacts come from `python -m tritonkit.build image` (run here if missing or stale; a no-op when current).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from tritonkit_client import cli, image
from tritonkit_client.core import Client, ClientError

from tritonkit import kinds, paths
from tritonkit.kinds.image import run_onnx, softmax
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


pytestmark = pytest.mark.slow
CAT_CLASSES = {"Egyptian cat", "tabby, tabby cat", "tiger cat"}
MODELS = ["image_classification", "image_classification_fp32", "image_classification_fused"]
INT8 = ["image_classification", "image_classification_fused"]  # the INT8 ensemble and its one-stub twin
# Who names a bad image: the ensemble's preprocessor, or the one-stub model itself.
BAD_INPUT_PREFIX = {"image_classification": "image_preprocess",
                    "image_classification_fused": "image_classification_fused"}


@pytest.fixture(scope="session")
def image_build():
    from tritonkit import build

    return build.build("image", progress=False)


@pytest.fixture(scope="module")
def image_server(start_server, image_build):
    return start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=MODELS)


@pytest.fixture(scope="session")
def torch_model():
    return spec.load_classifier()


def _client(server, protocol="http") -> Client:
    return Client(server.grpc_url if protocol == "grpc" else server.http_url, protocol=protocol)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_chelsea_is_a_cat_and_coffee_is_espresso(image_server, model, protocol):
    images = [spec.photo_bytes("chelsea"), spec.photo_bytes("coffee", fmt="PNG")]
    preds = image.classify(images, top_k=2, client=_client(image_server, protocol), model=model)
    assert {p.label for p in preds[0]} & CAT_CLASSES, preds[0]
    assert preds[0][0].label in CAT_CLASSES
    assert preds[1][0].label == "espresso", preds[1]
    assert all(0 < p.score <= 1 for row in preds for p in row) and preds[1][0].index == 967


def test_fp32_served_logits_match_torch(image_server, torch_model):
    import torch

    names = ["chelsea", "coffee", "astronaut", "rocket", "grace_hopper", "flower"]
    data = [spec.photo_bytes(n, fmt="WEBP" if i % 3 == 2 else "JPEG") for i, n in enumerate(names)]
    out = image.probabilities(data, client=_client(image_server), model="image_classification_fp32")
    with torch.no_grad():
        logits, probs = torch_model(torch.from_numpy(np.stack([imaging.preprocess_one(d) for d in data])))
    np.testing.assert_allclose(out["LOGITS"], logits.numpy(), atol=2e-3, rtol=0)
    np.testing.assert_allclose(out["PROBABILITIES"], probs.numpy(), atol=1e-5, rtol=0)
    np.testing.assert_allclose(out["PROBABILITIES"].sum(1), 1.0, atol=1e-5)


@pytest.mark.parametrize("model", INT8)
def test_served_int8_equals_the_offline_int8_model(image_server, image_build, model):
    """Served INT8 (ensemble or fused) vs the same ONNX run in-process on the same photos: only batching noise may
    differ; what cannot flip (top-5 containment, probabilities within noise) is asserted for near ties too."""
    examples = spec.examples("test", ("full", "center70"))[::3]
    data = [e.data for e in examples]
    client = _client(image_server)
    bounds, sizes = [0], (1, 16, 5, 9, 3)  # concurrent calls of 1-16 images: batches that mix requests
    while bounds[-1] < len(data):
        bounds.append(min(len(data), bounds[-1] + sizes[len(bounds) % len(sizes)]))
    with ThreadPoolExecutor(4) as pool:
        served = np.concatenate(list(pool.map(
            lambda a, b: image.probabilities(data[a:b], client=client, model=model, outputs=["LOGITS"])["LOGITS"],
            bounds[:-1], bounds[1:])))
    from tritonkit.repository import runtime_choice

    x = imaging.preprocess(data, spec.PREPROCESS)[0]
    # The offline twin runs the file as its config serves it (runtime, precision, threads).
    twin = runtime_choice.served_session(spec, spec.INT8_MODEL, image_build.int8)
    offline = run_onnx(twin, x, batch_size=1)
    # bf16 kernels round per shape: a batch of 16 and a batch of 1 differ by more than f32's noise.
    bf16 = "bf16" in runtime_choice.variant_for(spec, spec.INT8_MODEL)
    np.testing.assert_allclose(served, offline, atol=0.1 if bf16 else 2e-3, rtol=0)
    p_served, p_offline = softmax(served.astype(np.float64)), softmax(offline.astype(np.float64))
    np.testing.assert_allclose(p_served, p_offline, atol=1e-2 if bf16 else 1e-3)
    top5 = np.argsort(-offline, axis=1)[:, :5]
    assert all(int(np.argmax(s)) in t for s, t in zip(served, top5))
    second = np.sort(p_offline, axis=1)[:, -2:]
    clear = second[:, 1] - second[:, 0] >= 0.01
    assert (np.argmax(served[clear], 1) == np.argmax(offline[clear], 1)).all()


def test_served_int8_is_the_searched_form_and_engines_get_the_tensorrt_form(image_build):
    """Served: the form the committed recipe names; kept for TensorRT: symmetric INT8, zero points 0."""
    import onnx

    from tests.support.int8_support import assert_fp32_fallback, fell_back
    from tritonkit.int8 import recipe
    from tritonkit.int8.checks import check_qdq
    from tritonkit.tensorrt import engines

    recipes = recipe.load_recipes(spec)
    for form, path, activation in (("served", image_build.int8, None), ("tensorrt", image_build.trt_int8, "int8")):
        entry = recipes[form].recipe
        if fell_back(spec, form):  # no candidate for this form here: the FP32 graph, never a failed INT8 model
            assert_fp32_fallback(path, image_build.fp32)
            continue
        assert check_qdq(onnx.load(str(path)), activation or entry["form"], per_channel=True)["QuantizeLinear"] > 0
    model_dir = paths.MODEL_REPOSITORY / spec.INT8_MODEL
    assert engines.trt_source_onnx(model_dir, spec.INT8_MODEL) == image_build.trt_int8


@pytest.mark.parametrize("model", INT8)
@pytest.mark.parametrize("case", ["empty", "non-image", "corrupt", "truncated", "bomb", "gif"])
def test_bad_input_fails_alone_and_server_stays_healthy(image_server, case, model):
    from tests.support.image_support import bad_inputs

    data, expected = bad_inputs()[case]
    client = _client(image_server)
    good = [spec.photo_bytes("coffee")]

    def bad_request():
        with pytest.raises(ClientError) as err:
            image.classify([spec.photo_bytes("chelsea"), data], client=_client(image_server), batch_size=2,
                           model=model)
        return str(err.value)

    # The bad request is batched with concurrent good ones: only it fails.
    with ThreadPoolExecutor(4) as pool:
        goods = [pool.submit(image.classify, good, 1, _client(image_server), model=model) for _ in range(3)]
        message = pool.submit(bad_request).result()
        assert all(f.result()[0][0].label == "espresso" for f in goods)
    assert f"{BAD_INPUT_PREFIX[model]}: IMAGE[1]: " in message and expected in message, message
    assert client._client().is_server_live() and client._client().is_server_ready()
    assert image.classify(good, top_k=1, client=client, model=model)[0][0].label == "espresso"


@pytest.mark.parametrize("extra", [[], ["--protocol", "grpc"], ["--async"], ["--shared-memory"],
                                   ["--protocol", "grpc", "--async", "--shared-memory"]])
def test_cli_classify_prints_label_score_lines(image_server, tmp_path, capsys, extra):
    cat = tmp_path / "chelsea.jpg"
    cat.write_bytes(spec.photo_bytes("chelsea"))
    coffee = tmp_path / "coffee.webp"
    coffee.write_bytes(spec.photo_bytes("coffee", fmt="WEBP"))
    url = image_server.grpc_url if "grpc" in extra else image_server.http_url
    assert cli.main(["classify", str(cat), str(coffee), "-k", "2", "--url", url, *extra]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"# {cat}" and out[3] == f"# {coffee}"
    label, score = out[1].rsplit(" ", 1)
    assert label in CAT_CLASSES and 0 < float(score) <= 1
    assert out[4].rsplit(" ", 1)[0] == "espresso"


def test_shared_memory_regions_are_released(image_server):
    client = _client(image_server)
    image.classify([spec.photo_bytes("coffee")], client=client, shared_memory=True)
    assert client._client().get_system_shared_memory_status() == []
    assert not [p for p in Path("/dev/shm").glob("tritonkit_*")]


def test_async_client_batches_and_orders(image_server):
    data = [spec.photo_bytes(n) for n in ("coffee", "chelsea", "coffee", "rocket", "coffee")]
    preds = asyncio.run(image.classify_async(data, top_k=1, url=image_server.grpc_url, protocol="grpc",
                                             batch_size=2, concurrency=3))
    assert [p[0].label for p in preds[::2]] == ["espresso"] * 3
    assert preds[1][0].label in CAT_CLASSES
