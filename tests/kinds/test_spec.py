"""Models as data: spec validation, reading a sentence-transformers directory, `add`, generated configs."""

from __future__ import annotations

import pytest

from tests.support.tiny_sources import break_pooling, classifier_loader, sentence_transformers_dir
from tritonkit import add, kinds
from tritonkit.kinds import spec as specs
from tritonkit.kinds.architectures import SourceError, inspect_directory
from tritonkit.repository import generate

TEXT = {"name": "m", "kind": "text-embedding", "source": {"dir": "x"},
        "model": {"max_length": 128, "dim": 32, "pooling": "cls", "normalize": False}}


def test_committed_configs_are_what_the_specs_generate():
    assert generate.stale() == [], "run `python -m tritonkit.repository.generate` and commit the result"


def test_every_generated_config_says_so():
    for path, text in generate.files().items():
        if path.name == "config.pbtxt":
            assert text.startswith("# Generated from models/") and "do not edit" in text.splitlines()[0], path


def test_the_first_pipelines_keep_their_names():
    text, image = kinds.get("text"), kinds.get("image")
    assert (text.NAME, text.PREPROCESSOR, text.INT8_MODEL, text.FP32_MODEL) == (
        "text_embedding", "tokenizer", "text_encoder", "text_encoder_fp32")
    assert (image.NAME, image.PREPROCESSOR, image.INT8_MODEL) == ("image_classification", "image_preprocess",
                                                                  "image_classifier")
    names = {e.config.name for e in generate.repository(text)}
    assert names == {"tokenizer", "text_encoder", "text_encoder_fp32", "text_embedding", "text_embedding_fp32",
                     "text_embedding_fused"}
    assert {e.config.name for e in generate.repository(image)} == {
        "image_preprocess", "image_classifier", "image_classifier_fp32", "image_classification",
        "image_classification_fp32", "image_classification_fused"}


def test_config_comparison_counts_fields_not_formatting():
    old = 'name: "m"  # hand-written\nmax_batch_size: 64\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    same = '# generated\ninput [\n  { name: "x" data_type: TYPE_FP32 dims: [ 4 ] }\n]\nmax_batch_size: 64\nname: "m"\n'
    assert generate.config_differences(old, same) == []
    changed = same.replace("64", "32").replace("[ 4 ]", "[ 8 ]")
    assert generate.config_differences(old, changed) == [("input[0].dims[0]", "4", "8"),
                                                          ("maxBatchSize", 64, 32)]


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"name": "Bad-Name"}, "name", "Triton model name"),
    ({"kind": "audio"}, "kind", "text-embedding, image-classification"),
    ({"model": {**TEXT["model"], "pooling": "weightedmean"}}, "model.pooling", "mean, cls, max, mean_sqrt_len"),
    ({"model": {**TEXT["model"], "max_length": 0}}, "model.max_length", "1..8192"),
    ({"model": {**TEXT["model"], "dim": "32"}}, "model.dim", "expected int"),
    ({"model": {**TEXT["model"], "colour": 1}}, "model.colour", "unknown key"),
    ({"source": {}}, "source.dir", "sentence-transformers directory"),
    ({"serving": {"max_batch_size": 0}}, "serving.max_batch_size", "1..1024"),
    ({"extra": 1}, "extra", "unknown key"),
])
def test_spec_errors_name_the_field_and_the_allowed_values(change, field, words):
    with pytest.raises(specs.SpecError) as err:
        specs.parse({**TEXT, **change}, "m.toml")
    assert err.value.field == field and words in str(err.value), str(err.value)


def test_a_spec_may_tighten_gates_but_not_loosen_them():
    spec = specs.parse({**TEXT, "gates": {"cosine_min": 0.995}}, "m.toml")
    assert kinds.from_spec(spec).gate("cosine_min") == 0.995
    with pytest.raises(specs.SpecError, match="looser"):
        kinds.from_spec(specs.parse({**TEXT, "gates": {"cosine_min": 0.9}}, "m.toml"))
    with pytest.raises(specs.SpecError, match="unknown gate"):
        kinds.from_spec(specs.parse({**TEXT, "gates": {"speed": 9}}, "m.toml"))


