"""`make demo`: build what is missing, start tritonserver, run each pipeline's client demo, stop the server.

Each demo is (name, build target, models to load, function(server)); the image pipeline adds its own entry.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tritonkit import build, data
from tritonkit.int8 import report
from tritonkit.runtime.server import TritonServer


@dataclass
class Demo:
    name: str
    target: str
    models: list[str]
    run: Callable[[TritonServer], None]


def serves(server: TritonServer, name: str) -> str:
    """What model `name`'s INT8 slot really serves here: what this CPU's class proved (the server's replica view)."""
    from tritonkit import kinds

    model = kinds.get(name).INT8_MODEL
    decision = next(d for d in server.replica_decisions if d.model == model)
    return f"{'INT8' if decision.int8 else 'FP32'} on {decision.variant} ({decision.reason})"


def text_demo(server: TritonServer) -> None:
    from tritonkit_client import embed, rank

    corpus = data.split("demo")[:200]
    queries = [
        "How do I open a network connection to another computer?",
        "Compress a file to save disk space.",
        "Parse a date written as text.",
    ]
    print(f"\n== text_embedding (all-MiniLM-L6-v2, {serves(server, 'text_embedding')}): {len(corpus)} sentences "
          "from the standard-library docs, embedded over gRPC by tritonkit_client ==")
    print(f"   {report.floor_summary('text_embedding')}")
    vectors = embed(corpus, url=server.grpc_url, protocol="grpc", batch_size=32, concurrency=4).vectors
    found = embed(queries, url=server.http_url)
    for query, vector in zip(queries, found.vectors):
        print(f"\nquery: {query}")
        for i, score in rank(vector, vectors, top_k=3):
            print(f"  {score:.3f}  {corpus[i][:100]}")


def image_demo(server: TritonServer) -> None:
    from tritonkit_client import image

    from tritonkit import kinds

    spec = kinds.get("image_classification")

    names = ["chelsea", "coffee", "rocket", "motorcycle_left", "grace_hopper", "flower"]
    fmts = ["JPEG", "PNG", "WEBP"]
    photos = [spec.photo_bytes(n, fmt=fmts[i % 3]) for i, n in enumerate(names)]
    print(f"\n== image_classification (EfficientNet-Lite0, {serves(server, 'image_classification')}): {len(photos)} "
          "bundled photos sent as "
          "JPEG/PNG/WebP bytes over HTTP, top-3 via the classification extension ==")
    print(f"   {report.floor_summary('image_classification')}")
    for name, fmt, preds in zip(names, fmts * 2, image.classify(photos, top_k=3, url=server.http_url)):
        print(f"\n{name} ({fmt}):")
        for p in preds:
            print(f"  {p.label} {p.score:.3f}")


DEMOS = [
    Demo("text", "text", ["text_embedding"], text_demo),
    Demo("image", "image", ["image_classification"], image_demo),
]


def main() -> int:
    for demo in DEMOS:
        build.build(demo.target, forms=("served",))  # the TensorRT form is `make build-engines`' business
    problems = report.check_all([demo.target for demo in DEMOS])
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    models = [m for demo in DEMOS for m in demo.models]
    print(f"starting tritonserver with {', '.join(models)} ...", flush=True)
    with TritonServer.on_free_ports(model_control_mode="explicit", models=models, per_replica=True) as server:
        print(f"ready: HTTP {server.http_url}, gRPC {server.grpc_url}")
        for demo in DEMOS:
            demo.run(server)
    print("\nserver stopped.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
