"""Tests of tritonkit.repository."""
