"""Run-to-run spread of the CI perf gate's ratio (served / in-process INT8 ceiling), on the artefacts already built.

    .venv/bin/python perf/gate_noise.py --runs 5 --pipelines text image   # with no other heavy job running

Each run is `tritonkit.perf.lab.gate_ratios` (a fresh server, interleaved served and baseline rounds), except that the
build step is skipped: this measures the noise of the measurement, not of a rebuild. Prints every ratio and the
relative spread (max - min) / median per pipeline; `tritonkit.perf.lab.GATE` sits that far under the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tritonkit.perf import lab


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pipelines", nargs="+", default=["text", "image"])
    args = parser.parse_args(argv)
    for name in args.pipelines:
        ratios = []
        for i in range(args.runs):
            r = lab.gate_ratios(name, build_first=False)
            ratios.append(r["ratio"])
            print(f"{name} run {i + 1}: served {r['served']:.1f}/s baseline {r['baseline']:.1f}/s "
                  f"ratio {r['ratio']:.2f} (min {r['min_ratio']})", flush=True)
        median = statistics.median(ratios)
        spread = (max(ratios) - min(ratios)) / median
        print(f"{name}: ratio min {min(ratios):.2f} median {median:.2f} max {max(ratios):.2f}, "
              f"spread {spread:.1%} ({time.strftime('%Y-%m-%d %H:%M')}); a gate at median - spread: "
              f"{min(lab.TARGET, median * (1 - spread)):.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
