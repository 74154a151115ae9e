"""One-node ONNX models of the `atb` fused ops, as the exporter writes them (the op's function attached)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from exporter.onnx.functions import FUNCTIONS
from exporter.onnx.nodes import ATB_DOMAIN, OPSET

TYPES = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32,
         np.dtype(np.int64): TensorProto.INT64}


def one_node_model(op: str, inputs: dict[str, np.ndarray], outputs: list[str], check: bool = True,
                   **attrs: object) -> onnx.ModelProto:
    """`op` over `inputs` (symbolic dims) giving 2-D float `outputs`; onnx's full check unless `check` is off
    (a node missing an attribute its function body needs, as old artifacts have)."""
    infos = [helper.make_tensor_value_info(k, TYPES[v.dtype], [f"{k}_{i}" for i in range(v.ndim)])
             for k, v in inputs.items()]
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, [f"{o}_{i}" for i in range(2)]) for o in outputs]
    node = helper.make_node(op, list(inputs), outputs, domain=ATB_DOMAIN, **attrs)
    model = helper.make_model(helper.make_graph([node], op, infos, outs),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(ATB_DOMAIN, 1)],
                              functions=[FUNCTIONS[op]()], ir_version=10)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model
