"""Block-quantized weights: the one weight form every quantized Linear / Gather variant takes.

A linear weight W [n, k] (ATB's [out, in] layout) is held as integer codes q with, per row and per block
of `block_size` consecutive inputs, a float scale, an optional integer zero point and an optional float
minimum:

    W[i, j] = (q[i, j] - zero_point[i, j // block_size]) * scale[i, j // block_size] + minimum[i, j // block_size]

This one form holds GGUF's blocks without loss (Q4_0: zero point 8; Q8_0: codes + 128, zero point 128;
Q4_1 and the K-quants: zero point 0 and the block's min as `minimum`), and the round-to-nearest weight-only
formats (w8a16: one scale per row repeated over its blocks; w4a16: group-wise scale and zero point).
The order of the float operations above is the one `gguf.quants.dequantize` uses, so `dequantize()`
reproduces the file's weights bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

BITS = (4, 8)
ROW_CHUNK = 1 << 22  # elements per row chunk of a quantizer: its float32 temporaries stay at a few of these


def row_chunks(rows: int, width: int) -> list[slice]:
    """Consecutive row ranges of about ROW_CHUNK elements: row-wise quantizers run chunk by chunk, so a 49k x 4k
    embedding needs its output and a few chunk-sized temporaries, not several whole-size float32 copies."""
    step = max(1, ROW_CHUNK // max(width, 1))
    return [slice(begin, min(begin + step, rows)) for begin in range(0, rows, step)]


@dataclass(frozen=True)
class BlockForm:
    """What a graph needs of a block-quantized weight to emit its op variant, without its data."""

    shape: tuple[int, int]
    bits: int
    block_size: int
    has_minimum: bool
    default_zero_point: bool  # every zero point is 2**(bits-1), MatMulNBits' default: no zero-point input
    source: str


@dataclass(frozen=True)
class Int8Form:
    """An `Int8PerChannel` weight's shape: all Linear.w8a8 needs of it."""

    shape: tuple[int, int]
    source: str = "int8-per-channel"


