"""Code that runs inside Triton's Python-backend stubs: the backend models generated model directories import
(their 1/model.py is a one-line shim) and the helpers they share (parameters, batching, text and image decoding,
packed batches). Imports only tritonkit.errors, tritonkit.paths and this package."""
