"""The ops pagedgraph's ONNX Runtime custom-op library (ort_ops.cc) runs as one C++ kernel each.

ONNX Runtime prefers a registered kernel to the model-local function of the same `atb` name, so
registering the library (runtime/executor_ort.py) is a pure speed-up: every other op runs its ONNX
body. Each entry names the C++ struct that implements the op; the op-by-lowering walk runs the
library on the op's examples and checks from ORT's profile that the kernel, not the body, ran.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from ..graphs import ops
from ..graphs.ops.op import Lowering, Op
from .build import ort_library_path


@dataclass(frozen=True)
class CustomKernel:
    """An `atb` custom op of the library: `struct <name>` in ort_ops.cc, registered under the op's name (or `node`,
    the name of the node the ONNX lowering emits for it where that differs)."""

    op: Op
    source: str = "cpu_kernels/ort_ops.cc"
    onednn: bool = False  # built only where oneDNN is installed (cpu_kernels/build.py: onednn_missing)
    node: str = ""

    @property
    def node_name(self) -> str:
        return self.node or self.op.name


ORT_CUSTOM_OPS: Lowering[CustomKernel] = Lowering(
    "onnxruntime-custom", "cpu_kernels/ort_ops.cc (declared in cpu_kernels/ort_ops.py)",
    # One ReshapeAndCache and one PagedAttention struct serve every cache dtype (the pools' element type is
    # read per call; int8's parameters are the trailing optional inputs).
    {op: CustomKernel(op) for op in (*(op for pair in ops.KV_CACHE_OPS.values() for op in pair), ops.SELF_ATTENTION,
                                     ops.ROPE, ops.SWIGLU, ops.BLOCK_MINIMUM,
                                     ops.DYNAMIC_QUANT)},
    fallback="onnx")
ORT_CUSTOM_OPS.register(ops.LINEAR_BF16)(CustomKernel(ops.LINEAR_BF16, "cpu_kernels/onednn_linear.cc", onednn=True))
ORT_CUSTOM_OPS.register(ops.GROUPED_MATMUL_BLOCK_QUANTIZED)(
    CustomKernel(ops.GROUPED_MATMUL_BLOCK_QUANTIZED, "cpu_kernels/grouped_matmul.cc", node="GroupedMatmulNBits"))
for _op in (ops.GROUPED_MATMUL, ops.GROUPED_MATMUL_BF16):  # one struct: the weight's dtype is read per call
    ORT_CUSTOM_OPS.register(_op)(CustomKernel(_op, "cpu_kernels/grouped_matmul.cc"))


def bf16_linear_supported() -> bool:
    """Whether the custom-op library registers Linear.bfloat16 here: built with oneDNN, on a CPU where oneDNN has a
    bfloat16 matmul (AVX-512 BF16 or AMX; not AVX2). Elsewhere ORT runs the op's float32 function body, with its
    weights widened to float32 once (twice the bfloat16 weights in memory)."""
    library = ctypes.CDLL(str(ort_library_path()))
    library.PgBf16LinearSupported.restype = ctypes.c_bool
    return bool(library.PgBf16LinearSupported())
