"""tritonkit-client: command-line client for the tritonkit Triton deployments.

    tritonkit-client embed "a sentence" "another" [-o out.jsonl|out.npy]
    tritonkit-client embed --file texts.txt --protocol grpc --async --concurrency 8 -o vectors.npy
    tritonkit-client similar "query text" --file corpus.txt --top-k 5
    tritonkit-client classify cat.jpg espresso.png [--top-k 5] [--protocol grpc] [--async] [--shared-memory]
    tritonkit-client rerank "query text" --file documents.txt --model my_reranker [--top-n 5] [--json]
    tritonkit-client classify-text "some text" --model my_classifier [--top-k 3] [--pairs] [--json]

Each subcommand is a `Command` in COMMANDS (name, help, add_arguments, run); adding one is a small function
pair plus one line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tritonkit_client.core import ClientError, default_url


@dataclass
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--url", default=None, help="host:port (default 127.0.0.1:8000 http / :8001 grpc, "
                   "or $TRITON_HTTP_URL / $TRITON_GRPC_URL)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--batch-size", type=int, default=32, help="items per request (client-side batching)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--async", dest="use_async", action="store_true", help="use the asyncio client")


def read_lines(args_items: list[str], file: str | None) -> list[str]:
    """Items from positional args, a file ('-' = stdin) or piped stdin; one per line, blank lines skipped."""
    if args_items and file:
        raise ClientError("give texts as arguments or with --file, not both")
    if args_items:
        return list(args_items)
    if file and file != "-":
        path = Path(file)
        if not path.exists():
            raise ClientError(f"--file {file}: no such file")
        text = path.read_text(encoding="utf-8")
    elif file == "-" or not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise ClientError("no input: pass texts as arguments, --file PATH, or pipe lines on stdin")
    return [line for line in text.splitlines() if line.strip()]


def _client_kwargs(args: argparse.Namespace) -> dict:
    return {"url": args.url or default_url(args.protocol), "protocol": args.protocol, "timeout_s": args.timeout}


# -- text ----------------------------------------------------------------------------------------------------

def _embed_texts(args: argparse.Namespace, texts: list[str]):
    from tritonkit_client import text

    kwargs = {"model": args.model, "batch_size": args.batch_size, "concurrency": args.concurrency,
              **_client_kwargs(args)}
    if args.use_async:
        return asyncio.run(text.embed_async(texts, **kwargs))
    return text.embed(texts, **kwargs)


def _embed_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", help="texts to embed (or --file / stdin)")
    p.add_argument("--file", "-f", help="file with one text per line ('-' = stdin)")
    p.add_argument("--output", "-o", help="write .jsonl or .npy (default: JSONL on stdout)")
    p.add_argument("--model", default="text_embedding", help="ensemble to call (text_embedding_fp32 for FP32)")
    add_connection_arguments(p)


def _embed_run(args: argparse.Namespace) -> int:
    texts = read_lines(args.texts, args.file)
    result = _embed_texts(args, texts)
    out = args.output
    if out and out.endswith(".npy"):
        import numpy as np

        np.save(out, result.vectors)
        print(f"wrote {result.vectors.shape} float32 embeddings to {out}", file=sys.stderr)
    else:
        lines = (
            json.dumps({"text": t, "embedding": [round(float(x), 7) for x in v], "num_tokens": int(n),
                        "truncated": bool(tr)})
            for t, v, n, tr in zip(texts, result.vectors, result.num_tokens, result.truncated)
        )
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.writelines(line + "\n" for line in lines)
            print(f"wrote {len(texts)} embeddings to {out}", file=sys.stderr)
        else:
            for line in lines:
                print(line)
    if result.truncated.any():
        print(f"note: {int(result.truncated.sum())} text(s) were truncated to the server's max length",
              file=sys.stderr)
    return 0


def _similar_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("query", help="the query text")
    p.add_argument("--file", "-f", required=True, help="texts to rank, one per line ('-' = stdin)")
    p.add_argument("--top-k", "-k", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    p.add_argument("--model", default="text_embedding")
    add_connection_arguments(p)


def _similar_run(args: argparse.Namespace) -> int:
    from tritonkit_client import text

    corpus = read_lines([], args.file)
    result = _embed_texts(args, [args.query, *corpus])
    for rank, (i, score) in enumerate(text.rank(result.vectors[0], result.vectors[1:], args.top_k), 1):
        if args.json:
            print(json.dumps({"rank": rank, "score": round(score, 6), "index": i, "text": corpus[i]}))
        else:
            print(f"{rank:>3}  {score:.4f}  {corpus[i]}")
    return 0


# -- image ---------------------------------------------------------------------------------------------------

def _classify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", help="image files (JPEG, PNG, WebP)")
    p.add_argument("--top-k", "-k", type=int, default=5)
    p.add_argument("--model", default="image_classification", help="ensemble (image_classification_fp32 for FP32)")
    p.add_argument("--shared-memory", action="store_true",
                   help="send the image bytes through system shared memory (server on this host)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of 'label score' lines")
    add_connection_arguments(p)
    p.set_defaults(batch_size=8, concurrency=2)


def _classify_run(args: argparse.Namespace) -> int:
    from tritonkit_client import image

    images = image.read_images(args.files)
    kwargs = {"top_k": args.top_k, "model": args.model, "batch_size": args.batch_size,
              "concurrency": args.concurrency, "shared_memory": args.shared_memory, **_client_kwargs(args)}
    if args.use_async:
        results = asyncio.run(image.classify_async(images, **kwargs))
    else:
        results = image.classify(images, **kwargs)
    for path, preds in zip(args.files, results):
        if args.json:
            print(json.dumps({"file": path, "top": [p.__dict__ for p in preds]}))
            continue
        if len(args.files) > 1:
            print(f"# {path}")
        for p in preds:
            print(f"{p.label} {p.score:.4f}")
    return 0


# -- cross-encoders ------------------------------------------------------------------------------------------

def _rerank_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("query", help="the query text")
    p.add_argument("documents", nargs="*", help="documents to rank (or --file / stdin)")
    p.add_argument("--file", "-f", help="documents, one per line ('-' = stdin)")
    p.add_argument("--model", required=True, help="a text-rerank model (its _fp32 / _fused twins too)")
    p.add_argument("--top-n", "-n", type=int, default=None, help="print only the best N (default: all)")
    p.add_argument("--raw", action="store_true", help="rank by the raw logit instead of the activated score")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of a table")
    add_connection_arguments(p)
    p.set_defaults(batch_size=None)


def _rerank_run(args: argparse.Namespace) -> int:
    from tritonkit_client import reranking

    documents = read_lines(args.documents, args.file)
    if args.top_n is not None and args.top_n < 1:
        raise ClientError(f"--top-n must be >= 1, got {args.top_n}")
    kwargs = {"model": args.model, "top_n": args.top_n, "batch_size": args.batch_size,
              "concurrency": args.concurrency, **_client_kwargs(args)}
    if args.use_async:
        result = asyncio.run(reranking.rerank_async(args.query, documents, **kwargs))
    else:
        result = reranking.rerank(args.query, documents, **kwargs)
    for rank, (i, score) in enumerate(result.ranking(raw=args.raw), 1):
        if args.json:
            print(json.dumps({"rank": rank, "index": i, "score": float(result.scores[i]),
                              "logit": float(result.logits[i]), "truncated": bool(result.truncated[i]),
                              "text": documents[i]}))
        else:
            print(f"{rank:>3}  {score:.4f}  {documents[i]}")
    _note_truncated(result.truncated)
    return 0


def _classify_text_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("texts", nargs="*", help="texts to classify (or --file / stdin)")
    p.add_argument("--file", "-f", help="texts, one per line ('-' = stdin)")
    p.add_argument("--model", required=True, help="a text-classification model (its _fp32 / _fused twins too)")
    p.add_argument("--top-k", "-k", type=int, default=None, help="labels per text (default: all)")
    p.add_argument("--pairs", action="store_true",
                   help="each text is 'TEXT<TAB>TEXT_PAIR' (e.g. premise and hypothesis for NLI)")
    p.add_argument("--json", action="store_true", help="print JSON lines instead of 'label score' lines")
    add_connection_arguments(p)
    p.set_defaults(batch_size=None)


def _classify_text_run(args: argparse.Namespace) -> int:
    from tritonkit_client import text_classification

    lines = read_lines(args.texts, args.file)
    pairs = None
    if args.pairs:
        split = [line.split("\t", 1) for line in lines]
        bad = [i for i, parts in enumerate(split) if len(parts) != 2]
        if bad:
            raise ClientError(f"--pairs: text {bad[0]} has no TAB between the text and its pair")
        lines, pairs = [a for a, _ in split], [b for _, b in split]
    kwargs = {"model": args.model, "top_k": args.top_k, "batch_size": args.batch_size,
              "concurrency": args.concurrency, **_client_kwargs(args)}
    try:
        if args.use_async:
            result = asyncio.run(text_classification.classify_text_async(lines, pairs, **kwargs))
        else:
            result = text_classification.classify_text(lines, pairs, **kwargs)
    except ValueError as err:  # top_k out of the model's range
        raise ClientError(str(err)) from None
    for n, preds in enumerate(result.predictions):
        if args.json:
            row = {"text": lines[n], "top": [p.__dict__ for p in preds], "truncated": bool(result.truncated[n])}
            if pairs:
                row["text_pair"] = pairs[n]
            print(json.dumps(row))
            continue
        if len(lines) > 1:
            print(f"# {lines[n]}" + (f" | {pairs[n]}" if pairs else ""))
        for p in preds:
            print(f"{p.label} {p.score:.4f}")
    _note_truncated(result.truncated)
    return 0


def _note_truncated(truncated) -> None:
    if truncated.any():
        print(f"note: {int(truncated.sum())} input(s) were truncated to the model's max length", file=sys.stderr)


COMMANDS: list[Command] = [
    Command("embed", "embed texts with the text_embedding ensemble", _embed_arguments, _embed_run),
    Command("similar", "rank a file of texts against a query by cosine similarity", _similar_arguments,
            _similar_run),
    Command("classify", "classify image files with the image_classification ensemble", _classify_arguments,
            _classify_run),
    Command("rerank", "score documents against a query with a cross-encoder (text-rerank model), best first",
            _rerank_arguments, _rerank_run),
    Command("classify-text", "label texts or text pairs with a text-classification model", _classify_text_arguments,
            _classify_text_run),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tritonkit-client", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except ClientError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
