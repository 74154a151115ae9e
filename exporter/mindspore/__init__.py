"""MindSpore lowering: one static MINDIR per gear from graphs/llama.py, for Ascend primitives or our CPU kernels."""
