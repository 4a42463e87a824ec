"""Helpers the tests share (tiny models, text builds, INT8 fallback checks)."""
