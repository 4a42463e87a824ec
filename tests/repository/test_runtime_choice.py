"""When a committed runtime choice still speaks for a served file, and when it must be measured again."""

from tritonkit.repository.runtime_choice import reusable

RECORD = {"sha256": "aaa", "source": "src", "file": "model_repository/m/1/model.onnx", "threads": 2}


def test_an_unchanged_file_at_its_timed_threads_keeps_its_choice():
    assert reusable(RECORD, "aaa", "other", RECORD["file"], 2)
    assert reusable(RECORD, "rebuilt", "src", RECORD["file"], 2)  # INT8 rebuilt from the same sources


def test_a_change_of_threads_file_or_contents_is_measured_again():
    assert not reusable(None, "aaa", "src", RECORD["file"], 2)
    assert not reusable(RECORD, "aaa", "src", RECORD["file"], 1)  # the spec now serves it on one thread
    assert not reusable(RECORD, "aaa", "src", "model_repository/m/1/model.packed.onnx", 2)
    assert not reusable(RECORD, "new", "new", RECORD["file"], 2)


def test_the_served_int8_precision_follows_the_chosen_variant(monkeypatch):
    from tritonkit import kinds
    from tritonkit.repository import runtime_choice

    kind = kinds.get("text_embedding")
    for variant, precision in [("openvino-bf16", "bf16"), ("openvino", "f32"), ("onnxruntime", "f32")]:
        monkeypatch.setattr(runtime_choice, "variant_for", lambda _kind, _model, v=variant: v)
        chosen, path, got = runtime_choice.served_int8(kind)
        assert (chosen, got) == (variant, precision)
        assert path.parent.parent.name == kind.INT8_MODEL and path.name.startswith("model.")
