"""The perf lab (`make perf`): perf_analyzer sweeps of both pipelines and their composing models, in-process
baselines in the same run, CSV/JSON/Markdown/PNG in perf/results/<stamp>/. `python perf/lab.py --help`."""

import sys

from tritonkit.perf.lab import main

if __name__ == "__main__":
    sys.exit(main())