@dataclass(frozen=True)
class DenseForm:
    """A float weight (float32, or bfloat16 where the graph stores it so)."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class BlockQuantized:
    """Integer codes `q` uint8 [n, k] plus per-block scale, zero point and minimum, each [n, k / block_size]."""

    q: np.ndarray
    scale: np.ndarray  # float32
    zero_point: np.ndarray  # uint8, < 2**bits
    minimum: np.ndarray | None  # float32 [n, blocks], or None where the form has no additive term
    bits: int
    block_size: int
    source: str  # what the codes came from, for reports: "Q4_1", "rtn-int4-g64", ...

    def __post_init__(self) -> None:
        n, k = self.q.shape
        blocks = (n, k // self.block_size)
        if self.bits not in BITS or k % self.block_size or self.scale.shape != blocks or self.zero_point.shape != blocks:
            raise ValueError(f"inconsistent block-quantized weight: q {self.q.shape}, scale {self.scale.shape}, "
                             f"zero point {self.zero_point.shape}, {self.bits} bits, blocks of {self.block_size}")
        if self.minimum is not None and self.minimum.shape != blocks:
            raise ValueError(f"minimum {self.minimum.shape} does not match {blocks} blocks")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    @property
    def form(self) -> BlockForm:
        return BlockForm(self.shape, self.bits, self.block_size, self.minimum is not None,
                         bool(np.all(self.zero_point == 1 << (self.bits - 1))), self.source)

    @property
    def nbytes(self) -> int:
        """Bytes as stored: codes packed to `bits`, float32 scales, minima as `minimum_t` stores them, uint8 zero
        points."""
        n, k = self.q.shape
        extra = 0 if self.minimum is None else self.minimum.size * minimum_dtype(self.minimum).itemsize
        return n * k * self.bits // 8 + self.scale.nbytes + self.zero_point.nbytes + extra

    def dequantize(self) -> np.ndarray:
        """float32 [n, k], in `gguf.quants.dequantize`'s order of operations."""
        n, k = self.q.shape
        blocks = (n, k // self.block_size, self.block_size)
        codes = self.q.reshape(blocks).astype(np.float32) - self.zero_point.astype(np.float32)[:, :, None]
        w = codes * self.scale[:, :, None]
        if self.minimum is not None:
            w = w + self.minimum[:, :, None]
        return w.reshape(n, k)

    def rows(self, order: np.ndarray) -> "BlockQuantized":
        """The same weight with its output rows permuted (rope un-permutation of GGUF's Q/K)."""
        return BlockQuantized(self.q[order], self.scale[order], self.zero_point[order],
                              None if self.minimum is None else self.minimum[order], self.bits, self.block_size,
                              self.source)


@dataclass(frozen=True)
class Int8PerChannel:
    """W8A8's weight: symmetric int8 codes [n, k] and one float32 scale per output row, W = q * scale[:, None].

    Activations are quantized per token at run time (Linear.w8a8, graphs/ops/linear_w8a8.py)."""

    q: np.ndarray  # int8, in -127..127
    scale: np.ndarray  # float32 [n]
    source: str = "int8-per-channel"

    def __post_init__(self) -> None:
        if self.q.dtype != np.int8 or self.q.ndim != 2 or self.scale.shape != (self.q.shape[0],):
            raise ValueError(f"inconsistent int8 per-channel weight: q {self.q.dtype} {self.q.shape}, "
                             f"scale {self.scale.shape}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self) -> np.ndarray:
        return self.q.astype(np.float32) * self.scale[:, None]

    @property
    def form(self) -> Int8Form:
        return Int8Form(self.shape, self.source)

    @classmethod
    def quantize(cls, w: np.ndarray) -> "Int8PerChannel":
        """Round to nearest with scale max|row| / 127 (the row's largest weight is kept exactly in range)."""
        q, scale = np.empty(w.shape, np.int8), np.empty(w.shape[0], np.float32)
        for rows in row_chunks(*w.shape):  # in place in one chunk-sized buffer: fresh temporaries cost 3x the time
            buffer = np.abs(w[rows])
            part = (buffer.max(axis=1) / np.float32(127)).astype(np.float32)
            part[part == 0] = 1
            np.divide(w[rows], part[:, None], out=buffer)
            q[rows], scale[rows] = np.clip(np.rint(buffer, out=buffer), -127, 127, out=buffer), part
        return cls(q, scale)


@dataclass(frozen=True)
class ExpertStack:
    """E block-quantized experts of one form: a GroupedMatmul's weight [E, N, K] (graphs/ops/grouped_matmul.py).
    Its `form` is one expert's ([N, K]): what the op variant's attributes describe."""

    experts: tuple[BlockQuantized, ...]

    def __post_init__(self) -> None:
        forms = {(w.shape, w.bits, w.block_size, w.minimum is not None, w.form.default_zero_point)
                 for w in self.experts}
        if len(forms) != 1:
            raise ValueError(f"the experts' quantized forms differ ({sorted(forms)}); a GroupedMatmul reads one form "
                             "for every expert: quantize them alike")

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.experts), *self.experts[0].shape)

    @property
    def form(self) -> BlockForm:
        return self.experts[0].form

    @property
    def source(self) -> str:
        return "+".join(sorted({w.source for w in self.experts}))

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.experts)

    def dequantize(self) -> np.ndarray:
        return np.stack([w.dequantize() for w in self.experts])


Weight = np.ndarray | BlockQuantized | Int8PerChannel | ExpertStack
WeightForm = DenseForm | BlockForm | Int8Form


def form_of(w: Weight) -> WeightForm:
    if isinstance(w, (BlockQuantized, Int8PerChannel, ExpertStack)):
        return w.form
    return DenseForm(w.shape, w.dtype.name)


