"""Tests of tritonkit.perf."""
