"""TensorRT: the build environment, plans from the built ONNX artefacts, and the configs that serve them."""
