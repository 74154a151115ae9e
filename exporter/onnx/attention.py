"""The ONNX function bodies of PagedAttention and SelfAttention (standard ops; exporter/onnx/lowering.py).

Inputs and attributes are the formal ones of the op's declaration (graphs/ops); grouped-query
layout is kept (expanding K/V to every query head is slower, docs/performance.md).
"""
from __future__ import annotations

from typing import Callable

from onnx import TensorProto, helper

from .kv_cache import Dequant
from .nodes import Nodes
from ...graphs.kv_cache import cache_format

NEG_INF = -1e30


class _Heads:
    """Head counts of the enclosing attention function as 1-D int64 tensors."""

    def __init__(self, n: Nodes) -> None:
        self.n = n
        self.kv = n.unsqueeze(n.attr_const("kv_head_num", "int"), [0])
        self.heads = n.unsqueeze(n.attr_const("head_num", "int"), [0])
        # From attributes only, so ONNX Runtime's CSE shares every shape computation across layers.
        self.dim = n.unsqueeze(n.attr_const("head_dim", "int"), [0])
        self.width = n.op("Mul", self.heads, self.dim)
        self.kv_width = n.op("Mul", self.kv, self.dim)
        self.group = n.op("Div", self.heads, self.kv)

    def _kv_of_head(self) -> str:
        n = self.n
        return n.op("Div", n.op("Range", n.const(0), n.op("Squeeze", self.heads), n.const(1)), self.group)

    def placement(self) -> str:
        """[1, H, KV, 1]: qk_scale where kv head k serves query head h, else 0."""
        n = self.n
        kv_range = n.op("Range", n.const(0), n.op("Squeeze", self.kv), n.const(1))
        serves = n.op("Equal", n.unsqueeze(self._kv_of_head(), [1]), n.unsqueeze(kv_range, [0]))
        scaled = n.op("Mul", n.op("Cast", serves, to=1), n.attr_const("qk_scale", "float"))
        return n.unsqueeze(scaled, [0, 3])

    def diagonal(self) -> str:
        """[H]: row h*KV + kv(h) of the [H*KV, D] products, i.e. each head's own kv slice."""
        n = self.n
        head_range = n.op("Range", n.const(0), n.op("Squeeze", self.heads), n.const(1))
        return n.op("Add", n.op("Mul", head_range, self.kv), self._kv_of_head())


def _shape(n: Nodes, *dims: str | int) -> str:
    """A shape from 1-D dim tensors and literal ints. No -1: these tensors may be empty."""
    parts = [d if isinstance(d, str) else n.const([d]) for d in dims]
    return n.op("Concat", *parts, axis=0)


def _block_views(n: Nodes, h: "_Heads") -> list[str]:
    """The K and V pools as [blocks, block_size*KV*D]: a block table row gathers whole blocks.

    One 12 KB copy per block instead of one per slot; the views are Reshapes that only feed
    Gathers (never a graph output), so they alias the pools rather than copying them.
    """
    block_size = n.unsqueeze(n.attr_const("block_size", "int"), [0])
    width = _shape(n, -1, n.op("Mul", block_size, h.kv_width))
    return [n.op("Reshape", pool, width) for pool in ("k_cache", "v_cache")]


def _when(n: Nodes, condition: str, width: str, branch: Callable[[Nodes], str]) -> str:
    """`branch`'s [rows, width] output if `condition` ([1] bool) holds, else [0, width], its nodes not run.

    Empty groups are common (a decode step has no prefill chunks, B=1 one decode group): skipping
    them saves about a third of a B=1 step's kernel launches (docs/performance.md, "Kernel and graph choices"). `branch`
    emits only data ops into the Nodes it gets; shapes and indices stay outside, where CSE shares them
    across layers.
    """
    then = Nodes(prefix=n.fresh("then_"))
    result = branch(then)
    otherwise = Nodes(prefix=n.fresh("else_"))
    empty = otherwise.op("Identity", n.op("ConstantOfShape", _shape(n, 0, width)))
    graphs = {name: helper.make_graph(g.nodes, g.prefix + "graph", [],
                                      [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)])
              for name, g, out in (("then_branch", then, result), ("else_branch", otherwise, empty))}
    return n.op("If", n.op("Squeeze", condition), **graphs)


