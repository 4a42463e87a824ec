"""Image preprocessing throughput per core: tritonkit.serving.imaging (served path) vs plain PIL, same photos, same run.

    python perf/bench_preprocess.py [--repeats 7] [--format JPEG]

Input: the bundled real photos of 300–741 px (scikit-image, matplotlib, scikit-learn samples) encoded once as
JPEG q90, as clients send them. One thread (one core), no batching; passes of both paths are interleaved and
the median pass is reported, so background load hits both alike. Output: table + perf/results/preprocess.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from tritonkit import kinds, paths
from tritonkit.serving import imaging

spec = kinds.get("image_classification")


MAX_SIDE = 800  # everyday photo sizes: skip the 1000+ px hubble/retina and tiny text scans
MIN_SIDE = 280


def bench_photos(fmt: str = "JPEG", quality: int = 90) -> list[tuple[str, bytes]]:
    out = []
    for p in spec.photos():
        h, w = p.rgb.shape[:2]
        if max(h, w) <= MAX_SIDE and min(h, w) >= MIN_SIDE:
            out.append((p.name, imaging.encode(p.rgb, fmt, quality)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--format", default="JPEG", choices=["JPEG", "PNG", "WEBP"])
    args = parser.parse_args(argv)

    photos = bench_photos(args.format)
    data = [d for _, d in photos]
    cfg = imaging.PreprocessConfig()
    paths_ = {
        "plain PIL (decode, resize shorter side, crop, normalise)": lambda b: imaging.plain_preprocess(b, cfg),
        "tritonkit.serving.imaging (draft DCT downscale + crop-box resample + LUT)":
            lambda b: imaging.preprocess([b], cfg),
    }
    times: dict[str, list[float]] = {k: [] for k in paths_}
    for fn in paths_.values():  # warm-up
        for b in data:
            fn(b)
    for _ in range(args.repeats):
        for name, fn in paths_.items():
            t0 = time.perf_counter()
            for b in data:
                fn(b)
            times[name].append(time.perf_counter() - t0)
    rates = {k: len(data) / statistics.median(v) for k, v in times.items()}
    plain, fast = rates.values()

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"preprocess, 1 core, {len(data)} {args.format} photos "
                  f"({MIN_SIDE}–{MAX_SIDE} px), median of {args.repeats}")
    table.add_column("path")
    table.add_column("img/s per core", justify="right")
    table.add_column("ms/img", justify="right")
    for k, r in rates.items():
        table.add_row(k, f"{r:.0f}", f"{1e3 / r:.2f}")
    Console().print(table)
    print(f"speed-up {fast / plain:.2f}x; target >= 400 img/s per core: {'met' if fast >= 400 else 'NOT met'}")
    out = paths.ROOT / "perf" / "results" / "preprocess.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"photos": [n for n, _ in photos], "format": args.format, "repeats": args.repeats,
                               "img_per_s_per_core": rates, "speedup": fast / plain}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