def concat_rows(parts: Sequence[Weight]) -> Weight:
    """Stack weights along the output axis (fused QKV, gate/up); quantized parts must share one form."""
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts, axis=0)  # type: ignore[arg-type]
    if all(isinstance(p, Int8PerChannel) for p in parts):
        return Int8PerChannel(np.concatenate([p.q for p in parts]),  # type: ignore[union-attr]
                              np.concatenate([p.scale for p in parts]), parts[0].source)  # type: ignore[union-attr]
    first = parts[0]
    same = all(isinstance(p, BlockQuantized) and isinstance(first, BlockQuantized)
               and (p.bits, p.block_size) == (first.bits, first.block_size)
               and (p.minimum is None) == (first.minimum is None) for p in parts)
    if not same or not isinstance(first, BlockQuantized):
        forms = ", ".join(str(p.dtype) if isinstance(p, np.ndarray) else p.source for p in parts)
        raise ValueError(f"cannot fuse weights of different forms ({forms}) into one linear")
    quantized = [p for p in parts if isinstance(p, BlockQuantized)]
    minimum = None if first.minimum is None else np.concatenate([p.minimum for p in quantized])  # type: ignore[misc]
    return BlockQuantized(np.concatenate([p.q for p in quantized]), np.concatenate([p.scale for p in quantized]),
                          np.concatenate([p.zero_point for p in quantized]), minimum, first.bits, first.block_size,
                          "+".join(sorted({p.source for p in quantized})))


# The graph layout (the op variants' inputs, graphs/ops/linear.py and gather.py): ONNX Runtime's MatMulNBits
# layout, so the ONNX lowering passes the initializers through untouched.

def minimum_dtype(minimum: np.ndarray) -> np.dtype:
    """float16 where every minimum is a float16 value (GGUF Q4_1 stores them so; the RTN int4 form rounds its
    group minima to one), else float32 (Q4_K's dmin * m): the stored minima are always exact."""
    with np.errstate(over="ignore"):
        exact = np.array_equal(minimum.astype(np.float16).astype(np.float32), minimum)
    return np.dtype(np.float16 if exact else np.float32)


def pack_minimum(w: BlockQuantized) -> np.ndarray:
    """The linear's minima as BlockMinimum reads them: transposed, [blocks, n] (one row per block, so the kernel
    reads output columns contiguously and ONNX Runtime folds no Transpose into a copy), in `minimum_dtype`."""
    if w.minimum is None:
        raise ValueError(f"{w.source}: this weight form has no minima to pack")
    return np.ascontiguousarray(w.minimum.T, minimum_dtype(w.minimum))


def minimum_rows(minimum_t: np.ndarray | None) -> np.ndarray | None:
    """Inverse of `pack_minimum`: float32 [n, blocks]."""
    return None if minimum_t is None else np.ascontiguousarray(minimum_t.T, np.float32)