QUERY_TILE = 64
TileReader = Callable[[Nodes, str], tuple[str, str, str]]
Context = Callable[[str, str], TileReader]


def _multi_query(n: Nodes, h: _Heads, starts: str, q_lens: str, first_visible: str, context: Context) -> str:
    """Sequences with several queries (prefill chunks) -> their packed output rows.

    Queries are cut into tiles of QUERY_TILE rows (fewer when every chunk is shorter) of one
    sequence each, and a Loop attends one tile per iteration, so only one tile's scores are ever alive (a 2,048-token step held
    [tiles, KV, TILE*G, longest] of them at once) and each tile reads only the keys up to its
    last query: its own sequence's, causally trimmed. Query o of sequence b sees keys up to
    first_visible[b] + o. `context(tile_seq, tile_keys)` prepares, outside the Loop, what its
    reader needs; the reader gives tile i's keys/values [L, KV*D] and L (>= tile_keys[i]) inside it.
    """
    longest = n.op("ReduceMax", n.op("Concat", q_lens, n.const([1]), axis=0), keepdims=1)
    tile = n.op("Min", longest, n.const([QUERY_TILE]))  # a short chunk's tile is the chunk, not padded to 64 rows
    tiles_per_seq = n.op("Div", n.op("Add", q_lens, n.op("Sub", tile, n.const([1]))), tile)
    tile_ends = n.op("CumSum", tiles_per_seq, n.const(0))
    tile_starts = n.op("Sub", tile_ends, tiles_per_seq)
    num_tiles = n.op("ReduceSum", tiles_per_seq, n.const([0]), keepdims=1)
    tile_range = n.op("Range", n.const(0), n.op("Squeeze", num_tiles), n.const(1))
    tile_seq = _owner(n, tile_range, tile_ends)
    first = n.op("Mul", n.op("Sub", tile_range, n.op("Gather", tile_starts, tile_seq, axis=0)), tile)  # [NT]
    in_tile = n.unsqueeze(n.op("Range", n.const(0), n.op("Squeeze", tile), n.const(1)), [0])
    offsets = n.op("Add", n.unsqueeze(first, [1]), in_tile)  # [NT, TILE] query offsets in their sequence
    last_row = n.op("Sub", n.op("ReduceMax", n.op("Concat", n.op("Add", starts, q_lens), n.const([1]), axis=0),
                                keepdims=1), n.const([1]))  # the last real row (any row if there is none)
    rows = n.op("Min", n.op("Add", n.unsqueeze(n.op("Gather", starts, tile_seq, axis=0), [1]), offsets), last_row)
    visible = n.op("Gather", first_visible, tile_seq, axis=0)
    limit = n.op("Add", n.unsqueeze(visible, [1]), offsets)  # [NT, TILE] last key each query sees
    real = n.op("Min", n.op("Sub", n.op("Gather", q_lens, tile_seq, axis=0), first), tile)
    read = context(tile_seq, n.op("Add", n.op("Add", visible, first), real))  # keys up to the tile's last query
    tile_group = n.op("Mul", tile, h.group)
    shapes = [_shape(n, num_tiles, tile, h.kv, h.group, h.dim), _shape(n, num_tiles, h.kv, tile_group, h.dim),
              _shape(n, -1, h.kv, h.dim), _shape(n, h.kv, tile, h.group, -1), _shape(n, h.kv, tile_group, -1),
              _shape(n, num_tiles, h.kv, tile, h.group, h.dim), _shape(n, n.op("Mul", num_tiles, tile), h.width)]
    # Packed token t (of these sequences) -> its row in the [NT*TILE] tile layout.
    count = n.op("ReduceSum", q_lens, n.const([0]), keepdims=0)
    t_range = n.op("Range", n.const(0), count, n.const(1))
    seq_of = _owner(n, t_range, n.op("Add", starts, q_lens))
    offset = n.op("Sub", t_range, n.op("Gather", starts, seq_of, axis=0))
    tile_of = n.op("Add", n.op("Gather", tile_starts, seq_of, axis=0), n.op("Div", offset, tile))
    token_rows = n.op("Add", n.op("Mul", tile_of, tile), n.op("Mod", offset, tile))
    scale, trips = n.attr_const("qk_scale", "float"), n.op("Squeeze", num_tiles)

    def attend(b: Nodes) -> str:
        tiles_5d, tiles_4d, kv_heads, scores_shape, rows_shape, out_5d, out_2d = shapes
        query = b.op("Reshape", b.op("Mul", b.op("Gather", "query", rows, axis=0), scale), tiles_5d)
        query = b.op("Reshape", b.op("Transpose", query, perm=[0, 2, 1, 3, 4]), tiles_4d)  # [NT, KV, TILE*G, D]
        body = Nodes(prefix=n.fresh("tile_"))
        i = body.fresh("i")
        keys, values, length = read(body, i)
        keys = body.op("Transpose", body.op("Reshape", keys, kv_heads), perm=[1, 2, 0])  # [KV, D, L]
        values = body.op("Transpose", body.op("Reshape", values, kv_heads), perm=[1, 0, 2])  # [KV, L, D]
        scores = body.op("MatMul", body.op("Gather", query, i, axis=0), keys)  # [KV, TILE*G, L]
        key_pos = body.op("Range", body.const(0), length, body.const(1))
        seen = body.op("LessOrEqual", body.unsqueeze(key_pos, [0]),
                       body.unsqueeze(body.op("Gather", limit, i, axis=0), [1]))
        scores = body.op("Where", body.unsqueeze(seen, [1]), body.op("Reshape", scores, scores_shape),
                         body.const(NEG_INF, dtype="float32"))  # [KV, TILE, G, L]
        probs = body.op("Reshape", body.op("Softmax", scores, axis=-1), rows_shape)
        tile_out = body.op("MatMul", probs, values)  # [KV, TILE*G, D]
        cond = body.fresh("cond")
        cond_out = body.op("Identity", cond)
        graph = helper.make_graph(
            body.nodes, body.prefix + "body",
            [helper.make_tensor_value_info(i, TensorProto.INT64, []),
             helper.make_tensor_value_info(cond, TensorProto.BOOL, [])],
            [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
             helper.make_tensor_value_info(tile_out, TensorProto.FLOAT, None)])
        out = b.op("Reshape", b.op("Loop", trips, "", body=graph), out_5d)  # [NT, KV, TILE, G, D]
        out = b.op("Reshape", b.op("Transpose", out, perm=[0, 2, 1, 3, 4]), out_2d)
        return b.op("Gather", out, token_rows, axis=0)

    return _when(n, n.op("Greater", num_tiles, n.const([0])), h.width, attend)


