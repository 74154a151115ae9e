"""The naive baseline: the same model definition lowered to a classic contiguous, max-length KV cache.

This is what a paged, packed engine is measured against (`pagedgraph bench --baseline naive`):
static batches of B requests, each padded to the batch's S = T / B tokens, every request
owning a whole [kv_heads, max_len, head_dim] cache row per layer (HF's static-cache layout),
attention masked over the full max_len. Same ONNX ops and kernels as the paged graph; only
the cache layout and the attention's extent differ.

Naive graph contract (`graphs/naive.onnx`, weights shared with the paged graph's weights.bin):
  input_ids, positions, slot_mapping  int64 [B*S]   row b's tokens at b*S..b*S+S-1; slot = b*max_len + position
  context_lens                        int32 [B]     tokens in row b's cache after this step's write
  logits_indices                      int64 [B]     packed row of each request's last real token
  k_cache_<l>, v_cache_<l>            float [B, kv_heads, max_len, head_dim], outputs alias inputs
Query s of row b sees cache positions 0 .. context_lens[b] - S + s (right padding, causal).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper

from .attention import NEG_INF
from .graph_builder import OnnxBuilder
from .lowering import ONNX
from .kv_cache import from_cache, to_cache
from .nodes import Nodes
from ...graphs import contract as c
from ...graphs import models, ops
from ...graphs.family import GraphOptions
from ...graphs.config import ModelConfig
from ...graphs.kv_cache import CacheFormat, cache_format
from ...graphs.ops.op import Attributes, Lowering, Op


class ContiguousBuilder(OnnxBuilder):
    """OnnxBuilder whose cache write and attention (the CONTIGUOUS bodies) use a [B, KV, max_len, D] cache per layer.

    `external` maps weight names to initializers that reference the paged graph's weight file,
    so the baseline stores no weights of its own.
    """

    def __init__(self, config: ModelConfig, external: dict[str, onnx.TensorProto], kv_cache_dtype: str = "float32") -> None:
        super().__init__(config, external.__getitem__, kv_cache_dtype)
        self._shared: dict[str, str] = {}  # per-step tensors every layer reuses (indices, mask)
        self._pool_dims = ["B", config.num_kv_heads, "max_len", config.head_dim]

    def input(self, name: str) -> str:
        if name in c.INPUT_DTYPES:
            return super().input(name)
        self.inputs.setdefault(name, helper.make_tensor_value_info(name, self.cache_type, self._pool_dims))
        return name

    def output(self, name: str, value: str) -> None:
        super().output(name, value)
        if name != c.LOGITS:
            self.outputs[-1] = helper.make_tensor_value_info(name, self.cache_type, self._pool_dims)

    def emit(self, op: Op, *inputs: str | None, **attrs: Any) -> Any:
        return CONTIGUOUS.emit(self, op, inputs, attrs)

    def _once(self, key: str, make: Callable[[Nodes], str]) -> str:
        if key not in self._shared:
            self._shared[key] = make(self.n)
        return self._shared[key]

    def scatter_indices(self, slot_mapping: str, pool: str) -> str:
        """[T, KV, 3] = (row, kv head, position) of every token's K/V."""
        def make(n: Nodes) -> str:
            max_len, kv = n.shape_dim(pool, 2), self.config.num_kv_heads
            shape = n.op("Concat", n.shape_dim(slot_mapping, 0), n.const([kv, 1]), axis=0)
            per_token = lambda x: n.op("Expand", n.op("Reshape", x, n.const([-1, 1, 1])), shape)  # noqa: E731
            heads = n.op("Expand", n.const(np.arange(kv).reshape(1, kv, 1)), shape)
            return n.op("Concat", per_token(n.op("Div", slot_mapping, max_len)), heads,
                        per_token(n.op("Mod", slot_mapping, max_len)), axis=-1)
        return self._once("indices", make)

    def mask(self, context_lens: str, pool: str, group: int) -> str:
        """[B, 1, S*G, max_len]: query s (repeated for the G heads of a kv head) sees positions <= first + s."""
        def make(n: Nodes) -> str:
            seqs = n.shape_dim(context_lens, 0)
            per_row = n.op("Div", n.shape_dim(c.INPUT_IDS, 0), seqs)
            s_range = n.op("Range", n.const(0), n.op("Squeeze", per_row), n.const(1))
            first = n.op("Sub", n.cast(context_lens), per_row)
            limit = n.op("Add", n.unsqueeze(first, [1]), n.unsqueeze(s_range, [0]))  # [B, S]
            positions = n.op("Range", n.const(0), n.op("Squeeze", n.shape_dim(pool, 2)), n.const(1))
            visible = n.op("LessOrEqual", n.unsqueeze(positions, [0, 1]), n.unsqueeze(limit, [2]))  # [B, S, L]
            visible = n.op("Expand", n.unsqueeze(visible, [2]), n.const([1, 1, group, 1]))
            return n.op("Reshape", visible, n.op("Concat", seqs, n.const([1, -1]), n.shape_dim(pool, 2), axis=0))
        return self._once("mask", make)

    def model(self, name: str) -> onnx.ModelProto:
        model = super().model(name)
        graph = model.graph
        used = {i for node in graph.node for i in node.input}
        unused = [i for i in graph.input if i.name not in used]  # block_tables, cu_seqlens_q: no blocks here
        for info in unused:
            graph.input.remove(info)
        return model


