"""An op declared once, and the registry every lowering fills with one body per op.

An `Op` is a row: its ATB name, typed attributes, inputs and outputs with dtypes and symbolic
shapes, and a numpy reference (the ground truth). A precision is a variant of an op (another
row with the same ATB name and its own `variant`, inputs and reference), not a new family.
A `Lowering` (ONNX, ONNX Runtime custom op, contiguous baseline, MindSpore CPU, MindSpore
Ascend, the C++ kernels) maps op keys to bodies; `missing_bodies` says which op lacks which.
Nothing here knows a target's API: the body type is each lowering's own.
"""
from __future__ import annotations

import ast
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
B = TypeVar("B")


@dataclass(frozen=True)
class Tensor:
    """One input or output: its name in every lowering, dtypes allowed, shape as symbolic dims.

    A dim is an expression over attribute names, integers and shape symbols (`T`, `B + 1`,
    `head_num * head_dim`); a bare symbol is bound by the first tensor that has it.
    """

    name: str
    shape: tuple[str, ...]
    dtypes: tuple[str, ...] = ("float32",)
    optional: bool = False
    variadic: bool = False  # the last output repeats (Split): any number of pieces, shapes unchecked


class Attributes:
    """Base of an op's attribute dataclass (frozen, typed fields); `NoAttributes` when it has none."""


@dataclass(frozen=True)
class NoAttributes(Attributes):
    pass


@dataclass(frozen=True)
class Example:
    """Inputs and attributes the op-by-lowering walk runs every body on, with its tolerance."""

    inputs: tuple[np.ndarray | None, ...]
    attrs: Mapping[str, Any]
    atol: float = 1e-5
    rtol: float = 1e-5
    label: str = ""


@dataclass(frozen=True)
class Op:
    """One op (or one variant of it), declared once in graphs/ops/<op>.py."""

    name: str  # the ATB name: node op_type in ONNX, kernel name in C++, MindSpore cell name
    atb: str  # the ATB operation it mirrors
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    reference: Callable[..., Any]  # numpy: reference(*inputs, **attrs) -> output or tuple of outputs
    attributes: type[Attributes] = NoAttributes
    examples: Callable[[], Iterator[Example]] = field(default=lambda: iter(()), compare=False)
    variant: str = ""  # "" is the base form; a precision names its variant ("int8", "w4")
    count: Callable[[Any], int] | None = field(default=None, compare=False)  # a variadic op's output count
    writes: tuple[tuple[int, int], ...] = ()  # (output, input) pairs: the output is that input updated in place
    doc: str = ""

    @property
    def key(self) -> str:
        """What a lowering registers a body under: `PagedAttention`, `PagedAttention.int8`."""
        return f"{self.name}.{self.variant}" if self.variant else self.name

    @property
    def attribute_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.attributes))

    def attrs(self, **values: Any) -> Attributes:
        """The typed attributes, or an error naming the op, the field, the value and what it takes."""
        hints = typing.get_type_hints(self.attributes)
        unknown = set(values) - set(hints)
        missing = set(hints) - set(values)
        if unknown or missing:
            raise TypeError(f"{self.key} takes attributes {sorted(hints)}; got unknown {sorted(unknown)}, "
                            f"missing {sorted(missing)}")
        typed = {}
        for name, value in values.items():
            want = typing.get_origin(hints[name]) or hints[name]
            if want is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value)
            elif want is tuple and isinstance(value, (list, tuple)):
                value = tuple(int(v) for v in value)
            elif want is int and isinstance(value, np.integer):
                value = int(value)
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise TypeError(f"{self.key}.{name} = {value!r}: expected {hints[name]}")
            typed[name] = value
        return self.attributes(**typed)

    def output_count(self, attrs: Attributes) -> int:
        return self.count(attrs) if self.count else len(self.outputs)

    def result(self, outputs: Sequence[Any]) -> Any:
        """What `emit` returns: the single output, or a tuple of all of them."""
        return outputs[0] if len(self.outputs) == 1 and not self.outputs[0].variadic else tuple(outputs)

    def arguments(self, inputs: Sequence[Any]) -> list[Any]:
        """`inputs` with omitted trailing optional inputs as None; a TypeError names what is missing or extra."""
        args = list(inputs) + [None] * (len(self.inputs) - len(inputs))
        if len(args) != len(self.inputs):
            raise TypeError(f"{self.key} takes {len(self.inputs)} inputs ({', '.join(t.name for t in self.inputs)}), "
                            f"got {len(inputs)}")
        for spec, value in zip(self.inputs, args):
            if value is None and not spec.optional:
                raise TypeError(f"{self.key}: input {spec.name} is required")
        return args

    def run_reference(self, inputs: Sequence[np.ndarray | None], attrs: Attributes) -> tuple[np.ndarray, ...]:
        """The numpy reference on copies of the inputs it writes (the caller's arrays stay as they were)."""
        written = {i for _, i in self.writes}
        args = [x.copy() if i in written and x is not None else x for i, x in enumerate(inputs)]
        out = self.reference(*args, **dataclasses.asdict(attrs))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    def check(self, inputs: Sequence[Any], outputs: Sequence[Any], attrs: Attributes) -> None:
        """Dtypes and shapes of numpy inputs and outputs against the declaration (ValueError naming the tensor)."""
        if len(inputs) != len(self.inputs):
            raise ValueError(f"{self.key} takes {len(self.inputs)} inputs ({', '.join(t.name for t in self.inputs)}), "
                             f"got {len(inputs)}")
        symbols: dict[str, int] = dict(dataclasses.asdict(attrs))
        specs = list(zip(self.inputs, inputs)) + [(t, x) for t, x in zip(self.outputs, outputs) if not t.variadic]
        for spec, array in specs:
            if array is None:
                if not spec.optional:
                    raise ValueError(f"{self.key}: {spec.name} is required")
                continue
            if np.dtype(array.dtype).name not in spec.dtypes:
                raise ValueError(f"{self.key}: {spec.name} is {array.dtype}, expected one of {spec.dtypes}")
            if len(array.shape) != len(spec.shape):
                raise ValueError(f"{self.key}: {spec.name} has shape {array.shape}, expected {spec.shape}")
            for dim, size in zip(spec.shape, array.shape):
                if dim.isidentifier() and dim not in symbols:
                    symbols[dim] = size
                elif _evaluate(dim, symbols) != size:
                    raise ValueError(f"{self.key}: {spec.name} has shape {array.shape}, expected {spec.shape} "
                                     f"with {dim} = {_evaluate(dim, symbols)}")


