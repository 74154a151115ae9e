"""MindSpore lowering: one static MINDIR per gear of a model's graph (graphs/models), for Ascend primitives or our
CPU kernels."""
