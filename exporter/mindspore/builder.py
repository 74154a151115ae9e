"""MindSporeBuilder: records graphs/llama.py's `build()` as straight-line MindSpore graph code.

GRAPH_MODE compiles a Cell by parsing the Python source of its `construct`, so the one model
definition cannot be called from inside a graph. Instead the builder records every op as a
line `vN = self.ops.<op>(...)` against a target's op set (cpu_ops / ascend_ops) and renders a
Cell whose construct is those lines: plain code MindSpore parses reliably. The source depends
only on the model, not on the gear; each gear is the same Cell compiled with other shapes.
"""
from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from graphs import contract as c
from graphs.builder import OpBuilder


@dataclass(frozen=True)
class Var:
    """A value of the recorded graph: a local variable, a construct argument or a weight attribute."""

    code: str


def weight_attribute(name: str) -> str:
    """A weight's Python identifier: `layers.3.qkv` -> `w_layers_3_qkv`."""
    return "w_" + re.sub(r"\W", "_", name)


class MindSporeBuilder(OpBuilder[Var]):
    """Records one bucket graph. Weights are construct arguments (`weights_as_inputs`) or Cell Parameters."""

    def __init__(self, op_set: Any, weights_as_inputs: bool) -> None:
        self.op_set = op_set
        self.weights_as_inputs = weights_as_inputs
        self.inputs: list[str] = []  # contract inputs and pools, in the order the graph is called with
        self.weights: list[str] = []
        self.lines: list[str] = []
        self.logits: Var | None = None
        self._attention: tuple[Any, ...] | None = None

    def _call(self, op: str, *args: Any, outputs: int = 1) -> Any:
        names = [Var(f"v{len(self.lines)}_{i}") for i in range(outputs)]
        rendered = ", ".join(a.code if isinstance(a, Var) else repr(a) for a in args)
        self.lines.append(f"{', '.join(v.code for v in names)}{',' if outputs > 1 else ''} = self.ops.{op}({rendered})")
        return names[0] if outputs == 1 else names

    def input(self, name: str) -> Var:
        if name not in self.inputs:
            self.inputs.append(name)
        return Var(name)

    def weight(self, name: str) -> Var:
        if name not in self.weights:
            self.weights.append(name)
        return Var(weight_attribute(name) if self.weights_as_inputs else "self." + weight_attribute(name))

    def output(self, name: str, value: Var) -> None:
        # Pools are written in place by ReshapeAndCache (side effect), so only the logits leave the graph.
        if name == c.LOGITS:
            self.logits = self._call("logits", value)

    def gather(self, table: Var, indices: Var) -> Var:
        return self._call("gather", table, indices)

    def add(self, a: Var, b: Var) -> Var:
        return self._call("add", a, b)

    def split(self, x: Var, sizes: Sequence[int]) -> list[Var]:
        return self._call("split", x, tuple(sizes), outputs=len(sizes))

    def linear(self, x: Var, weight: Var, bias: Var | None = None) -> Var:
        return self._call("linear", x, weight, bias)

    def rms_norm(self, x: Var, weight: Var, epsilon: float) -> Var:
        return self._call("rms_norm", x, weight, float(epsilon))

    def rope(self, query: Var, key: Var, cos: Var, sin: Var, head_dim: int) -> tuple[Var, Var]:
        q, k = self._call("rope", query, key, cos, sin, head_dim, outputs=2)
        return q, k

    def swiglu(self, x: Var) -> Var:
        return self._call("swiglu", x)

    def reshape_and_cache(self, key: Var, value: Var, k_cache: Var, v_cache: Var, slot_mapping: Var) -> tuple[Var, Var]:
        k, v = self._call("reshape_and_cache", key, value, k_cache, v_cache, slot_mapping, outputs=2)
        return k, v

    def _prepare_attention(self, head_num: int, kv_head_num: int, qk_scale: float, block_size: int) -> None:
        """The op set holds one attention configuration: a second, different one is a model bug."""
        attrs = (head_num, kv_head_num, float(qk_scale), block_size)
        if self._attention is None:
            self.op_set.prepare_attention(*attrs)
            self._attention = attrs
        elif self._attention != attrs:
            raise ValueError(f"attention attributes changed within one graph: {self._attention} then {attrs}")

    def paged_attention(self, query: Var, k_cache: Var, v_cache: Var, block_tables: Var, context_lens: Var,
                        cu_seqlens_q: Var | None, *, head_num: int, kv_head_num: int, qk_scale: float,
                        block_size: int) -> Var:
        if cu_seqlens_q is None:
            raise ValueError("the MindSpore PagedAttention always takes cu_seqlens_q (decode: one query per sequence)")
        self._prepare_attention(head_num, kv_head_num, qk_scale, block_size)
        return self._call("paged_attention", query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q)

    def self_attention(self, query: Var, key: Var, value: Var, cu_seqlens_q: Var, *, head_num: int,
                       kv_head_num: int, qk_scale: float) -> Var:
        block_size = self._attention[3] if self._attention else 0
        self._prepare_attention(head_num, kv_head_num, qk_scale, block_size)
        return self._call("self_attention", query, key, value, cu_seqlens_q)

    def source(self) -> str:
        if self.logits is None:
            raise ValueError(f"the recorded graph has no {c.LOGITS!r} output")
        arguments = self.inputs + ([weight_attribute(w) for w in self.weights] if self.weights_as_inputs else [])
        body = "\n".join(f"        {line}" for line in self.lines)
        return (f'"""Generated by pagedgraph from graphs/llama.py; one bucket graph."""\n'
                f"from mindspore import nn\n\n\n"
                f"class BucketGraph(nn.Cell):\n"
                f"    def __init__(self, op_set):\n"
                f"        super().__init__()\n"
                f"        self.ops = op_set\n\n"
                f"    def construct(self, {', '.join(arguments)}):\n"
                f"{body}\n"
                f"        return {self.logits.code}\n")


def load_cell_class(source: str, path: Path) -> type:
    """Write `source` to `path` (GRAPH_MODE reads a construct's source file) and import its BucketGraph."""
    path.write_text(source)
    name = f"pagedgraph_bucket_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # the graph parser re-imports the module by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.BucketGraph