def _evaluate(dim: str, symbols: Mapping[str, Any]) -> int:
    """A dim expression (+, -, *, //, names, integers) over the bound symbols and attributes."""
    def walk(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            return int(symbols[node.id])
        if isinstance(node, ast.BinOp):
            a, b = walk(node.left), walk(node.right)
            ops: dict[type, Callable[[int, int], int]] = {ast.Add: int.__add__, ast.Sub: int.__sub__,
                                                          ast.Mult: int.__mul__, ast.FloorDiv: int.__floordiv__}
            return ops[type(node.op)](a, b)
        raise ValueError(f"unsupported dim expression {dim!r}")
    return walk(ast.parse(dim, mode="eval"))


class OpBuilder(Protocol[T]):
    """What a model definition is written against: graph inputs, weights, outputs, and `emit`."""

    def input(self, name: str) -> T: ...

    def weight(self, name: str) -> T: ...

    def output(self, name: str, value: T) -> None: ...

    def emit(self, op: Op, *inputs: T | None, **attrs: Any) -> Any:
        """One op: its output, or a tuple of them when the op has several."""


class Lowering(Generic[B]):
    """One target's bodies, one per op key. `fallback` names the lowering whose body runs where this has none.

    (The ONNX Runtime custom ops replace five fused ops; every other op runs its ONNX body.) A
    `partial` lowering serves others and owes no body for every op: the C++ kernels implement the
    fused ops that the custom ops and MindSpore CPU call, not Gather or Add.
    """

    def __init__(self, name: str, where: str, bodies: Mapping[Op, B] | None = None,
                 fallback: "Lowering[Any] | str | None" = None, partial: bool = False) -> None:
        self.name = name
        self.where = where  # the files holding the bodies, for docs/design.md and error messages
        self.fallback = fallback
        self.partial = partial
        self.bodies: dict[str, B] = {}
        self.unsupported: dict[str, str] = {}  # op key -> why this target cannot run it
        for op, body in (bodies or {}).items():
            self.register(op)(body)

    def __repr__(self) -> str:
        return f"Lowering({self.name!r})"

    def register(self, *ops: Op) -> Callable[[B], B]:
        """Decorator: `body` is this lowering's body for each of `ops` (one registration per op key)."""
        def add(body: B) -> B:
            for op in ops:
                if op.key in self.bodies:
                    raise ValueError(f"{self.name} already has a body for {op.key}")
                self.bodies[op.key] = body
            return body
        return add

    def refuse(self, op: Op, why: str) -> None:
        """Say on purpose that this target has no body for `op` (a variant it cannot run), and why."""
        if op.key in self.bodies:
            raise ValueError(f"{self.name} has a body for {op.key}: it cannot also refuse it")
        self.unsupported[op.key] = why

    def own(self, op: Op) -> B | None:
        return self.bodies.get(op.key)

    def body(self, op: Op) -> B:
        """This lowering's body for `op`, else its fallback's, else an error naming the files to add one to."""
        found = self.bodies.get(op.key)
        if found is not None:
            return found
        if op.key in self.unsupported:
            raise NotImplementedError(f"{self.name} cannot run {op.key}: {self.unsupported[op.key]}")
        if isinstance(self.fallback, Lowering):
            return self.fallback.body(op)
        raise NotImplementedError(f"{self.name} has no body for {op.key}: register one in {self.where} "
                                  f"(docs/design.md, 'How to add an op')")

    def emit(self, builder: Any, op: Op, inputs: Sequence[Any], attrs: Mapping[str, Any]) -> Any:
        """Check the inputs and attributes, run the body: one output, or a tuple of several."""
        return op.result(self.body(op)(builder, op.arguments(inputs), op.attrs(**attrs)))


def missing_bodies(ops: Iterable[Op], lowerings: Iterable[Lowering[Any]]) -> dict[str, list[str]]:
    """Lowering name -> the op keys it has no body for, its own or its fallback's (the registry check).

    An op a lowering `refuse`s (with its reason) is not missing: the table shows the reason.

    A fallback named by a string (the custom ops, which cannot import the exporter) is looked up among `lowerings`.
    """
    ops, lowerings = list(ops), list(lowerings)
    by_name = {lowering.name: lowering for lowering in lowerings}
    missing: dict[str, list[str]] = {}
    for lowering in lowerings:
        if lowering.partial:
            continue
        gaps = [op.key for op in ops if _provider(lowering, op, by_name) is None]
        if gaps:
            missing[lowering.name] = gaps
    return missing


def _provider(lowering: Lowering[Any], op: Op, by_name: Mapping[str, Lowering[Any]]) -> Lowering[Any] | None:
    """The lowering whose body runs `op` for `lowering`: itself, or along its fallbacks; None if none has one."""
    while lowering is not None:
        if op.key in lowering.bodies or op.key in lowering.unsupported:
            return lowering
        fallback = lowering.fallback
        lowering = by_name.get(fallback) if isinstance(fallback, str) else fallback
    return None


def body_table(ops: Iterable[Op], lowerings: Sequence[Lowering[Any]]) -> str:
    """The markdown table of docs/design.md: each op's body per lowering (its own, a fallback's, or missing)."""
    by_name = {lowering.name: lowering for lowering in lowerings}

    def cell(lowering: Lowering[Any], op: Op) -> str:
        provider = _provider(lowering, op, by_name)
        if provider is None:
            return "-" if lowering.partial else "**missing**"
        if op.key in provider.unsupported:
            return f"no: {provider.unsupported[op.key]}"
        return "own" if provider is lowering else f"{provider.name}'s"
    lines = ["| op | ATB | " + " | ".join(lw.name for lw in lowerings) + " |",
             "|---|---|" + "---|" * len(lowerings)]
    for op in ops:
        lines.append(f"| `{op.key}` | {op.atb} | " + " | ".join(cell(lw, op) for lw in lowerings) + " |")
    return "\n".join(lines)
