"""Tests of the kinds package (specs, gates, one class per kind)."""
