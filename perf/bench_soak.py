"""Soak benchmark (tritonkit.perf.soak): mixed text + image traffic at ~70 % of capacity for minutes; errors, p99
drift and memory. `python perf/bench_soak.py --help`."""

import sys

from tritonkit.perf.soak import main

if __name__ == "__main__":
    sys.exit(main())
