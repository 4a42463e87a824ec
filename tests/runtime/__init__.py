"""Tests of tritonkit.runtime."""
