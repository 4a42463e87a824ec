"""Python-backend models that generated model directories import (their 1/model.py is a one-line shim)."""
