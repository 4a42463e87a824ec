"""Tests of tritonkit.tensorrt."""
