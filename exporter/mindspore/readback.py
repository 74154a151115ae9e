"""Read an exported MINDIR back (mindspore/train/mind_ir_pb2): which primitives, with which attributes, and
which arguments and data the graph holds.

MindSpore stores a primitive's constructor arguments (PagedAttention's head_num, scale_value,
kv_head_num) as constant inputs after its tensor inputs, not as attributes; they are named here
from the primitive's own signature, so a record reads like the call that built it. Every tensor
argument's dtype comes from the graph input or parameter it reads, or from the shape attribute
MindSpore stores on the node computing it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


_PLUMBING = {"Load", "UpdateState", "Depend", "MakeTuple", "TupleGetItem"}  # ordering and tuples, not ops
_EFFECT_TOKENS = {"<UpdateState>", "<UMONAD>", "<IOMONAD>"}  # side-effect ordering inputs, not data


@dataclass(frozen=True)
class OpRecord:
    op_type: str
    attributes: dict[str, Any]  # primitive attributes (side_effect_mem, Custom's atb_op, ...)
    arguments: dict[str, Any]  # input name -> constant, graph input/parameter read, or `<Op>` computing it
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # input name -> shape, for graph inputs
    dtypes: dict[str, str] = field(default_factory=dict)  # tensor input name -> dtype ("float16", "int8", ...)
    output_dtype: str | None = None  # the node's (first) output dtype


@dataclass(frozen=True)
class Argument:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class GraphRecord:
    """What a loaded GraphCell would own: its arguments are bound by the caller (one copy for every graph
    that takes them), its Parameters are private to it, `data_bytes` is all the tensor data the file
    holds itself (Parameters, constants), and `activation_bytes` what one run keeps live at its peak."""

    arguments: list[Argument]  # graph inputs, in call order
    parameters: list[str]
    data_bytes: int
    activation_bytes: int


def read_graph(path: Path) -> GraphRecord:
    from mindspore.train.mind_ir_pb2 import ModelProto

    model = ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    graph = model.graph
    arguments = [Argument(i.name.split(":")[-1], tuple(i.tensor[0].dims), _dtype(i.tensor[0].data_type))
                 for i in graph.input]
    tensors = [*graph.parameter, *(t for n in graph.node for a in n.attribute for t in a.tensors)]
    return GraphRecord(arguments, [p.name.split(":")[-1] for p in graph.parameter],
                       sum(len(t.raw_data) for t in tensors), _activation_peak(graph))


# Outputs that share their first input's memory: views (MindSpore runs Reshape and its kin as no-task nodes whose
# output has the input's address) and effect/tuple plumbing.
_ALIASES = {"Reshape", "ExpandDims", "Squeeze", "Flatten", "Depend", "Load", "TupleGetItem"}


def _activation_peak(graph: Any) -> int:
    """The most bytes of intermediate tensors live at once when the nodes run in graph order and each tensor
    is freed after its last reader: what MindSpore's default dynamic memory reuse (reference counting) holds,
    before fragmentation and the kernels' own workspaces. Graph inputs and Parameters belong to the caller and
    are not counted; each element of a tuple output (AddRmsNorm's y, rstd, sum) is its own tensor, counted if
    read."""
    from ...artifact.mindir import numpy_dtype

    nodes = [n for n in graph.node if n.op_type.startswith("REF::")]
    position = {n.output[0]: i for i, n in enumerate(nodes)}
    base: dict[str, str | None] = {}  # a value -> the tensor it lives in (None: the caller's memory)
    size: dict[str, int] = {}
    born: dict[str, int] = {}
    last_read: dict[str, int] = {}
    for i, node in enumerate(nodes):
        op_type = node.op_type[len("REF::"):].split(":")[0]
        nbytes = sum(int(np.prod(t.dims)) * numpy_dtype(_dtype(t.data_type)).itemsize
                     for a in node.attribute if a.name == "shape" for t in a.tensors)
        for source in node.input:
            if base.get(source) is not None:
                last_read[base[source]] = i
        out, first = node.output[0], node.input[0] if node.input else None
        if op_type == "TupleGetItem" and first in position and base[first] == first and not size[first]:
            element = f"{first}[{node.input[1]}]"  # an element of a tuple output, born with its producer
            size.setdefault(element, nbytes)
            born.setdefault(element, position[first])
            base[out] = element
        elif op_type in _ALIASES:
            base[out] = base.get(first)  # a view, or plumbing: the same memory
        else:
            base[out], size[out], born[out] = out, nbytes, i
    frees: dict[int, list[str]] = {}
    for tensor, i in last_read.items():
        frees.setdefault(i, []).append(tensor)
    for tensor, i in born.items():
        if tensor not in last_read:  # never read
            frees.setdefault(i, []).append(tensor)
    births: dict[int, list[str]] = {}
    for tensor, i in born.items():
        births.setdefault(i, []).append(tensor)
    live = peak = 0
    for i in range(len(nodes)):
        live += sum(size[t] for t in births.get(i, ()))
        peak = max(peak, live)
        live -= sum(size[t] for t in frees.get(i, ()))
    return peak


def _dtype(data_type: int) -> str:
    """TensorProto's element type as numpy names it (FLOAT -> float32, BFLOAT16 -> bfloat16)."""
    from mindspore.train.mind_ir_pb2 import TensorProto

    name = TensorProto.DataType.Name(data_type).lower()
    return {"float": "float32", "double": "float64"}.get(name, name)


def _node_dtype(node: Any) -> str | None:
    """A node's output dtype from its `shape` attribute (a tuple output: its first element)."""
    for attribute in node.attribute:
        if attribute.name == "shape" and attribute.tensors:
            return _dtype(attribute.tensors[0].data_type)
    return None


def _value(attribute: Any) -> Any:
    kind = type(attribute).AttributeType.Name(attribute.type)
    return {"INT64": attribute.i, "INT32": attribute.i, "FLOAT": attribute.f, "BOOL": bool(attribute.i),
            "STRING": attribute.s.decode(), "NONE": None}.get(kind, f"<{kind}>")


def _input_names(op_type: str, count: int) -> list[str]:
    """Call arguments then constructor arguments, as MindSpore orders a primitive's inputs."""
    from mindspore.ops import auto_generate as prims

    primitive = getattr(prims, op_type, None)
    names: list[str] = []
    if primitive is not None:
        for method in (primitive.__call__, primitive.__init__):
            names += [p for p in inspect.signature(method).parameters if p != "self"]
    return (names + [f"input{i}" for i in range(len(names), count)])[:count]


def read_ops(path: Path, op_types: set[str] | None = None) -> list[OpRecord]:
    """Every primitive node (of `op_types`, if given) in graph order."""
    from mindspore.train.mind_ir_pb2 import ModelProto

    model = ModelProto()
    model.ParseFromString(Path(path).read_bytes())
    graph = model.graph
    short = lambda name: name.split(":")[-1]  # noqa: E731 - graph-qualified names -> plain
    constants = {n.output[0]: _value(n.attribute[0]) for n in graph.node if n.op_type == "Constant"}
    shapes = {short(i.name): tuple(i.tensor[0].dims) for i in graph.input}
    shapes.update({short(p.name): tuple(p.dims) for p in graph.parameter})
    dtypes = {short(i.name): _dtype(i.tensor[0].data_type) for i in graph.input}
    dtypes.update({short(p.name): _dtype(p.data_type) for p in graph.parameter})
    attributes = {p.name: {a.name: _value(a) for a in p.attribute} for p in model.primitives}
    producers = {out: node for node in graph.node for out in node.output}

    def resolve(name: str) -> tuple[str, Any]:
        """`name` seen through Depend/Load (effect ordering): (the graph input or parameter, None), or
        (`<ProducingOp>`, the node computing it)."""
        node = producers.get(name)
        if node is None or not node.op_type.startswith("REF::"):
            return short(name), None
        op_type = node.op_type[len("REF::"):].split(":")[0]
        return resolve(node.input[0]) if op_type in ("Depend", "Load") else (f"<{op_type}>", node)

    records = []
    for node in graph.node:
        if not node.op_type.startswith("REF::"):
            continue
        primitive = node.op_type[len("REF::"):]
        op_type = primitive.split(":")[0]
        if op_type in _PLUMBING or (op_types is not None and op_type not in op_types):
            continue
        arguments: dict[str, Any] = {}
        input_shapes, input_dtypes = {}, {}
        for name, source in zip(_input_names(op_type, len(node.input)), node.input):
            value, node_in = (constants[source], None) if source in constants else resolve(source)
            if value in _EFFECT_TOKENS:
                continue
            arguments[name] = value
            if value in shapes:
                input_shapes[name] = shapes[value]
            dtype = None if source in constants else dtypes.get(value) if node_in is None else _node_dtype(node_in)
            if dtype is not None:
                input_dtypes[name] = dtype
        records.append(OpRecord(op_type, attributes.get(primitive, {}), arguments, input_shapes, input_dtypes,
                                _node_dtype(node)))
    return records
