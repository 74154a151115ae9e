"""Linear.w8a8_static: MindIE's W8A8 format (the Ascend form), activations quantized with calibrated static
per-tensor parameters.

    x_q = clip(round(x / input_scale) + input_offset, -128, 127)            int8
    y   = (x_q @ weight.T + quant_bias) * deq_scale                          int32 accumulate, per-channel dequant

weight int8 [n, k] (ATB's layout), quant_bias int32 [n] (the float bias / deq_scale with the offset's term
-input_offset * sum_k weight folded in, as MindIE stores it), deq_scale [n] = input_scale * weight scale:
float32 for bf16 models, int64 for fp16 ones (the float32's bits in the low 32 bits, MindIE's encoding).
ATB / MindSpore: QuantBatchMatmul (Ascend only; the CPU graphs use Linear.w8a8, per-token dynamic).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor
from ..quant import Int8PerChannel


@dataclass(frozen=True)
class W8A8StaticAttributes(Attributes):
    K: int  # noqa: N815
    N: int  # noqa: N815


def deq_scale_values(deq_scale: np.ndarray) -> np.ndarray:
    """float32 per-channel scales from either encoding (int64 holds the float32 bit pattern)."""
    if deq_scale.dtype == np.int64:
        return (deq_scale & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    return deq_scale.astype(np.float32)


def encode_deq_scale(scale: np.ndarray) -> np.ndarray:
    """MindIE's int64 deq_scale of fp16 models: the float32 bits, zero-extended."""
    return np.ascontiguousarray(scale, np.float32).view(np.uint32).astype(np.int64)


def linear_w8a8_static(x: np.ndarray, weight: np.ndarray, input_scale: np.ndarray, input_offset: np.ndarray,
                       quant_bias: np.ndarray, deq_scale: np.ndarray, *, K: int, N: int) -> np.ndarray:  # noqa: N803
    codes = np.clip(np.rint(x / input_scale) + input_offset, -128, 127).astype(np.int64)
    acc = codes @ weight.astype(np.int64).T + quant_bias
    return (acc.astype(np.float32) * deq_scale_values(deq_scale)).astype(np.float32)


def mindie_tensors(w: Int8PerChannel, bias: np.ndarray | None, input_scale: float, input_offset: int,
                   fp16: bool) -> tuple[np.ndarray, ...]:
    """weight, input_scale, input_offset, quant_bias, deq_scale in MindIE's dtypes, from an int8 per-channel
    weight and calibrated per-tensor activation parameters."""
    deq = (w.scale * np.float32(input_scale)).astype(np.float32)
    float_bias = np.zeros(w.shape[0], np.float32) if bias is None else bias
    quant_bias = np.rint(float_bias / deq) - input_offset * w.q.astype(np.int64).sum(axis=1)
    return (w.q, np.array([input_scale], np.float32), np.array([input_offset], np.float32),
            quant_bias.astype(np.int32), encode_deq_scale(deq) if fp16 else deq)


def _examples() -> Iterator[Example]:
    rng = np.random.default_rng(3)
    k, n = 64, 24
    w = Int8PerChannel.quantize(normal(rng, n, k, scale=0.05))
    x = normal(rng, 5, k) + 0.3  # an asymmetric range: a nonzero offset
    low, high = float(x.min()), float(x.max())
    scale = (high - low) / 255
    offset = int(np.rint(-128 - low / scale))
    for fp16 in (True, False):
        inputs = mindie_tensors(w, normal(rng, n), scale, offset, fp16)
        top = float(np.abs(linear_w8a8_static(x, *inputs, K=k, N=n)).max())
        yield Example((x, *inputs), dict(K=k, N=n), atol=1e-5 * top, rtol=1e-5,
                      label=f"deq_scale {'int64 (fp16 model)' if fp16 else 'float32 (bf16 model)'}")


LINEAR_W8A8_STATIC = Op(
    name="Linear",
    variant="w8a8_static",
    atb="LinearOperation, W8A8 (MindIE: input_scale/input_offset, quant_bias, deq_scale; QuantBatchMatmul)",
    inputs=(Tensor("x", ("T", "K")), Tensor("weight", ("N", "K"), ("int8",)), Tensor("input_scale", ("1",)),
            Tensor("input_offset", ("1",)), Tensor("quant_bias", ("N",), ("int32",)),
            Tensor("deq_scale", ("N",), ("int64", "float32"))),
    outputs=(Tensor("y", ("T", "N")),),
    reference=linear_w8a8_static,
    attributes=W8A8StaticAttributes,
    examples=_examples,
    doc="MindIE W8A8: static per-tensor activation scale/offset, int32 quant_bias, per-channel deq_scale",
)
