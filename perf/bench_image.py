"""image_classification throughput: perf_analyzer through the ensembles with real image bytes, and in the same
run the naive in-process baseline (plain PIL decode + torch FP32 EfficientNet-Lite0, batch 32).

    python perf/bench_image.py [--concurrency 1 4 8 16] [--repeats 2] [--measurement-ms 5000]

Input: the bundled real photos (scikit-image, matplotlib, scikit-learn samples) as JPEG q90, one image per
request (shape [1]), cycled by perf_analyzer. The baseline runs while the server is idle, on the same cores.
Output: table + perf/results/image.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import struct

from tritonkit import kinds, paths
from tritonkit.perf import analyzer
from tritonkit.serving import imaging
from tritonkit.serving.backend_utils import usable_cpus

spec = kinds.get("image_classification")


ENSEMBLES = {"INT8 (image_classification)": "image_classification",
             "FP32 (image_classification_fp32)": "image_classification_fp32"}
BASELINE_BATCH = 32


def image_rows(images: list[bytes]) -> list[dict]:
    """perf_analyzer --input-data rows: base64 of the serialized BYTES tensor (4-byte little-endian length +
    the JPEG), so binary data survives JSON."""
    return [{"IMAGE": {"b64": base64.b64encode(struct.pack("<I", len(b)) + b).decode(), "shape": [1]}}
            for b in images]


def naive_baseline(images: list[bytes], duration_s: float) -> analyzer.PerfPoint:
    """What a first attempt would serve: PIL full decode + resize + crop per image, torch FP32 at batch 32."""
    import numpy as np
    import torch

    torch.set_num_threads(usable_cpus())
    model = spec.load_classifier()
    batches = [[images[(i + j) % len(images)] for j in range(BASELINE_BATCH)] for i in range(len(images))]

    def run(batch: list[bytes]):
        x = torch.from_numpy(np.stack([imaging.plain_preprocess(b) for b in batch]))
        with torch.no_grad():
            return model(x)[1].topk(5)

    return analyzer.time_in_process(run, batches, concurrency=1, duration_s=duration_s, warmup=1,
                                    label=f"naive baseline: PIL + torch FP32, batch {BASELINE_BATCH}",
                                    items_per_call=BASELINE_BATCH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measurement-ms", type=int, default=5000)
    parser.add_argument("--protocol", choices=["http", "grpc"], default="grpc")
    parser.add_argument("--int8-only", action="store_true")
    args = parser.parse_args(argv)

    from tritonkit import build
    from tritonkit.runtime.server import TritonServer

    build.build("image", progress=False)  # no-op when the artefacts are current
    images = [imaging.encode(p.rgb, "JPEG", 90) for p in spec.photos()]
    input_data = analyzer.write_input_data(paths.ROOT / "perf" / "results" / "image_input.json", image_rows(images))
    ensembles = dict(list(ENSEMBLES.items())[:1]) if args.int8_only else ENSEMBLES

    points: list[analyzer.PerfPoint] = []
    with TritonServer.on_free_ports(model_control_mode="explicit", models=list(ensembles.values())) as server:
        url = server.grpc_url if args.protocol == "grpc" else server.http_url
        for label, model in ensembles.items():
            points += analyzer.sweep(model, url, args.concurrency, input_data, repeats=args.repeats, label=label,
                                     protocol=args.protocol, measurement_ms=args.measurement_ms)
    baseline = naive_baseline(images, duration_s=args.measurement_ms / 1e3 * 2)
    best_int8 = max((p for p in points if p.label.startswith("INT8")), key=lambda p: p.throughput)
    ratio = best_int8.throughput / baseline.throughput
    analyzer.print_table([*points, baseline], f"image_classification, {os.cpu_count()} cores, {len(images)} real "
                         f"JPEG photos, one image per request ({args.protocol})")
    print(f"served INT8 best {best_int8.throughput:.1f} img/s (c={best_int8.concurrency}) = {ratio:.2f}x the naive "
          f"baseline {baseline.throughput:.1f} img/s; target >= 6x: {'met' if ratio >= 6 else 'NOT met'}")
    out = paths.ROOT / "perf" / "results" / "image.json"
    out.write_text(json.dumps({"points": [p.to_json() for p in points], "baseline": baseline.to_json(),
                               "int8_vs_baseline": ratio, "args": vars(args)}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
