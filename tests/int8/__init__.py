"""Tests of tritonkit.int8."""
