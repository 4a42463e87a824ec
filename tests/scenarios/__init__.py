"""Scenario suites: whole pipelines and failure modes on real servers."""