@pytest.fixture(scope="module")
def st_dir(tmp_path_factory):
    return sentence_transformers_dir(tmp_path_factory.mktemp("st") / "tiny-cls", pooling="cls", normalize=False)


def test_facts_are_read_from_the_directory(st_dir):
    facts = inspect_directory(st_dir)
    assert facts == {"architecture": "bert", "max_length": 64, "dim": 32, "pooling": "cls", "normalize": False,
                     "pad_id": 0}


@pytest.mark.parametrize(("breakage", "words"), [
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
    (lambda d: break_pooling(d, "weightedmean"), "pooling"),
    (lambda d: (d / "config.json").write_text('{"model_type": "gpt2"}'), "model_type 'gpt2' is not supported"),
    (lambda d: (d / "modules.json").unlink(), "modules.json is missing"),
])
def test_an_unservable_directory_fails_at_add_naming_what_is_missing(st_dir, tmp_path, breakage, words):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(st_dir, broken)
    breakage(broken)
    with pytest.raises(SourceError, match=words):
        inspect_directory(broken)
    with pytest.raises(add.AddError, match=words):
        add.text_spec("broken", str(broken), 64)


def test_add_writes_a_spec_that_generates_a_full_pipeline(st_dir, tmp_path):
    path = add.add(add.text_spec("tiny_cls", str(st_dir), 32), directory=tmp_path)
    spec = specs.load(path)
    kind = kinds.from_spec(spec)
    configs = {e.config.name: e.config for e in generate.repository(kind)}
    assert set(configs) == {"tiny_cls", "tiny_cls_fp32", "tiny_cls_tokenizer", "tiny_cls_encoder",
                            "tiny_cls_encoder_fp32"}
    ensemble = configs["tiny_cls"].to_proto()
    assert [t.name for t in ensemble.input] == ["text"] and ensemble.output[0].dims == [32]
    assert configs["tiny_cls_tokenizer"].parameters["max_length"] == "64"
    with pytest.raises(add.AddError, match="exists"):
        add.add(add.text_spec("tiny_cls", str(st_dir), 32), directory=tmp_path)


def test_a_spec_with_newlines_quotes_and_control_characters_in_a_path_reads_back_as_written(st_dir, tmp_path):
    """A source directory may be named anything a file system allows: the spec `add` writes is TOML that tomllib
    reads back to the same table (hand-written TOML left a raw newline in a string: a spec nobody could load)."""
    import shutil
    import tomllib

    odd = tmp_path / 'enc "odd"\n\tname\x7f \\ here'
    shutil.copytree(st_dir, odd)
    table = add.text_spec("odd_dir", str(odd), 32)
    assert tomllib.loads(specs.dump(table)) == table
    path = add.add(table, directory=tmp_path / "specs")
    assert specs.load(path).source.path() == odd


def test_image_add_checks_the_loader_and_labels(tmp_path):
    loader = classifier_loader(tmp_path / "src")
    table = add.image_spec("tiny_img", loader, {}, 96, None, [127.0] * 3, [128.0] * 3,
                           str(tmp_path / "src" / "labels.txt"), 10, 16)
    assert table["model"]["resize"] == 110
    kind = kinds.from_spec(specs.parse(table, "tiny_img.toml"))
    assert kind.labels()[3] == "class 3"
    pre = next(e.config for e in generate.repository(kind) if e.config.name == "tiny_img_preprocess").to_proto()
    assert list(pre.output[0].dims) == [3, 96, 96] and pre.parameters["resize"].string_value == "110"
    with pytest.raises(add.AddError, match="no attribute"):
        add.image_spec("x", f"{loader.rsplit(':', 1)[0]}:nope", {}, 96, None, [0.0] * 3, [1.0] * 3, "imagenet",
                       1000, 16)


