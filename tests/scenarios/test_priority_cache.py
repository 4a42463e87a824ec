"""Priority levels and the response cache on the text pipeline (behaviour, not timings; the timings are in
perf/bench_priority.py and perf/bench_cache.py).

One real server over a temporary variant of the text pipeline (tritonkit.repository.variants): the composing models
with `priority_levels: 2 default_priority_level: 2`, the ensemble with `response_cache { enable: true }`, started
with `--cache-config local,size=...`.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.support.text_support import ensure_text_built
from tritonkit.perf import stats
from tritonkit.repository import variants as rv
from tritonkit.repository.config import load_config

COMPOSING = ("tokenizer", "text_encoder")


@pytest.fixture(scope="module")
def variant_server(start_server, tmp_path_factory):
    ensure_text_built()
    edits = {m: rv.priority_levels(2) for m in COMPOSING}
    edits["text_embedding"] = rv.response_cache()
    repo = rv.make_variant(tmp_path_factory.mktemp("prio_cache") / "repo", rv.TEXT_PIPELINE, edits)
    return start_server(repo, models=list(rv.TEXT_PIPELINE), extra_args=["--cache-config=local,size=8388608"])


def _text(texts: list[str]) -> grpcclient.InferInput:
    inp = grpcclient.InferInput("text", [len(texts), 1], "BYTES")
    inp.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return inp


def _cache_counts(server, model: str = "text_embedding") -> tuple[int, int]:
    counters = stats.read(server.http_url, [model])[model]
    return counters.cache_hit, counters.cache_miss


@pytest.mark.slow
def test_variant_copies_configs_and_links_model_files(variant_server):
    repo = variant_server.model_repository
    cfg = load_config(repo / "text_encoder" / "config.pbtxt")
    assert (cfg.dynamic_batching.priority_levels, cfg.dynamic_batching.default_priority_level) == (2, 2)
    assert load_config(repo / "text_embedding" / "config.pbtxt").response_cache.enable
    assert (repo / "text_encoder" / "1").is_symlink()
    assert (repo / "text_encoder" / "1" / "model.onnx").exists()


def test_ensemble_cannot_carry_priority_levels(tmp_path):
    # dynamic_batching and ensemble_scheduling are one `oneof` in ModelConfig: an ensemble has no queue of its
    # own, so priority levels go on the composing models.
    with pytest.raises(ValueError, match="dynamic_batching"):
        rv.make_variant(tmp_path / "repo", rv.TEXT_PIPELINE, {"text_embedding": rv.priority_levels(2)})


@pytest.mark.slow
def test_repeated_request_is_a_cache_hit_with_identical_outputs(variant_server):
    client = grpcclient.InferenceServerClient(variant_server.grpc_url)
    text = "Return the response cache entry for this exact request."
    hits0, misses0 = _cache_counts(variant_server)
    first = client.infer("text_embedding", [_text([text])])
    hits1, misses1 = _cache_counts(variant_server)
    second = client.infer("text_embedding", [_text([text])])
    hits2, misses2 = _cache_counts(variant_server)
    assert (hits1 - hits0, misses1 - misses0) == (0, 1)
    assert (hits2 - hits1, misses2 - misses1) == (1, 0)
    for name in ("embedding", "num_tokens", "truncated"):
        assert np.array_equal(first.as_numpy(name), second.as_numpy(name)), name
    # A different text (or batch) is a different cache key.
    client.infer("text_embedding", [_text([text, "another text"])])
    assert _cache_counts(variant_server)[0] == hits2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["text_embedding", "text_encoder"])
def test_priority_one_is_accepted(variant_server, model):
    client = grpcclient.InferenceServerClient(variant_server.grpc_url)
    if model == "text_embedding":
        inputs = [_text(["an interactive query"])]
    else:
        ids = np.array([[101, 2019, 9123, 23032, 102]], dtype=np.int64)
        inputs = []
        for name, array in (("input_ids", ids), ("attention_mask", np.ones_like(ids))):
            inputs.append(grpcclient.InferInput(name, list(array.shape), "INT64"))
            inputs[-1].set_data_from_numpy(array)
    high = client.infer(model, inputs, priority=1).as_numpy("embedding")
    default = client.infer(model, inputs).as_numpy("embedding")
    assert high.shape == (1, 384)
    np.testing.assert_allclose(high, default, atol=1e-6)


@pytest.mark.slow
def test_out_of_range_priority_is_not_an_error_in_triton_2_51(variant_server):
    # Triton 2.51 does not reject a priority above priority_levels: the request runs at the model's
    # default_priority_level (core InferenceRequest::SetPriority). Pinned here so that an upgrade that starts
    # rejecting it is noticed (clients would then need to clamp).
    client = grpcclient.InferenceServerClient(variant_server.grpc_url)
    for model_priority in (3, 1000):
        result = client.infer("text_embedding", [_text([f"priority {model_priority}"])], priority=model_priority)
        assert result.as_numpy("embedding").shape == (1, 384)
