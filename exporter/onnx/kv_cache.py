"""The KV-cache dtype conversions of the ONNX bodies (graphs/kv_cache.py's contract, as standard ops).

ReshapeAndCache's variants write rows converted by `to_cache`; PagedAttention's read the gathered
rows back through `Dequant` (float32 is the identity: its bodies are unchanged).
"""
from __future__ import annotations

from onnx import TensorProto

from .nodes import Nodes
from ...graphs.kv_cache import INT8_MAX, INT8_MIN, CacheFormat


def to_cache(n: Nodes, fmt: CacheFormat, x: str, inv_scale: str | None = None, offset: str | None = None) -> str:
    """float32 rows in the cache dtype: as they are, cast, or quantized (int8: `inv_scale`, int32 `offset`)."""
    if fmt.name == "float32":
        return x
    if not fmt.quantized:
        return n.op("Cast", x, to=fmt.onnx_type)
    shifted = n.op("Add", n.op("Mul", x, inv_scale), n.op("Cast", offset, to=TensorProto.FLOAT))
    clipped = n.op("Clip", n.op("Round", shifted), n.const(float(INT8_MIN), dtype="float32"),
                   n.const(float(INT8_MAX), dtype="float32"))
    return n.op("Cast", clipped, to=fmt.onnx_type)


def from_cache(n: Nodes, fmt: CacheFormat, rows: str, scale: str | None = None, offset: str | None = None) -> str:
    """Cache rows as float32: as they are, widened, or dequantized (int8: `scale` and a float `offset` that
    broadcast against the rows)."""
    if fmt.name == "float32":
        return rows
    wide = n.op("Cast", rows, to=TensorProto.FLOAT)
    if not fmt.quantized:
        return wide
    return n.op("Mul", n.op("Sub", wide, offset), scale)


class Dequant:
    """Gathered pool rows [..., KV*D] back to float32 inside a PagedAttention body (formal inputs k_scale,
    k_offset, v_scale, v_offset for int8)."""

    def __init__(self, n: Nodes, fmt: CacheFormat) -> None:
        self.fmt = fmt
        # Offsets as float once, outside every branch (shared by all the gathers of the op).
        self.offsets = {kv: n.op("Cast", f"{kv}_offset", to=TensorProto.FLOAT) for kv in "kv"} if fmt.quantized else {}

    @property
    def identity(self) -> bool:
        return self.fmt.name == "float32"

    def __call__(self, b: Nodes, rows: str, kv: str) -> str:
        return from_cache(b, self.fmt, rows, f"{kv}_scale", self.offsets.get(kv))
