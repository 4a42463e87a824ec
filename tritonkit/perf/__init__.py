"""Performance: the perf_analyzer driver (analyzer), load generation, the perf lab, in-process baselines, peer
servers, config tuning and head-to-head comparisons."""
