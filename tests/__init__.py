"""tritonkit's tests: tests/<package>/test_<module>.py, scenario suites in scenarios/, helpers in support/."""