def _owner(n: Nodes, items: str, ends: str) -> str:
    """Index of the segment holding each item, segments given by their exclusive end offsets."""
    before = n.op("GreaterOrEqual", n.unsqueeze(items, [1]), n.unsqueeze(ends, [0]))
    return n.op("ReduceSum", n.cast(before), n.const([1]), keepdims=0)


def _single_query(n: Nodes, h: _Heads, views: list[str], rows: str, tables: str, context_lens: str,
                  dequant: Dequant) -> str:
    """Sequences with one query each (decode), reading the gathered [B, L, KV*D] rows as they are.

    Each query head is placed in its kv head's slice of an otherwise zero KV*D row, so scores and
    outputs are plain batched GEMMs against the gathered context: no transpose copies of K/V
    (decode is bound by moving the context, not by these KV-times-larger tiny GEMMs). Runs under
    `_when`: data ops go into the branch, shapes and the mask stay in `n`.
    """
    seqs = n.shape_dim(rows, 0)
    length = n.op("Mul", n.shape_dim(tables, 1), n.unsqueeze(n.attr_const("block_size", "int"), [0]))
    key_pos = n.op("Range", n.const(0), n.op("Squeeze", length), n.const(1))
    visible = n.unsqueeze(n.op("Less", n.unsqueeze(key_pos, [0]), n.unsqueeze(context_lens, [1])), [1])
    shapes = [_shape(n, seqs, length, h.kv_width), _shape(n, seqs, h.heads, 1, h.dim),
              _shape(n, seqs, h.heads, h.kv_width), _shape(n, seqs, n.op("Mul", h.heads, h.kv), h.dim),
              _shape(n, seqs, h.width)]
    placement, diagonal, neg_inf = h.placement(), h.diagonal(), n.const(NEG_INF, dtype="float32")

    def attend(b: Nodes) -> str:
        context_shape, heads_shape, placed_shape, products_shape, out_shape = shapes
        keys, values = (dequant(b, b.op("Reshape", b.op("Gather", view, tables, axis=0), context_shape), kv)
                        for view, kv in zip(views, "kv"))
        query = b.op("Reshape", b.op("Gather", "query", rows, axis=0), heads_shape)
        placed = b.op("Reshape", b.op("Mul", query, placement), placed_shape)
        scores = b.op("MatMul", placed, b.op("Transpose", keys, perm=[0, 2, 1]))  # [B, H, L]
        scores = b.op("Where", visible, scores, neg_inf)
        out = b.op("MatMul", b.op("Softmax", scores, axis=-1), values)  # [B, H, KV*D]
        return b.op("Reshape", b.op("Gather", b.op("Reshape", out, products_shape), diagonal, axis=1), out_shape)

    return _when(n, n.op("Greater", seqs, n.const([0])), h.width, attend)