def pack_codes(w: BlockQuantized) -> np.ndarray:
    """uint8 [n, blocks, block_size * bits / 8]; 4-bit codes two per byte, the even one in the low nibble."""
    n, k = w.shape
    codes = w.q.reshape(n, k // w.block_size, w.block_size)
    if w.bits == 8:
        return np.ascontiguousarray(codes)
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `pack_codes`: uint8 [n, k]."""
    n = packed.shape[0]
    if bits == 8:
        return packed.reshape(n, -1)
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)


def pack_zero_points(w: BlockQuantized) -> np.ndarray | None:
    """MatMulNBits' zero points (uint8, 4-bit ones two per byte along a row), or None where all are the default
    2**(bits-1) (Q4_0, Q8_0, the int8 RTN form)."""
    if np.all(w.zero_point == 1 << (w.bits - 1)):
        return None
    if w.bits == 8:
        return np.ascontiguousarray(w.zero_point)
    n, blocks = w.zero_point.shape
    padded = np.zeros((n, blocks + blocks % 2), np.uint8)
    padded[:, :blocks] = w.zero_point
    return np.ascontiguousarray(padded[:, 0::2] | (padded[:, 1::2] << 4))


def unpack_zero_points(packed: np.ndarray | None, bits: int, blocks: int, rows: int) -> np.ndarray:
    if packed is None:
        return np.full((rows, blocks), 1 << (bits - 1), np.uint8)
    return packed if bits == 8 else unpack_codes(packed, 4)[:, :blocks]


def from_graph(codes: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, minimum_t: np.ndarray | None,
               bits: int, block_size: int, source: str = "graph") -> BlockQuantized:
    """The weight a linear's packed inputs hold (what the read-back test and the op references decode)."""
    rows, blocks = scales.shape
    return BlockQuantized(unpack_codes(codes, bits), scales, unpack_zero_points(zero_points, bits, blocks, rows),
                          minimum_rows(minimum_t), bits, block_size, source)


def graph_parts(name: str, w: BlockQuantized | BlockForm, gathered: bool = False) -> list[str | None]:
    """Names of the op variant's weight inputs: codes, scales, zero points, minimum (None where the form has none).

    A `gathered` table (the embedding) reads its zero points unpacked (for 4 bits, `<name>.zero_point_rows`) and
    its minima as float32 rows (`<name>.minimum`); a linear reads `<name>.minimum_t` (`pack_minimum`)."""
    form = w.form if isinstance(w, BlockQuantized) else w
    zero_points = None if form.default_zero_point else f"{name}.zero_point_rows" if gathered and form.bits == 4 \
        else f"{name}.zero_points"
    minimum = None if not form.has_minimum else f"{name}.minimum" if gathered else f"{name}.minimum_t"
    return [f"{name}.codes", f"{name}.scales", zero_points, minimum]


def graph_arrays(name: str, w: BlockQuantized, gathered: bool = False) -> dict[str, np.ndarray]:
    """The graph parameters of one quantized weight, under the names `graph_parts` gives (both the linear's and,
    for a `gathered` table, the gather's)."""
    codes, scales, zero_points, _ = graph_parts(name, w, gathered)
    arrays = {codes: pack_codes(w), scales: np.ascontiguousarray(w.scale, np.float32)}
    if zero_points is not None:
        arrays[f"{name}.zero_points"] = pack_zero_points(w)  # type: ignore[assignment]
        arrays[zero_points] = np.ascontiguousarray(w.zero_point) if zero_points.endswith("_rows") \
            else arrays[f"{name}.zero_points"]
    if w.minimum is not None:
        arrays[f"{name}.minimum_t"] = pack_minimum(w)
        if gathered:
            arrays[f"{name}.minimum"] = np.ascontiguousarray(w.minimum, np.float32)
    return arrays  # type: ignore[return-value]


def int8_graph_parts(name: str) -> list[str]:
    """Names of Linear.w8a8's weight inputs: the codes in MatMulInteger's [k, n] layout and the row scales."""
    return [f"{name}.int8_t", f"{name}.scale"]


def w8a8_static_parts(name: str) -> list[str]:
    """Names of Linear.w8a8_static's weight inputs (MindIE's W8A8 tensors, graphs/ops/linear_w8a8_static.py)."""
    return [f"{name}.weight", f"{name}.input_scale", f"{name}.input_offset", f"{name}.quant_bias",
            f"{name}.deq_scale"]


def int8_graph_arrays(name: str, w: Int8PerChannel) -> dict[str, np.ndarray]:
    codes, scale = int8_graph_parts(name)
    return {codes: np.ascontiguousarray(w.q.T), scale: np.ascontiguousarray(w.scale, np.float32)}


def stacked_graph_arrays(name: str, stack: ExpertStack) -> dict[str, np.ndarray]:
    """The graph parameters of a stack of quantized experts: each part of `graph_arrays` with a leading expert
    axis."""
    parts = [graph_arrays(name, w) for w in stack.experts]
    return {part: np.ascontiguousarray(np.stack([p[part] for p in parts])) for part in parts[0]}


def unstack(arrays: Sequence[np.ndarray | None], expert: int) -> list[np.ndarray | None]:
    """One expert's slices of stacked parts (None stays None)."""
    return [None if a is None else a[expert] for a in arrays]
