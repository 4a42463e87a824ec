"""Tests of tritonkit.serving (stub-side code) and the Python backends."""
