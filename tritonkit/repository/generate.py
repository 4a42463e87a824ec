"""Generate every model-repository entry of every spec'd model from its spec (models/<name>.toml).

    python -m tritonkit.repository.generate          # write model_repository/<model>/config.pbtxt (+ Python shims)
    python -m tritonkit.repository.generate --check  # exit 1 naming each stale or missing file (make check-configs)

Per text-embedding spec: the tokenizer, the FP32 and INT8 encoders, the ensembles `<name>` (INT8) and
`<name>_fp32`. Per image-classification spec: the preprocessor, the FP32 and INT8 classifiers, the ensembles
`<name>` and `<name>_fp32`. Either kind: `<name>_fused` if the spec asks. Configs go through
tritonkit.repository.config (Triton's protobuf schema) and carry a "generated; do not edit" header. They name the
runtimes recorded for runtime_choice.COMMITTED_CLASS on any machine; a replica serves its own class's
(tritonkit.repository.replica). A model whose INT8
search found nothing that passes (tritonkit.int8.recipe) is served as FP32 under its INT8 name; its config says so,
and the backend logs it at load.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tritonkit import paths
from tritonkit.repository.config import DynamicBatching, EnsembleStep, ModelSpec, Tensor
from tritonkit.serving import packing
from tritonkit.serving.runtimes import THREAD_PARAMETER

MAX_CHARS = 100_000
MAX_PIXELS = 40_000_000
MAX_BYTES = 32 * 1024 * 1024
PYTHON_SHIMS = {"tokenizer": "tritonkit.serving.tokenizer", "image_preprocess": "tritonkit.serving.image_preprocess",
                "fused": "tritonkit.serving.fused", "fused_image": "tritonkit.serving.fused_image",
                "fused_text": "tritonkit.serving.fused_text"}


@dataclass
class Entry:
    """One generated model directory: its config and, for Python models, the shim naming the implementation."""

    config: ModelSpec
    python: str = ""  # key of PYTHON_SHIMS


def _header(kind, what: str) -> list[str]:
    return [f"Generated from {kind.spec.label} by `python -m tritonkit.repository.generate`; do not edit.", what]


def _int8_params(kind) -> dict[str, str]:
    """Marks an INT8 model that is really the FP32 fallback (read by the backend, shown in the config)."""
    from tritonkit.int8 import recipe

    # The committed config is the same on every machine: it speaks for the fallbacks of every CPU class only. One
    # class's own fallback is marked in the graph's ONNX metadata, which the backend logs too.
    if recipe.all_classes_fall_back(kind):
        return {recipe.PRECISION_KEY: "fp32-fallback: no INT8 candidate met every gate (models/"
                f"{kind.NAME}.int8.json)"}
    return {}


def _onnx_model(kind, name: str, inputs: list[Tensor], outputs: list[Tensor], instances: int, threads: int,
         extra: dict[str, str], what: str) -> Entry:
    """An ONNX model on the CPU runtime the build measured faster for it (tritonkit.repository.runtime_choice)."""
    from tritonkit.repository import runtime_choice

    s, committed = kind.spec.serving, runtime_choice.COMMITTED_CLASS
    runtime = runtime_choice.runtime_for(kind, name, committed)
    return Entry(ModelSpec(
        name=name, backend=runtime, max_batch_size=s.max_batch_size, inputs=inputs, outputs=outputs,
        instance_count=instances, dynamic_batching=DynamicBatching(max_queue_delay_microseconds=s.queue_delay_us),
        parameters={THREAD_PARAMETER[runtime]: str(threads), **runtime_choice.parameters_for(kind, name, committed),
                    **extra},
        header=_header(kind, what),
        # Triton fills in model.xml for openvino; the native backend reads our .onnx when the config names it.
        default_model_filename="model.onnx" if runtime == "openvino" else ""))


def _ensemble(kind, name: str, inputs: list[Tensor], outputs: list[Tensor], steps: list[EnsembleStep],
              what: str) -> Entry:
    return Entry(ModelSpec(name=name, platform="ensemble", max_batch_size=kind.spec.serving.max_batch_size,
                           inputs=inputs, outputs=outputs, ensemble_steps=steps, header=_header(kind, what)))


def text_repository(kind) -> list[Entry]:
    spec, s, f = kind.spec, kind.spec.serving, kind.spec.facts
    tokenizer_params = {"tokenizer_file": spec.source.ref("tokenizer.json", kind.PREPROCESSOR),
                        "max_length": str(f.max_length), "max_chars": str(MAX_CHARS)}
    token_outputs = [Tensor("input_ids", "INT64", [-1]), Tensor("attention_mask", "INT64", [-1])]
    extras = [Tensor("num_tokens", "INT32", [1]), Tensor("truncated", "BOOL", [1])]
    text_in = [Tensor("text", "STRING", [1])]
    embedding = Tensor("embedding", "FP32", [f.dim])
    ragged = [Tensor(t.name, t.dtype, t.dims, allow_ragged_batch=True) for t in token_outputs]
    encoder_params = {"ragged_max_padding": str(s.ragged_max_padding), "pad_value.input_ids": str(f.pad_id),
                      "pad_value.attention_mask": "0"}
    if kind.packable:  # texts end to end without padding (tritonkit.serving.packing); buckets if the file is absent
        encoder_params |= {"packed_model": packing.packed_path(Path("model.onnx")).name,
                           "packed_row_tokens": str(packing.ROW_TOKENS)}
    about = f"{spec.description or spec.name}: {f.pooling} pooling, {f.dim} floats" + \
        (", L2-normalised" if f.normalize else "")
    entries = [
        Entry(ModelSpec(
            name=kind.PREPROCESSOR, backend="python", max_batch_size=s.max_batch_size, inputs=text_in,
            outputs=token_outputs + extras, instance_count=s.preprocessor_instances,
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=s.preprocessor_queue_delay_us),
            parameters=tokenizer_params,
            header=_header(kind, f"Text -> token ids, padded to the request's longest text (max {f.max_length} "
                                 "tokens, longer texts truncated and flagged).")), "tokenizer"),
        _onnx_model(kind, kind.INT8_MODEL, ragged, [embedding], s.model_instances, s.model_threads,
             {**encoder_params, **_int8_params(kind)}, f"INT8 encoder (models/{spec.name}.int8.json): {about}."),
        _onnx_model(kind, kind.FP32_MODEL, ragged, [embedding], s.fp32_instances, s.fp32_threads, encoder_params,
             f"FP32 encoder: {about}."),
    ]
    for ensemble, encoder in ((spec.name, kind.INT8_MODEL), (f"{spec.name}_fp32", kind.FP32_MODEL)):
        steps = [
            EnsembleStep(kind.PREPROCESSOR, {"text": "text"}, {t.name: t.name for t in token_outputs + extras}),
            EnsembleStep(encoder, {t.name: t.name for t in token_outputs}, {"embedding": "embedding"}),
        ]
        entries.append(_ensemble(kind, ensemble, text_in, [embedding, *extras], steps,
                                 f"Text in -> {about} out ({encoder}); also num_tokens and truncated per text."))
    if s.fused:
        entries.append(_fused(kind, text_in, [embedding, *extras],
                              {**tokenizer_params, "ragged_max_padding": str(s.ragged_max_padding)},
                              "tokenizer + the INT8 encoder's ONNX", "fused"))
    return entries


def _fused(kind, inputs: list[Tensor], outputs: list[Tensor], params: dict[str, str], what: str, shim: str) -> Entry:
    """`<name>_fused`: the preprocessor's work and the INT8 model's file (read in place, on the runtime the build
    chose for it) in one Python model."""
    from tritonkit.repository import runtime_choice

    s, committed = kind.spec.serving, runtime_choice.COMMITTED_CLASS
    runtime = runtime_choice.runtime_for(kind, kind.INT8_MODEL, committed)
    return Entry(ModelSpec(
        name=f"{kind.spec.name}_fused", backend="python", max_batch_size=s.max_batch_size, inputs=inputs,
        outputs=outputs, instance_count=s.fused_instances or s.model_instances,
        dynamic_batching=DynamicBatching(max_queue_delay_microseconds=s.fused_queue_delay_us),
        parameters={"onnx_model": f"../{kind.INT8_MODEL}/1/model.onnx", "runtime": runtime,
                    THREAD_PARAMETER[runtime]: str(s.model_threads),
                    **runtime_choice.parameters_for(kind, kind.INT8_MODEL, committed), **params},
        header=_header(kind, f"`{kind.spec.name}` in one Python stub: {what}.")), shim)


def image_repository(kind) -> list[Entry]:
    spec, s, f = kind.spec, kind.spec.serving, kind.spec.facts
    image_in = [Tensor("IMAGE", "STRING", [1])]
    pixels = [Tensor("pixels", "FP32", [3, f.input_size, f.input_size])]
    outputs = [Tensor("logits", "FP32", [f.num_classes]),
               Tensor("probabilities", "FP32", [f.num_classes], label_filename="labels.txt")]
    about = f"{spec.description or spec.name}: {f.input_size} px -> {f.num_classes} classes"
    preprocess = {"resize": str(f.resize), "mean": ",".join(map(str, f.mean)), "std": ",".join(map(str, f.std)),
                  "max_pixels": str(MAX_PIXELS), "max_bytes": str(MAX_BYTES)}
    entries = [
        Entry(ModelSpec(
            name=kind.PREPROCESSOR, backend="python", max_batch_size=s.max_batch_size, inputs=image_in,
            outputs=[Tensor("PIXELS", "FP32", [3, f.input_size, f.input_size])],
            instance_count=s.preprocessor_instances,
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=s.preprocessor_queue_delay_us),
            parameters=preprocess,
            header=_header(kind, f"Encoded image bytes -> shorter side {f.resize}, centre crop {f.input_size}, "
                                 "(x - mean) / std, FP32 NCHW; bad images fail alone.")), "image_preprocess"),
        _onnx_model(kind, kind.INT8_MODEL, pixels, outputs, s.model_instances, s.model_threads, _int8_params(kind),
             f"INT8 classifier (models/{spec.name}.int8.json): {about}."),
        _onnx_model(kind, kind.FP32_MODEL, pixels, outputs, s.fp32_instances, s.fp32_threads, {},
             f"FP32 classifier: {about}."),
    ]
    for ensemble, model in ((spec.name, kind.INT8_MODEL), (f"{spec.name}_fp32", kind.FP32_MODEL)):
        steps = [EnsembleStep(kind.PREPROCESSOR, {"IMAGE": "IMAGE"}, {"PIXELS": "pixels"}),
                 EnsembleStep(model, {"pixels": "pixels"}, {"probabilities": "PROBABILITIES", "logits": "LOGITS"})]
        entries.append(_ensemble(kind, ensemble, image_in, [Tensor("PROBABILITIES", "FP32", [f.num_classes]),
                                                             Tensor("LOGITS", "FP32", [f.num_classes])], steps,
                                 f"Image bytes in -> {about} ({model}); classification extension on PROBABILITIES."))
    if s.fused:  # the ensemble's tensors; its PROBABILITIES names the labels file that the classifier's names there
        entries.append(_fused(kind, image_in, [Tensor("PROBABILITIES", "FP32", [f.num_classes],
                                                      label_filename="labels.txt"),
                                               Tensor("LOGITS", "FP32", [f.num_classes])],
                              {**preprocess, "crop": str(f.input_size)}, "decode + the INT8 classifier's ONNX",
                              "fused_image"))
    return entries


def scoring_repository(kind) -> list[Entry]:
    """A text model whose graph scores token ids (tritonkit.kinds.sequence): the tokenizer (texts or pairs, the
    kind's TEXT_INPUTS), the FP32 and INT8 graphs (logits and scores, labels on the scores), the ensembles and the
    fused model, all with the kind's OUTPUTS."""
    spec, s, f = kind.spec, kind.spec.serving, kind.spec.facts
    tokenizer_params = {"tokenizer_file": spec.source.ref("tokenizer.json", kind.PREPROCESSOR),
                        "max_length": str(f.max_length), "max_chars": str(MAX_CHARS), "truncation": kind.TRUNCATION}
    text_in = [Tensor(name, "STRING", [1], optional=i > 0 and kind.OPTIONAL_PAIR)
               for i, name in enumerate(kind.TEXT_INPUTS)]
    token_outputs = [Tensor(name, "INT64", [-1]) for name in kind.INPUTS]
    extras = [Tensor("num_tokens", "INT32", [1]), Tensor("truncated", "BOOL", [1])]
    ragged = [Tensor(t.name, t.dtype, t.dims, allow_ragged_batch=True) for t in token_outputs]
    logits, scores = kind.OUTPUTS
    outputs = [Tensor(logits, "FP32", [kind.width]), Tensor(scores, "FP32", [kind.width], label_filename="labels.txt")]
    model_params = {"ragged_max_padding": str(s.ragged_max_padding), "pad_value.input_ids": str(f.pad_id),
                    "pad_value.attention_mask": "0", **{f"pad_value.{t.name}": "0" for t in token_outputs[2:]}}
    about = f"{spec.description or spec.name}: {' + '.join(kind.TEXT_INPUTS)} -> {logits} and {scores} " \
        f"({f.activation}), {kind.width} per row"
    entries = [
        Entry(ModelSpec(
            name=kind.PREPROCESSOR, backend="python", max_batch_size=s.max_batch_size, inputs=text_in,
            outputs=token_outputs + extras, instance_count=s.preprocessor_instances,
            dynamic_batching=DynamicBatching(max_queue_delay_microseconds=s.preprocessor_queue_delay_us),
            parameters=tokenizer_params,
            header=_header(kind, f"Text -> token ids, padded to the request's longest row (max {f.max_length} "
                                 f"tokens, truncation {kind.TRUNCATION}, flagged).")), "tokenizer"),
        _onnx_model(kind, kind.INT8_MODEL, ragged, outputs, s.model_instances, s.model_threads,
                    {**model_params, **_int8_params(kind)}, f"INT8 model (models/{spec.name}.int8.json): {about}."),
        _onnx_model(kind, kind.FP32_MODEL, ragged, outputs, s.fp32_instances, s.fp32_threads, model_params,
                    f"FP32 model: {about}."),
    ]
    served = [Tensor(t.name, t.dtype, t.dims) for t in outputs]
    for ensemble, model in ((spec.name, kind.INT8_MODEL), (f"{spec.name}_fp32", kind.FP32_MODEL)):
        steps = [
            EnsembleStep(kind.PREPROCESSOR, {n: n for n in kind.TEXT_INPUTS},
                         {t.name: t.name for t in token_outputs + extras}),
            EnsembleStep(model, {t.name: t.name for t in token_outputs}, {t.name: t.name for t in outputs}),
        ]
        entries.append(_ensemble(kind, ensemble, text_in, [*served, *extras], steps,
                                 f"Text in -> {about} ({model}); also num_tokens and truncated per row; "
                                 f"classification extension on {scores}."))
    if s.fused:
        entries.append(_fused(kind, text_in, [*outputs, *extras],
                              {**tokenizer_params, "ragged_max_padding": str(s.ragged_max_padding),
                               "pad_id": str(f.pad_id)}, "tokenizer + the INT8 model's ONNX", "fused_text"))
    return entries


# The repository layout of each model kind (specs.Spec.kind).
LAYOUTS = {"text-embedding": text_repository, "image-classification": image_repository,
           "text-rerank": scoring_repository, "text-classification": scoring_repository}


def repository(kind) -> list[Entry]:
    """The generated models (configs and Python shims) of one spec'd model."""
    return LAYOUTS[kind.spec.kind](kind)


def _shim(kind, module: str) -> str:
    return (f"# Generated from {kind.spec.label} by `python -m tritonkit.repository.generate`; do not edit.\n"
            f"from {module} import TritonPythonModel  # noqa: F401\n")


def files(kinds: list | None = None) -> dict[Path, str]:
    """Every generated file (path → content) of the given kinds (default: every spec)."""
    from tritonkit import kinds as registry

    out: dict[Path, str] = {}
    for kind in kinds if kinds is not None else [registry.get(n) for n in registry.names()]:
        for entry in repository(kind):
            model_dir = paths.MODEL_REPOSITORY / entry.config.name
            out[model_dir / "config.pbtxt"] = entry.config.to_pbtxt()
            if entry.python:
                out[model_dir / "1" / "model.py"] = _shim(kind, PYTHON_SHIMS[entry.python])
    return out


def _profiles() -> dict[Path, str]:
    """The overload profile and the tuned profiles, derived from the generated configs (so they follow them)."""
    from tritonkit.repository import profiles, variants

    return {**profiles.tuned_profiles(), **variants.overload_profile()}


def write(kinds: list | None = None) -> list[Path]:
    """Write what differs; the overload profile last, since it is derived from the configs just written."""
    written = []
    for path, text in files(kinds).items():
        # Triton loads a model only with a version directory, even an empty one (ensembles).
        (path.parent / "1").mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    for path, text in _profiles().items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    return written


def stale(kinds: list | None = None) -> list[str]:
    """Generated files that are missing or differ from what the specs give."""
    out = [paths.rel(p) for p, text in files(kinds).items() if not p.exists() or p.read_text() != text]
    if not out and kinds is None:
        out += [paths.rel(p) for p, text in _profiles().items() if not p.exists() or p.read_text() != text]
    return out


def config_differences(old_text: str, new_text: str) -> list[tuple[str, object, object]]:
    """(field path, old, new) for every field two config.pbtxt texts set differently, compared as parsed
    ModelConfig messages (comments, order and formatting do not count)."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    def flat(value, prefix: str = "") -> dict[str, object]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}.{key}".lstrip(".")).items()}
        if isinstance(value, list):
            return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}[{i}]").items()}
        return {prefix: value}

    a, b = (flat(json_format.MessageToDict(text_format.Parse(t, model_config_pb2.ModelConfig())))
            for t in (old_text, new_text))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def compare_with(rev: str) -> int:
    """Every generated config against the same model's config.pbtxt at git revision `rev` (e.g. the last
    hand-written one): prints the fields that differ."""
    import subprocess

    for path in sorted(p for p in files() if p.name == "config.pbtxt"):
        rel = path.relative_to(paths.ROOT).as_posix()
        old = subprocess.run(["git", "show", f"{rev}:{rel}"], cwd=paths.ROOT, capture_output=True, text=True)
        if old.returncode != 0:
            print(f"{rel}: not at {rev}")
            continue
        diffs = config_differences(old.stdout, path.read_text())
        print(f"{rel}: {'identical fields' if not diffs else f'{len(diffs)} field(s) differ'}")
        for field_path, a, b in diffs:
            print(f"    {field_path}: {a!r} -> {b!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonkit.repository.generate",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail (exit 1) if a generated file is stale")
    parser.add_argument("--compare", metavar="REV",
                        help="print how each generated config differs, field by field, from its git revision REV")
    args = parser.parse_args(argv)
    if args.compare:
        return compare_with(args.compare)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"stale: {path} (run `python -m tritonkit.repository.generate`)", file=sys.stderr)
        return 1 if bad else 0
    for path in write():
        print(f"wrote {paths.rel(path)}")
    print(f"{len(files())} generated files up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
