"""A tiny node emitter shared by the graph body and the atb function bodies."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from onnx import AttributeProto, NodeProto, TensorProto, helper, numpy_helper

OPSET = 17


class Nodes:
    """Appends nodes with unique output names; constants become Constant nodes."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.nodes: list[NodeProto] = []
        self._count = 0

    def fresh(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}{hint}_{self._count}"

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs: Any) -> Any:
        names = [self.fresh(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, name=names[0], domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value: Any, dtype: Any = np.int64) -> str:
        array = np.asarray(value, dtype=dtype)
        name = self.fresh("const")
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(array, name)))
        return name

    def attr_const(self, attr: str, kind: str) -> str:
        """A Constant whose value is the enclosing function's attribute `attr` (kind: int|float|ints)."""
        types = {"int": AttributeProto.INT, "float": AttributeProto.FLOAT, "ints": AttributeProto.INTS}
        ref = AttributeProto(name=f"value_{kind}", ref_attr_name=attr, type=types[kind])
        name = self.fresh(attr)
        node = helper.make_node("Constant", [], [name], name=name)
        node.attribute.append(ref)
        self.nodes.append(node)
        return name

    def rename(self, old: str, new: str) -> None:
        for node in self.nodes:
            for names in (node.input, node.output):
                for i, name in enumerate(names):
                    if name == old:
                        names[i] = new

    def shape_dim(self, x: str, axis: int) -> str:
        """Dimension `axis` of x as a 1-D int64 tensor of length 1."""
        return self.op("Shape", x, start=axis, end=axis + 1)

    def cast(self, x: str, to: int = TensorProto.INT64) -> str:
        return self.op("Cast", x, to=to)

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        return self.op("Unsqueeze", x, self.const(list(axes)))
