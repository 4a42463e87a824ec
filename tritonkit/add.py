"""Add a model: write its spec (models/<name>.toml) from a source, checked before anything is built.

    python -m tritonkit.add text-embedding --name NAME --source DIR
    python -m tritonkit.add image-classification --name NAME --loader module:function [--arg key=value ...]
                            [--input-size 240] [--resize 274] [--mean 127,127,127] [--std 128,128,128]
                            [--labels imagenet|FILE] [--num-classes 1000]
    python -m tritonkit.add text-rerank --name NAME --source DIR [--label NAME|INDEX] [--max-length N]
    python -m tritonkit.add text-classification --name NAME --source DIR [--max-length N]

Text: DIR is a sentence-transformers directory (modules.json, its Pooling config, tokenizer.json, config.json,
weights); pooling, normalisation, max length, width and the pad id are read from it. Image: the loader returns a
torch module mapping normalised FP32 NCHW pixels to logits ("path/to/file.py:function" works too). Then:
`make build MODEL=NAME` (export, INT8 search, generated configs) and `make serve`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tritonkit import paths
from tritonkit.errors import AddError
from tritonkit.kinds import spec as specs
from tritonkit.kinds.architectures import SourceError, inspect_directory

IMAGENET_MEAN = [123.675, 116.28, 103.53]  # torchvision's ImageNet normalisation, in 0..255 pixel units
IMAGENET_STD = [58.395, 57.12, 57.375]


def _floats(text: str, what: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise AddError(f"--{what}: '{text}' is not three comma-separated numbers") from None
    if len(values) != 3:
        raise AddError(f"--{what}: need three values (R,G,B), got {len(values)}")
    return values


def _source_table(source: str) -> dict:
    """A directory inside an installed package is recorded as package + subdir, one a source maker wrote as its
    maker and arguments (tritonkit.kinds.spec.make_source): no absolute path in the spec."""
    path = Path(source).expanduser().resolve()
    made = path / specs.MADE_RECORD
    if made.is_file():
        record = json.loads(made.read_text())
        return {"make": record["make"], "args": record["args"]}
    for site in map(Path, sys.path):
        if site.name in ("site-packages", "dist-packages") and site in path.parents:
            rel = path.relative_to(site)
            return {"package": rel.parts[0], "subdir": Path(*rel.parts[1:]).as_posix()}
    if paths.ROOT in path.parents:
        return {"dir": paths.rel(path)}
    return {"dir": str(path)}


def text_spec(name: str, source: str, max_batch_size: int) -> dict:
    try:
        facts = inspect_directory(Path(source))
    except SourceError as err:
        raise AddError(str(err)) from None
    return {"name": name, "kind": "text-embedding", "description": f"{Path(source).name} (sentence-transformers)",
            "source": _source_table(source), "model": facts,
            "serving": {"max_batch_size": max_batch_size, "model_instances": 2, "model_threads": 1}}


def kind_spec(kind: str, args: argparse.Namespace) -> dict:
    """A kind whose class reads its own source (`source_facts`): the spec of args.source, served fused too."""
    from tritonkit import kinds

    try:
        facts = kinds.kind_class(kind).source_facts(Path(args.source), args)
    except SourceError as err:
        raise AddError(str(err)) from None
    return {"name": args.name, "kind": kind, "description": f"{Path(args.source).name} ({kind})",
            "source": _source_table(args.source), "model": facts,
            "serving": {"max_batch_size": args.max_batch_size, "model_instances": 2, "model_threads": 1,
                        "fused": True}}


def image_spec(name: str, loader: str, args: dict, input_size: int, resize: int | None, mean: list[float],
               std: list[float], labels: str, num_classes: int, max_batch_size: int) -> dict:
    from tritonkit.kinds.image import load_callable

    try:
        load_callable(loader)
    except (ImportError, AttributeError, ValueError, FileNotFoundError) as err:
        raise AddError(f"--loader {loader}: {err}") from None
    if labels != "imagenet" and not Path(labels).exists():
        raise AddError(f"--labels {labels}: no such file (one label per line, or 'imagenet')")
    if labels != "imagenet":
        labels = _source_table(labels).get("dir", labels)
    return {"name": name, "kind": "image-classification", "description": loader,
            "source": {"loader": loader, "args": args},
            "model": {"input_size": input_size, "resize": resize or round(input_size / 0.875), "mean": mean,
                      "std": std, "num_classes": num_classes, "labels": labels},
            "serving": {"max_batch_size": max_batch_size}}


def add(table: dict, force: bool = False, directory: Path = specs.SPECS_DIR) -> Path:
    """Validate the spec (through its kind class too) and write it."""
    from tritonkit import kinds

    spec = specs.parse(table, f"{table.get('name')}.toml")
    kinds.from_spec(spec)  # the kind's own checks (e.g. gates)
    path = Path(directory) / f"{spec.name}.toml"
    if path.exists() and not force:
        raise AddError(f"{paths.rel(path)} exists (use --force to replace it)")
    owned = {m for n in kinds.names(directory) if n != spec.name for m in _models_of(kinds.get(n, directory))}
    clash = sorted({spec.name, f"{spec.name}_fp32", spec.preprocessor, spec.int8_model, spec.fp32_model} & owned)
    if clash:
        raise AddError(f"model name(s) {', '.join(clash)} already belong to another spec (pick another --name)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# Written by `python -m tritonkit.add {spec.kind}`; edit freely, then `make build "
                    f"MODEL={spec.name}`.\n" + specs.dump(table))
    return path


def _models_of(kind) -> set[str]:
    from tritonkit.repository import generate

    return {e.config.name for e in generate.repository(kind)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tritonkit.add", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    text = sub.add_parser("text-embedding", help="a sentence-transformers directory")
    text.add_argument("--name", required=True)
    text.add_argument("--source", required=True, help="sentence-transformers directory")
    image = sub.add_parser("image-classification", help="a torch classifier (pixels → logits)")
    image.add_argument("--name", required=True)
    image.add_argument("--loader", required=True, help="module:function or path/to/file.py:function")
    image.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                       help="keyword argument for the loader (JSON values allowed)")
    image.add_argument("--input-size", type=int, default=224)
    image.add_argument("--resize", type=int, help="shorter side before the centre crop (default size/0.875)")
    image.add_argument("--mean", default=",".join(map(str, IMAGENET_MEAN)), help="R,G,B in 0..255 units")
    image.add_argument("--std", default=",".join(map(str, IMAGENET_STD)), help="R,G,B in 0..255 units")
    image.add_argument("--labels", default="imagenet", help="'imagenet' or a file with one label per line")
    image.add_argument("--num-classes", type=int, default=1000)
    from tritonkit import kinds

    # Kinds whose class declares its own `add` arguments and reads its own source.
    plugged = {k: kinds.kind_class(k) for k in kinds.KIND_CLASSES}
    plugged = {k: cls for k, cls in plugged.items() if hasattr(cls, "source_facts")}
    parsers = [text, image]
    for kind, cls in plugged.items():
        parsers.append(sub.add_parser(kind, help=(cls.__doc__ or kind).strip().splitlines()[0]))
        parsers[-1].add_argument("--name", required=True)
        cls.add_arguments(parsers[-1])
    for p in parsers:
        p.add_argument("--max-batch-size", type=int, default=64)
        p.add_argument("--force", action="store_true", help="replace an existing spec")
    args = parser.parse_args(argv)
    try:
        if args.kind in plugged:
            table = kind_spec(args.kind, args)
        elif args.kind == "text-embedding":
            table = text_spec(args.name, args.source, args.max_batch_size)
        else:
            loader_args = {}
            for item in args.arg:
                key, sep, value = item.partition("=")
                if not sep:
                    raise AddError(f"--arg {item}: expected KEY=VALUE")
                try:
                    loader_args[key] = json.loads(value)
                except json.JSONDecodeError:
                    loader_args[key] = value
            table = image_spec(args.name, args.loader, loader_args, args.input_size, args.resize,
                               _floats(args.mean, "mean"), _floats(args.std, "std"), args.labels, args.num_classes,
                               args.max_batch_size)
        path = add(table, force=args.force)
    except (AddError, specs.SpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {paths.rel(path)}; next: make build MODEL={args.name} && make serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
