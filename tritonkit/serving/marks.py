"""Config parameter names that the repository writes and our stubs read (no imports: the container's supervisor loads
this too)."""

# "1": this INT8-named model serves the INT8 graph proven on this CPU's class; "0": FP32 (a replica's view sets it,
# tritonkit.repository.replica; stubs publish it as the gauge INT8_SERVED_METRIC).
INT8_SERVED_PARAMETER = "tritonkit_int8_served"
INT8_SERVED_METRIC = "tritonkit_int8_served"
# Why an INT8-named model serves FP32 (in its config, or in its ONNX file's metadata from this machine's build).
PRECISION_PARAMETER = "tritonkit_precision"