ContiguousBody = Callable[["ContiguousBuilder", Sequence[str], Any], list[str]]


def _reshape_and_cache_for(kv_cache_dtype: str) -> ContiguousBody:
    fmt = cache_format(kv_cache_dtype)

    def body(b: ContiguousBuilder, inputs: Sequence[str], attrs: Attributes) -> list[str]:
        # The pool input feeds ScatterND directly and ScatterND's output is the graph output: in place.
        key, value, k_cache, v_cache, slot_mapping, *params = inputs
        k_inv, k_off, v_inv, v_off = params or (None,) * 4
        index = b.scatter_indices(slot_mapping, k_cache)
        rows = b.n.const([0, b.config.num_kv_heads, b.config.head_dim])
        key, value = to_cache(b.n, fmt, key, k_inv, k_off), to_cache(b.n, fmt, value, v_inv, v_off)
        return [b.n.op("ScatterND", k_cache, index, b.n.op("Reshape", key, rows)),
                b.n.op("ScatterND", v_cache, index, b.n.op("Reshape", value, rows))]
    return body


def _read(b: ContiguousBuilder, fmt: CacheFormat, pool: str, scale: str | None, offset: str | None) -> str:
    """A whole [B, KV, max_len, D] cache as float32 (int8: per-channel parameters viewed as [1, KV, 1, D])."""
    n = b.n
    if scale is None or offset is None:
        return from_cache(n, fmt, pool)
    per_channel = n.const([1, b.config.num_kv_heads, 1, b.config.head_dim])
    offset = n.op("Reshape", n.op("Cast", offset, to=TensorProto.FLOAT), per_channel)
    return from_cache(n, fmt, pool, n.op("Reshape", scale, per_channel), offset)


def _paged_attention_for(kv_cache_dtype: str) -> ContiguousBody:
    fmt = cache_format(kv_cache_dtype)
    return lambda b, inputs, attrs: _paged_attention(b, fmt, inputs, attrs)


def _paged_attention(b: ContiguousBuilder, fmt: CacheFormat, inputs: Sequence[str], attrs: Any) -> list[str]:
    """Attention over each row's whole [KV, max_len, D] cache row, read back as float32 and masked causally
    (block_tables unused)."""
    query, k_pool, v_pool, _, context_lens, _, *params = inputs
    k_scale, k_off, v_scale, v_off = params or (None,) * 4
    n, dim, heads, kv_heads = b.n, attrs.head_dim, attrs.head_num, attrs.kv_head_num
    k_cache, v_cache = _read(b, fmt, k_pool, k_scale, k_off), _read(b, fmt, v_pool, v_scale, v_off)
    group = heads // kv_heads
    seqs = n.shape_dim(context_lens, 0)
    q = n.op("Reshape", query, n.op("Concat", seqs, n.const([-1, kv_heads, group, dim]), axis=0))
    q = n.op("Reshape", n.op("Transpose", q, perm=[0, 2, 1, 3, 4]), n.const([0, 0, -1, dim]))  # [B, KV, S*G, D]
    q = n.op("Mul", q, n.const(attrs.qk_scale, dtype=np.float32))
    scores = n.op("MatMul", q, n.op("Transpose", k_cache, perm=[0, 1, 3, 2]))  # ORT fuses the transpose away
    scores = n.op("Where", b.mask(context_lens, k_pool, group), scores, n.const(NEG_INF, dtype=np.float32))
    out = n.op("MatMul", n.op("Softmax", scores, axis=-1), v_cache)  # [B, KV, S*G, D]
    out = n.op("Reshape", out, n.op("Concat", seqs, n.const([kv_heads, -1, group, dim]), axis=0))
    return [n.op("Reshape", n.op("Transpose", out, perm=[0, 2, 1, 3, 4]), n.const([-1, heads * dim]))]


CONTIGUOUS: Lowering[Any] = Lowering("contiguous", "exporter/onnx/contiguous.py", {
    **{write: _reshape_and_cache_for(dtype) for dtype, (write, _) in ops.KV_CACHE_OPS.items()},
    **{attend: _paged_attention_for(dtype) for dtype, (_, attend) in ops.KV_CACHE_OPS.items()}}, fallback=ONNX)


def naive_model(config: ModelConfig, paged: onnx.ModelProto, block_size: int,
                kv_cache_dtype: str = "float32") -> onnx.ModelProto:
    """Lower the model's graph (graphs/models) for a contiguous cache of `kv_cache_dtype`; `paged` is the paged graph of that
    cache dtype loaded without its weights (an int8 graph's own inline initializers are its scales)."""
    external = {t.name: t for t in paged.graph.initializer}
    builder = ContiguousBuilder(config, external, kv_cache_dtype)
    models.build(builder, config, GraphOptions(block_size, kv_cache_dtype=kv_cache_dtype))
    return builder.model("pagedgraph-naive")
