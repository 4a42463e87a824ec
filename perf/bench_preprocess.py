"""Image preprocessing throughput per core: tritonkit.serving.imaging (served path) vs plain PIL, same photos, same run.

    python perf/bench_preprocess.py [--repeats 7] [--format JPEG]

Input: the bundled real photos of 300–741 px (scikit-image, matplotlib, scikit-learn samples) encoded once as
JPEG q90, as clients send them. One thread (one core), no batching; passes of all paths are interleaved and
the median pass is reported, so background load hits all alike. Output: table + perf/results/preprocess.json.

JPEG decoders: where simplejpeg or PyTurboJPEG is importable (neither is a project dependency:
docs/performance.md, "Preprocessing"), the served path is also run with that library decoding in place of Pillow,
at the same DCT scale, and reported with its per-repeat speed-up over the served path and its largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

from tritonkit import kinds, paths
from tritonkit.perf.interleave import interleaved
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


def library_decoders() -> tuple[dict[str, imaging.JpegDecoder], list[str]]:
    """JPEG decoders importable here, each (data, width, height) → uint8 RGB decoded at that DCT-scaled size, and
    the reasons the others are not."""
    found: dict[str, imaging.JpegDecoder] = {}
    missing = []
    try:
        import simplejpeg

        found[f"simplejpeg {simplejpeg.__version__}"] = lambda b, w, h: simplejpeg.decode_jpeg(
            b, colorspace="RGB", min_width=w, min_height=h)
    except ImportError:
        missing.append("simplejpeg: not installed")
    try:
        import turbojpeg

        tj = turbojpeg.TurboJPEG()

        def pyturbojpeg(b: bytes, w: int, h: int) -> np.ndarray:
            full = tj.decode_header(b)[0]
            factor = next(a for a in (1, 2, 4, 8) if -(-full // a) == w)
            return tj.decode(b, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=(1, factor) if factor > 1 else None)

        found["PyTurboJPEG"] = pyturbojpeg
    except ImportError:
        missing.append("PyTurboJPEG: not installed")
    except (OSError, RuntimeError) as exc:  # the package loads the system libturbojpeg at construction
        missing.append(f"PyTurboJPEG: {exc}".splitlines()[0])
    return found, missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--format", default="JPEG", choices=["JPEG", "PNG", "WEBP"])
    args = parser.parse_args(argv)

    photos = bench_photos(args.format)
    data = [d for _, d in photos]
    cfg = imaging.PreprocessConfig()
    plain_name = "plain PIL (decode, resize shorter side, crop, normalise)"
    served_name = "tritonkit.serving.imaging (draft DCT downscale + crop-box resample + LUT)"
    paths_ = {plain_name: lambda b: imaging.plain_preprocess(b, cfg),
              served_name: lambda b: imaging.preprocess([b], cfg)[0]}
    decoders, missing = library_decoders() if args.format == "JPEG" else ({}, [])
    for name, decode in decoders.items():
        paths_[f"served path, {name} decoding the JPEG"] = lambda b, d=decode: imaging.preprocess([b], cfg, d)[0]
    served = [paths_[served_name](b) for b in data]
    max_diff = {k: max(float(np.abs(fn(b) - ref).max()) for b, ref in zip(data, served))
                for k, fn in paths_.items() if k != plain_name}
    times = interleaved({name: lambda fn=fn: [fn(b) for b in data] for name, fn in paths_.items()}, args.repeats)
    rates = {k: len(data) / statistics.median(v) for k, v in times.items()}
    plain, fast = rates[plain_name], rates[served_name]
    # Per repeat, served time / this path's time: passes run back to back, so a load change hits both.
    paired = {k: statistics.median(s / t for s, t in zip(times[served_name], v)) for k, v in times.items()}

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"preprocess, 1 core, {len(data)} {args.format} photos "
                  f"({MIN_SIDE}–{MAX_SIDE} px), median of {args.repeats}")
    table.add_column("path")
    table.add_column("img/s per core", justify="right")
    table.add_column("ms/img", justify="right")
    table.add_column("× served (paired)", justify="right")
    table.add_column("max |Δ| vs served", justify="right")
    for k, r in rates.items():
        diff = f"{max_diff[k]:.3g}" if k in max_diff else "-"
        table.add_row(k, f"{r:.0f}", f"{1e3 / r:.2f}", f"{paired[k]:.3f}", diff)
    Console().print(table)
    for line in missing:
        print(f"not compared: {line}")
    print(f"speed-up {fast / plain:.2f}x; target >= 400 img/s per core: {'met' if fast >= 400 else 'NOT met'}")
    out = paths.ROOT / "perf" / "results" / "preprocess.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"photos": [n for n, _ in photos], "format": args.format, "repeats": args.repeats,
                               "img_per_s_per_core": rates, "speedup": fast / plain,
                               "paired_vs_served": paired, "max_abs_diff_vs_served": max_diff}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
