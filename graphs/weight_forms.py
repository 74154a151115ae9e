"""Each graph weight's form, so a model definition emits the op variant that reads it (Linear, Linear.bfloat16,
Linear.block_quantized, Linear.w8a8, Linear.w8a8_static; Gather and GroupedMatmul likewise)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, TypeVar

from . import ops, quant
from .ops.grouped_matmul import GROUP_COUNT
from .ops.linear_bf16 import BFLOAT16
from .ops.op import OpBuilder
from .quant import BlockForm, DenseForm, Int8Form, Weight, WeightForm

T = TypeVar("T")


@dataclass(frozen=True)
class WeightForms:
    """Each graph weight's form (graphs/quant.py: dense, block-quantized, int8 per channel), so a model's `build`
    emits its op variants; a weight absent from `forms` is float32. `forms` may convert a weight when first asked
    for it (the streaming export's): nothing here needs the data."""

    forms: Mapping[str, WeightForm] = field(default_factory=dict)
    accuracy_level: int = 0  # MatMulNBits' compute for the quantized linears (export.accuracy_level)
    # Ascend: Linear.w8a8 weights with calibrated static input (scale, offset) -> Linear.w8a8_static (MindIE)
    w8a8_static: Mapping[str, tuple[float, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, weights: Mapping[str, Weight], accuracy_level: int = 0,
           w8a8_static: Mapping[str, tuple[float, int]] | None = None) -> "WeightForms":
        return cls({k: quant.form_of(w) for k, w in weights.items()}, accuracy_level, dict(w8a8_static or {}))

    def linear(self, b: OpBuilder[T], x: T, name: str, bias: T | None = None) -> T:
        form = self.forms.get(name)
        if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
            y = b.emit(ops.LINEAR_BF16, x, b.weight(name), K=form.shape[1], N=form.shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        if isinstance(form, Int8Form) and name in self.w8a8_static:
            y = b.emit(ops.LINEAR_W8A8_STATIC, x, *(b.weight(p) for p in quant.w8a8_static_parts(name)),
                       K=form.shape[1], N=form.shape[0])
            return y if bias is None else b.emit(ops.ADD, y, bias)
        if isinstance(form, Int8Form):
            codes, scale = quant.int8_graph_parts(name)
            return b.emit(ops.LINEAR_W8A8, x, b.weight(codes), b.weight(scale), bias, K=form.shape[1],
                          N=form.shape[0])
        if not isinstance(form, BlockForm):
            return b.emit(ops.LINEAR, x, b.weight(name), bias)
        return b.emit(ops.LINEAR_BLOCK_QUANTIZED, x, *self._parts(b, name, form), bias, K=form.shape[1],
                      N=form.shape[0], bits=form.bits, block_size=form.block_size, accuracy_level=self.accuracy_level)

    def grouped_linear(self, b: OpBuilder[T], x: T, name: str, group_list: T) -> T:
        """GroupedMatmul over a stack of experts (graphs/moe.py) in the variant of its form: float32, bfloat16 or
        block-quantized (whose form is one expert's [N, K]; its compute follows `accuracy_level`, as the linears'
        does: 4 multiplies int8 inputs, 0 float32 ones)."""
        form = self.forms.get(name)
        if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
            return b.emit(ops.GROUPED_MATMUL_BF16, x, b.weight(name), group_list, group_list_type=GROUP_COUNT)
        if isinstance(form, BlockForm):
            return b.emit(ops.GROUPED_MATMUL_BLOCK_QUANTIZED, x, *self._parts(b, name, form), group_list,
                          K=form.shape[1], N=form.shape[0], bits=form.bits, block_size=form.block_size,
                          accuracy_level=self.accuracy_level, group_list_type=GROUP_COUNT)
        return b.emit(ops.GROUPED_MATMUL, x, b.weight(name), group_list, group_list_type=GROUP_COUNT)

    def gather(self, b: OpBuilder[T], name: str, indices: T) -> T:
        form = self.forms.get(name)
        if isinstance(form, DenseForm) and form.dtype == BFLOAT16.name:
            return b.emit(ops.GATHER_BF16, b.weight(name), indices)
        if not isinstance(form, BlockForm):
            return b.emit(ops.GATHER, b.weight(name), indices)
        codes, scales, zero_points, minimum = self._parts(b, name, form, gathered=True)
        return b.emit(ops.GATHER_BLOCK_QUANTIZED, codes, scales, zero_points, minimum, indices, K=form.shape[1],
                      bits=form.bits, block_size=form.block_size)

    @staticmethod
    def _parts(b: OpBuilder[T], name: str, form: BlockForm, gathered: bool = False) -> list[T | None]:
        return [None if part is None else b.weight(part) for part in quant.graph_parts(name, form, gathered)]