def paged_attention_for(kv_cache_dtype: str) -> Callable[[Nodes], list[str]]:
    """The body for pools of `kv_cache_dtype`: gathered K/V rows are read back as float32 (graphs/kv_cache.py)."""
    fmt = cache_format(kv_cache_dtype)
    return lambda n: _paged_attention(n, Dequant(n, fmt))


def _paged_attention(n: Nodes, dequant: Dequant) -> list[str]:
    """Multi-query sequences (prefill chunks) first, then single-query ones, as the packer orders them.

    Each group reads only the block-table columns its longest context needs (not the gear's M),
    and the single-query group is split once where that saves the most context reads, so a decode
    at 64 tokens of context never pays for one at 1,024. Empty groups and padding sequences cost
    nothing but their If; padding tokens cost only the final Pad.
    """
    h = _Heads(n)
    cu = n.cast("cu_seqlens_q")
    starts = n.op("Slice", cu, n.const([0]), n.const([-1]))
    q_lens = n.op("Sub", n.op("Slice", cu, n.const([1]), n.const([1 << 62])), starts)
    multi = n.op("ReduceSum", n.cast(n.op("Greater", q_lens, n.const(1))), n.const([0]), keepdims=1)
    real = n.op("ReduceSum", n.cast(n.op("Greater", q_lens, n.const(0))), n.const([0]), keepdims=1)
    context_lens, tables = n.cast("context_lens"), n.cast("block_tables")
    block_size = n.attr_const("block_size", "int")
    blocks = n.op("Div", n.op("Add", context_lens, n.op("Sub", block_size, n.const(1))), block_size)
    rows = _Rows(n, [starts, q_lens, context_lens, tables, blocks])
    views = _block_views(n, h)
    m_starts, m_lens, m_ctx, m_tables, _ = rows.take(n.const([0]), multi)
    outs = [_multi_query(n, h, m_starts, m_lens, n.op("Sub", m_ctx, m_lens), _pool_tiles(n, h, views, m_tables, dequant))]
    split = n.op("Add", multi, _best_split(n, rows.take(multi, real)[4]))
    for lo, hi in ((multi, split), (split, real)):
        s_starts, _, s_ctx, s_tables, s_blocks = rows.take(lo, hi)
        outs.append(_single_query(n, h, views, s_starts, _used_columns(n, s_tables, s_blocks), s_ctx, dequant))
    out = n.op("Concat", *outs, axis=0)
    padding = n.op("Sub", n.shape_dim("query", 0), n.shape_dim(out, 0))
    return [n.op("Pad", out, _shape(n, 0, 0, padding, 0))]


