"""Every committed config profile (`make serve PROFILE=<name>`) loads in a real server and serves both pipelines
with the same answers as the default configs: profiles change scheduling, never results."""

from __future__ import annotations

import pytest
import tritonclient.http as httpclient
from tritonkit_client import Client, embed
from tritonkit_client.image import classify

from tests.support.text_support import ensure_built, ensure_text_built
from tritonkit import kinds, paths
from tritonkit.repository.config import find_profiles, load_profile
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


PROFILES = find_profiles(paths.MODEL_REPOSITORY)
MODELS = ["text_embedding", "image_classification"]
TEXTS = ["open a network connection", "a short one", " ".join(["long text"] * 200)]


def test_the_tuned_and_overload_profiles_are_committed():
    assert {"latency", "throughput", "overload"} <= set(PROFILES)


def _labels(predictions) -> list[list[str]]:
    return [[p.label for p in top] for top in predictions]


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return [imaging.encode(spec.photo(name).rgb, "JPEG", 90) for name in ("chelsea", "coffee")]


@pytest.fixture(scope="module")
def reference(start_server, photos):
    ensure_text_built()
    ensure_built("image")
    server = start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=MODELS)
    try:
        client = Client(server.http_url)
        return embed(TEXTS, client=client).vectors, _labels(classify(photos, top_k=1, client=client))
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("profile", PROFILES)
def test_profile_serves_both_pipelines_like_the_defaults(start_server, reference, photos, profile):
    server = start_server(paths.MODEL_REPOSITORY, model_control_mode="explicit", models=MODELS, profile=profile)
    try:
        http = httpclient.InferenceServerClient(server.http_url)
        expected = load_profile(paths.MODEL_REPOSITORY, profile)
        for model in ("tokenizer", "text_encoder", "image_preprocess", "image_classifier"):
            served = http.get_model_config(model)
            # The server really runs the profile's scheduling, not config.pbtxt's.
            assert served["max_batch_size"] == expected[model].max_batch_size, model
            assert served["instance_group"][0]["count"] == expected[model].instance_group[0].count, model
            assert int(served["dynamic_batching"].get("max_queue_delay_microseconds", 0)) == (
                expected[model].dynamic_batching.max_queue_delay_microseconds), model
        client = Client(server.http_url)
        vectors, labels = reference
        got = embed(TEXTS, client=client).vectors
        assert (got * vectors).sum(1).min() >= 0.9999
        assert _labels(classify(photos, top_k=1, client=client)) == labels
    finally:
        server.stop()