def test_an_fp32_fallback_shows_in_the_int8_models_config(st_dir, tmp_path):
    import json

    from tritonkit.int8 import recipe

    path = add.add(add.text_spec("tiny_fb", str(st_dir), 32), directory=tmp_path)
    kind = kinds.from_spec(specs.load(path))
    plain = {e.config.name: e.config for e in generate.repository(kind)}["tiny_fb_encoder"]
    assert "tritonkit_precision" not in plain.parameters
    recipe.recipe_path(kind).write_text(json.dumps({"served": {"status": recipe.FALLBACK, "recipe": None}}))
    config = {e.config.name: e.config for e in generate.repository(kind)}["tiny_fb_encoder"]
    assert config.parameters["tritonkit_precision"].startswith("fp32-fallback")
    assert "tritonkit_precision" in config.to_pbtxt()


@pytest.mark.slow  # MPNet's directory is joined from its five zip parts the first time
def test_larger_encoders_calibrate_in_smaller_batches():
    """Calibration keeps every activation alive per run: MPNet (12 x 768) gets a quarter of MiniLM's (6 x 384)
    batch, and the same number of calibration texts."""
    minilm, mpnet = kinds.get("text_embedding"), kinds.get("all_mpnet_base_v2")
    assert (minilm.calibration_batch, mpnet.calibration_batch) == (16, 4)
    assert mpnet.calibration_batch_count() == 4 * minilm.calibration_batch_count()
    assert max(len(b["input_ids"]) for b in mpnet.calibration_batches()) == 4


@pytest.mark.parametrize(("architecture", "pad_id"), [("bert", 0), ("mpnet", 1), ("roberta", 1), ("distilbert", 0)])
def test_every_declared_family_exports_what_sentence_transformers_computes(tmp_path, architecture, pad_id):
    """`add` reads each supported family's facts, and its export matches sentence-transformers' own encode on real
    texts, padded and unpadded (RoBERTa counts positions from its pad id; DistilBERT takes no segment ids)."""
    from tritonkit.export import ExportSpec, export_onnx, validate_onnx

    st = sentence_transformers_dir(tmp_path / architecture, architecture=architecture, pooling="mean",
                                   normalize=True, hidden=32)
    facts = inspect_directory(st)
    assert (facts["architecture"], facts["pad_id"]) == (architecture, pad_id)
    kind = kinds.from_spec(specs.load(add.add(add.text_spec(f"tiny_{architecture}", str(st), 8),
                                              directory=tmp_path / "models")))
    grid = [{"batch": 1, "seq": 8, "start": 0}, {"batch": 5, "seq": 64, "start": 1}]
    spec = ExportSpec(**{**kind.EXPORT.__dict__, "validation_grid": grid})
    path = export_onnx(spec, tmp_path / f"{architecture}.onnx")
    result = validate_onnx(spec, path, progress=False)
    assert result.failures == 0 and result.samples == 6 and result.summary["min"] >= spec.tolerance


def test_a_made_source_is_made_once_and_recorded_by_add_as_its_maker(tmp_path, monkeypatch):
    """A spec whose weights a committed function derives (`[source] make`, as the MiniLM cross-encoders' are) holds
    no path: the directory is made under .build/sources/ on first use, reused after, and `add` on that directory
    records the maker and its arguments again."""
    from argparse import Namespace

    from tests.support import tiny_kinds
    from tritonkit import paths

    monkeypatch.setattr(paths, "BUILD_DIR", tmp_path / ".build")
    source = {"make": "tests.support.tiny_kinds:made_classifier", "args": {"num_labels": 3}}
    table = {"name": "made", "kind": "text-classification", "source": source}
    calls = len(tiny_kinds.MADE_CALLS)
    made = specs.make_source(source["make"], source["args"])
    assert made.parent == tmp_path / ".build" / "sources" and (made / "config.json").exists()
    assert specs.make_source(source["make"], source["args"]) == made and len(tiny_kinds.MADE_CALLS) == calls + 1
    args = Namespace(name="made", source=str(made), max_batch_size=8, max_length=None)
    spec = add.kind_spec("text-classification", args)
    assert spec["source"] == source and spec["model"]["num_labels"] == 3
    kind = kinds.from_spec(specs.parse({**table, "model": spec["model"]}, "made.toml"))
    assert kind.model_dir() == made and kind.spec.source.describe().endswith("(num_labels=3)")
