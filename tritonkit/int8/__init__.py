"""INT8 for a model spec: Q/DQ quantization (quantize), weight rounding, the accuracy-aware recipe search judged
against the half-precision floor, and the committed recipes with their reports (recipe)."""
