"""Lowering of the model definitions to ONNX (the default target)."""
