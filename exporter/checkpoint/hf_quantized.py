"""HF checkpoints already quantized with GPTQ or AWQ -> `BlockQuantized`, without dequantizing: the file's own
codes, fp16 scales and zero points, re-laid for MatMulNBits (graphs/ops/linear_block_quantized.py).

Both formats hold a linear [n, k] as (code - zero) * scale with one fp16 scale and one integer zero per group of
`group_size` inputs, which is MatMulNBits' form exactly: an fp16 scale widens to float32 without rounding, and
(code - zero) * scale (an 11-bit mantissa times an integer of at most 9 bits) is exact in float32, so
`BlockQuantized.dequantize` equals the libraries' float32 dequantization bit for bit.

| format | qweight (int32) | qzeros (int32) | scales | zero |
|---|---|---|---|---|
| GPTQ v1 (`checkpoint_format` gptq) | [k * bits / 32, n], along k | [groups, n * bits / 32] | [groups, n] | stored+1 |
| GPTQ v2 (`checkpoint_format` gptq_v2) | same | same | same | stored |
| AWQ GEMM (`version` gemm) | [k, n / 8], along n, AWQ_ORDER | [groups, n / 8], AWQ_ORDER | [groups, n] | stored |

GPTQ v1 stores zero - 1 (AutoGPTQ's kernels add the 1 back). The one value where readers differ is a stored
2**bits - 1, which only the packer's zero 0 (stored as -1) writes: it is read as 0 (masked to `bits`, as
AutoGPTQ's qlinear_cuda_old torch path does; its qlinear_cuda path and GPTQModel's v1 -> v2 conversion give
2**bits). A group that does not divide k leaves a partial last group (GPTQ allows it); the blocks are then the
largest MatMulNBits size dividing both. Act-order (desc_act) checkpoints whose
`g_idx` is not k // group_size are refused: their groups are scattered over k, and ONNX Runtime 1.32's MatMulNBits
marks its `g_idx` input deprecated, so mapping them would need a permutation of every linear's input.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import math

import numpy as np

from .base import CheckpointError
from ...graphs.quant import BlockQuantized

METHODS = ("gptq", "awq")
GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ GEMM: nibble i of an int32 holds output column 8 * c + AWQ_ORDER[i]
# MatMulNBits' MLAS kernels take blocks of 16..256 (powers of two).
_BLOCK_SIZES = (256, 128, 64, 32, 16)
_REQUANTIZE = "re-quantize the model with {fix}, or export its original float weights with quantization w4a16"


@dataclass(frozen=True)
class Part:
    """One tensor of a packed linear: its shape and the safetensors dtypes it may have."""

    shape: tuple[int, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class PackedFormat:
    """A checkpoint's `quantization_config`, checked: what each linear's `qweight`/`qzeros`/`scales` (GPTQ: and
    `g_idx`) look like and how they become a `BlockQuantized`."""

    method: str  # "gptq" | "awq"
    bits: int
    group_size: int  # -1: one group over the whole input
    v1_zeros: bool  # GPTQ v1: zero points stored minus one

    @property
    def required(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    @property
    def suffixes(self) -> tuple[str, ...]:
        return (*self.required, "g_idx") if self.method == "gptq" else self.required

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def parts(self, n: int, k: int) -> dict[str, Part]:
        """The tensors a linear of [n, k] is stored as."""
        per, groups = 32 // self.bits, -(-k // self.group(k))  # a last group may be partial (GPTQ)
        scales = Part((groups, n), ("F16", "BF16", "F32"))
        if self.method == "awq":
            return {"qweight": Part((k, n // per), ("I32",)), "qzeros": Part((groups, n // per), ("I32",)),
                    "scales": scales}
        return {"qweight": Part((k // per, n), ("I32",)), "qzeros": Part((groups, n // per), ("I32",)),
                "scales": scales, "g_idx": Part((k,), ("I32", "I64"))}

    def check_dims(self, name: str, n: int, k: int) -> None:
        """Fail before reading anything when a linear's dims cannot hold this format."""
        per, group = 32 // self.bits, self.group(k)
        if n % per or k % per:
            raise CheckpointError(
                f"{name}: a linear of [{n}, {k}] cannot hold {self.method} blocks of {group} inputs at {self.bits} "
                f"bits (quantization_config.group_size = {self.group_size}); the checkpoint does not match config.json")
        _block(math.gcd(group, k))

    def check_g_idx(self, name: str, g_idx: np.ndarray | None, k: int) -> None:
        """Refuse act-order groups (read before any weight: g_idx is small)."""
        _check_g_idx(name, g_idx, k, self.group(k))

    def weight(self, name: str, arrays: Mapping[str, np.ndarray], n: int, k: int) -> BlockQuantized:
        """The linear `name` [n, k] from its stored parts, as MatMulNBits blocks."""
        maxq, group = (1 << self.bits) - 1, self.group(k)
        scale = np.ascontiguousarray(np.asarray(arrays["scales"]).astype(np.float32).T)  # [n, groups]
        if self.method == "awq":
            q = _unpack_columns(arrays["qweight"], self.bits, awq=True).T  # [k, n] -> [n, k]
            zero = _unpack_columns(arrays["qzeros"], self.bits, awq=True).T
        else:
            _check_g_idx(name, arrays.get("g_idx"), k, group)
            q = _unpack_rows(arrays["qweight"], self.bits).T
            zero = _unpack_columns(arrays["qzeros"], self.bits, awq=False).T
            if self.v1_zeros:
                zero = (zero + 1) & maxq
        # A group wider than MatMulNBits' blocks, or one not dividing k (GPTQ's last group is then partial): blocks
        # of the largest size dividing both, each with its group's scale and zero.
        block = _block(math.gcd(group, k))
        groups = np.arange(k // block) * block // group
        return BlockQuantized(np.ascontiguousarray(q, np.uint8), np.ascontiguousarray(scale[:, groups]),
                              np.ascontiguousarray(zero[:, groups], np.uint8), None, self.bits, block,
                              f"{self.method}-int{self.bits}-g{self.group_size}")


def packed_format(config: Mapping[str, Any], where: str) -> PackedFormat:
    """`quantization_config` (from `where`) checked against what maps onto MatMulNBits; the error names the field,
    its value and the fix."""
    method = str(config.get("quant_method", "")).lower()
    if method not in METHODS:
        raise CheckpointError(
            f"{where}: quantization_config.quant_method = {config.get('quant_method')!r} is not read here (read as "
            f"their own blocks: {', '.join(METHODS)}); use the model's original float16/bfloat16/float32 weights "
            "(any quantization: w8a16, w4a16, w8a8 at export) or its GPTQ/AWQ version")
    bits = config.get("bits", config.get("w_bit"))
    supported = (4, 8) if method == "gptq" else (4,)
    if bits not in supported:
        raise CheckpointError(
            f"{where}: quantization_config.bits = {bits!r}: {method} maps onto MatMulNBits at "
            f"{' or '.join(map(str, supported))} bits only (ONNX Runtime's CPU kernels); "
            + _REQUANTIZE.format(fix=f"bits {supported[0]}"))
    group_size = config.get("group_size", config.get("q_group_size", 128))
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size != -1 and group_size < 16) \
            or (group_size > 0 and group_size % 16):
        raise CheckpointError(
            f"{where}: quantization_config.group_size = {group_size!r}: MatMulNBits takes blocks of 16, 32, 64, 128 "
            "or 256 inputs, so a group must be -1 (whole rows) or a multiple of 16; "
            + _REQUANTIZE.format(fix="group_size 32, 64 or 128"))
    if method == "awq":
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise CheckpointError(
                f"{where}: quantization_config.version = {config.get('version')!r}: only AWQ's GEMM layout is read "
                "(GEMV, Marlin, ExLlama and IPEX layouts pack the codes for their own kernels); convert the model to "
                "version gemm (AutoAWQ: quantize with version='GEMM')")
        if config.get("zero_point") is False:
            raise CheckpointError(
                f"{where}: quantization_config.zero_point = false: AWQ's GEMM layout is read with its zero points; "
                + _REQUANTIZE.format(fix="zero_point true"))
        return PackedFormat("awq", 4, group_size, v1_zeros=False)
    layout = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
    if layout not in GPTQ_FORMATS or config.get("is_marlin_format"):
        field, value = ("is_marlin_format", True) if config.get("is_marlin_format") else \
            ("checkpoint_format", config.get("checkpoint_format", config.get("format")))
        raise CheckpointError(
            f"{where}: quantization_config.{field} = {value!r}: only GPTQ's own layouts ({', '.join(GPTQ_FORMATS)}) "
            "are read (Marlin, BitBLAS, ExLlama and IPEX layouts pack the codes for their own kernels); save the "
            "model in format gptq (GPTQModel: save with format='gptq')")
    if config.get("dynamic"):
        raise CheckpointError(
            f"{where}: quantization_config.dynamic = {config['dynamic']!r}: per-module overrides of bits or "
            "group_size are not read (one form per checkpoint); " + _REQUANTIZE.format(fix="no dynamic overrides"))
    return PackedFormat("gptq", int(bits), group_size, v1_zeros=layout == "gptq")