def _pool_tiles(n: Nodes, h: _Heads, views: list[str], tables: str, dequant: Dequant) -> Context:
    """Tile contexts read from the pools: the leading blocks of the tile's sequence that its keys need."""
    block_size = n.unsqueeze(n.attr_const("block_size", "int"), [0])
    rows_shape = _shape(n, -1, h.kv_width)

    def prepare(tile_seq: str, tile_keys: str) -> TileReader:
        blocks = n.op("Div", n.op("Add", tile_keys, n.op("Sub", block_size, n.const([1]))), block_size)
        length = n.op("Mul", blocks, block_size)

        def read(body: Nodes, i: str) -> tuple[str, str, str]:
            table = body.op("Gather", tables, body.op("Gather", tile_seq, i, axis=0), axis=0)  # [M]
            used = body.op("Gather", blocks, body.unsqueeze(i, [0]), axis=0)
            ids = body.op("Slice", table, body.const([0]), used, body.const([0]))
            keys, values = (body.op("Gather", view, ids, axis=0) for view in views)  # [blocks, block_size*KV*D]
            if not dequant.identity:
                keys, values = (dequant(body, body.op("Reshape", x, rows_shape), kv)
                                for x, kv in ((keys, "k"), (values, "v")))
            return keys, values, body.op("Gather", length, i, axis=0)
        return read
    return prepare


class _Rows:
    """Per-sequence tensors sliced together by sequence range."""

    def __init__(self, n: Nodes, tensors: list[str]) -> None:
        self.n = n
        self.tensors = tensors

    def take(self, lo: str, hi: str) -> list[str]:
        zero = self.n.const([0])
        return [self.n.op("Slice", t, lo, hi, zero) for t in self.tensors]


def _used_columns(n: Nodes, tables: str, blocks: str) -> str:
    """The leading block-table columns that the group's longest context uses (at least one).

    Never zero: Reshape reads a 0 in a shape as "copy this dim", so an empty group keeps L = block_size.
    """
    needed = n.op("ReduceMax", n.op("Concat", blocks, n.const([1]), axis=0), keepdims=1)
    return n.op("Slice", tables, n.const([0]), needed, n.const([1]))


def _best_split(n: Nodes, blocks: str) -> str:
    """k minimising k * max(blocks[:k]) + (B - k) * max(blocks[k:]) for blocks sorted descending.

    The scheduler sorts decodes by context length, so the two groups each gather close to what
    they use; k = 0 (no split) wins ties. Correct for any order: each group trims to its own max.
    """
    count = n.shape_dim(blocks, 0)
    padded = n.op("Concat", blocks, n.const([0]), axis=0)
    ks = n.op("Range", n.const(0), n.op("Add", n.op("Squeeze", count), n.const(1)), n.const(1))
    longest = n.op("Gather", padded, n.const(0), axis=0)
    cost = n.op("Add", n.op("Mul", ks, longest), n.op("Mul", n.op("Sub", count, ks), n.op("Gather", padded, ks, axis=0)))
    return n.op("ArgMin", cost, axis=0, keepdims=1, select_last_index=0)


def self_attention(n: Nodes) -> list[str]:
    h = _Heads(n)
    cu = n.cast("cu_seqlens_q")
    starts = n.op("Slice", cu, n.const([0]), n.const([-1]))
    q_lens = n.op("Sub", n.op("Slice", cu, n.const([1]), n.const([1 << 62])), starts)

    def own_tokens(tile_seq: str, tile_keys: str) -> TileReader:
        first = n.op("Gather", starts, tile_seq, axis=0)
        last = n.op("Add", first, tile_keys)

        def read(body: Nodes, i: str) -> tuple[str, str, str]:
            index = body.unsqueeze(i, [0])
            lo, hi = (body.op("Gather", end, index, axis=0) for end in (first, last))
            keys, values = (body.op("Slice", x, lo, hi, body.const([0])) for x in ("key", "value"))
            return keys, values, body.op("Gather", tile_keys, i, axis=0)
        return read

    out = _multi_query(n, h, starts, q_lens, n.op("Mul", q_lens, n.const(0)), own_tokens)
    padding = n.op("Sub", n.shape_dim("query", 0), n.shape_dim(out, 0))
    return [n.op("Pad", out, _shape(n, 0, 0, padding, 0))]
