"""Linear.w8a8: int8 weights per output channel, activations quantized per token at run time; DynamicQuant.

y[t, n] = (sum_j qx[t, j] * qw[j, n]) * sx[t] * sw[n] (+ bias), with sx[t] = max(|x[t]|, eps) / 127 and
qx = round(x / sx) (ties to even, as ONNX Round) in -127..127: symmetric, so the int8 codes can ride as uint8
with ONE zero point 128 for every row, which is the form ONNX Runtime's fast u8s8 int8 GEMM takes
(MatMulIntegerToFloat; its s8s8 path is several times slower on x86, docs/performance.md).
Weight codes are int8 in MatMulInteger's [K, N] layout, scales float32 [N].
ATB counterpart: LinearOperation with W8A8 per-token dynamic quantization (MindIE's w8a8_dynamic).

DynamicQuant is that per-token quantize as one op (ATB's ELEWISE_DYNAMIC_QUANT): as standard ops it is eight nodes
per linear (Abs, ReduceMax, Max, Div, Div, Round, Add, Cast), a large share of a w8a8 decode step
(docs/performance.md, 'Precision').
Its codes come shifted by 128 into uint8, the form Linear.w8a8's ONNX body feeds MatMulIntegerToFloat.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor
from ..quant import Int8PerChannel

# Smallest row maximum: a row of zeros quantizes to zeros instead of dividing by zero.
ROW_MAX_FLOOR = 1e-8


@dataclass(frozen=True)
class W8A8Attributes(Attributes):
    K: int  # noqa: N815 (the other quantized linears' names)
    N: int  # noqa: N815


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric int8 codes (as float32, exactly integers) and the row scales [T, 1]."""
    scale = np.maximum(np.abs(x).max(axis=1, keepdims=True), np.float32(ROW_MAX_FLOOR)) / np.float32(127)
    return np.rint(x / scale).astype(np.float32), scale.astype(np.float32)


def dynamic_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The codes + 128 as uint8 [T, K] and the row scales [T, 1]: what MatMulIntegerToFloat reads."""
    codes, row_scale = quantize_rows(x)
    return (codes + np.float32(128)).astype(np.uint8), row_scale


def linear_w8a8(x: np.ndarray, weight: np.ndarray, scale: np.ndarray, bias: np.ndarray | None = None, *,
                K: int, N: int) -> np.ndarray:  # noqa: N803
    codes, row_scale = quantize_rows(x)
    acc = codes.astype(np.int64) @ weight.astype(np.int64)  # exact, as the int32 GEMM
    out = acc.astype(np.float32) * scale * row_scale
    return (out if bias is None else out + bias).astype(np.float32)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(2)
    k, n = 128, 40
    w = Int8PerChannel.quantize(normal(rng, n, k, scale=0.05))
    x = normal(rng, 6, k)
    x[1, 7] *= 30  # an outlier channel in one token
    x[4] = 0  # a row of zeros (padding)
    inputs = (np.ascontiguousarray(w.q.T), w.scale)
    scale = float(np.abs(linear_w8a8(x, *inputs, K=k, N=n)).max())
    yield Example((x, *inputs, None), dict(K=k, N=n), atol=1e-5 * scale, rtol=1e-5, label="no bias")
    yield Example((x[:1], *inputs, normal(rng, n)), dict(K=k, N=n), atol=1e-5 * scale, rtol=1e-5,
                  label="one token, bias")


def _quant_examples() -> Iterator[Example]:
    """Widths around the kernel's 16-lane steps, an outlier, a row of zeros, ties at +-0.5 steps."""
    rng = np.random.default_rng(3)
    for tokens, k in ((1, 576), (5, 40), (48, 1536), (2, 7)):  # 48 x 1536: the parallel path
        x = normal(rng, tokens, k)
        x[0, k // 2] *= 25
        if tokens > 2:
            x[2] = 0
            x[1, :4] = np.float32([127, -127, 0.5, -1.5])  # the max 127: codes 127, -127, ties 0 and -2
        yield Example((x,), {}, atol=0, rtol=0, label=f"[{tokens}, {k}]")


DYNAMIC_QUANT = Op(
    name="DynamicQuant",
    atb="ElewiseOperation (ELEWISE_DYNAMIC_QUANT): per-token symmetric int8 codes and row scales",
    inputs=(Tensor("x", ("T", "K")),),
    outputs=(Tensor("codes", ("T", "K"), ("uint8",)), Tensor("row_scale", ("T", "1"))),
    reference=dynamic_quant,
    examples=_quant_examples,
    doc="per-token int8 of Linear.w8a8's input, the codes + 128 as uint8 (ORT's u8s8 GEMM takes one zero point)",
)


LINEAR_W8A8 = Op(
    name="Linear",
    variant="w8a8",
    atb="LinearOperation, W8A8 per-token dynamic (MatMulIntegerToFloat on CPU)",
    inputs=(Tensor("x", ("T", "K")), Tensor("weight", ("K", "N"), ("int8",)), Tensor("scale", ("N",)),
            Tensor("bias", ("N",), optional=True)),
    outputs=(Tensor("y", ("T", "N")),),
    reference=linear_w8a8,
    attributes=W8A8Attributes,
    examples=_examples,
    doc="int8 weights per output channel, int8 activations per token quantized in the graph",
)
