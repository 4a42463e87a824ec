"""Tests of the tritonkit_client package (clients/)."""
