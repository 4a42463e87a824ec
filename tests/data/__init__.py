"""Tests of tritonkit.data."""