def _block(width: int) -> int:
    """The largest MatMulNBits block dividing `width` (the gcd of the group and the linear's input width)."""
    for size in _BLOCK_SIZES:
        if width % size == 0:
            return size
    raise CheckpointError(f"groups of inputs whose boundaries fall every {width} inputs do not split into MatMulNBits "
                          "blocks of 16..256; " + _REQUANTIZE.format(fix="group_size 32, 64 or 128"))


def _unpack_rows(packed: np.ndarray, bits: int) -> np.ndarray:
    """GPTQ qweight int32 [k * bits / 32, n] -> codes [k, n]: code i of a word in bits [bits * i, bits * (i + 1))."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = (words[:, None, :] >> shifts[None, :, None]) & np.uint32((1 << bits) - 1)
    return codes.reshape(-1, words.shape[1]).astype(np.uint8)


def _unpack_columns(packed: np.ndarray, bits: int, awq: bool) -> np.ndarray:
    """int32 [rows, n * bits / 32] packed along n -> [rows, n]; AWQ's nibbles are in AWQ_ORDER."""
    words = np.ascontiguousarray(packed).view(np.uint32)
    shifts = np.arange(0, 32, bits, dtype=np.uint32)
    codes = ((words[:, :, None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)
    if awq:
        codes[:, :, list(AWQ_ORDER)] = codes.copy()
    return codes.reshape(words.shape[0], -1)


def _check_g_idx(name: str, g_idx: np.ndarray | None, k: int, group: int) -> None:
    if g_idx is None or np.array_equal(np.asarray(g_idx), np.arange(k) // group):
        return
    raise CheckpointError(
        f"{name}.g_idx: act-order groups (quantization_config.desc_act = true) scatter each group over the inputs, "
        "and MatMulNBits holds only contiguous blocks (ONNX Runtime 1.32 marks its g_idx input deprecated); "
        + _REQUANTIZE.format(fix="desc_act false (or static_groups true, which keeps g_idx contiguous)"))
