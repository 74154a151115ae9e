"""PagedAttention: each packed query attends to its sequence's cached K/V through the block table."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .attention import attend
from .examples import packed_step, random_step
from .op import Attributes, Example, Op, Tensor


@dataclass(frozen=True)
class PagedAttentionAttributes(Attributes):
    """ATB's headNum, kvHeadNum, qkScale; head_dim and block_size so every lowering sees the same shapes."""

    head_num: int
    kv_head_num: int
    head_dim: int
    qk_scale: float
    block_size: int


def paged_attention(query: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, block_tables: np.ndarray,
                    context_lens: np.ndarray, cu_seqlens_q: np.ndarray, *, head_num: int, kv_head_num: int,
                    head_dim: int, qk_scale: float, block_size: int) -> np.ndarray:
    """ATB PagedAttentionOperation over a packed stream (prefill chunks and decodes alike).

    The cache already holds this step's keys (ReshapeAndCache runs first), so sequence b has
    context_lens[b] cached tokens, the last q_len of which are its queries: query i sits at
    position context_lens[b] - q_len + i. Rows outside every sequence (padding) come back as zeros.
    Sequences with several queries come before single-query ones (the packer's order, which the
    ONNX body relies on to attend each group separately).
    """
    cu = np.asarray(cu_seqlens_q, dtype=np.int64)
    out = np.zeros_like(query)
    for b in range(block_tables.shape[0]):
        q_len, ctx = int(cu[b + 1] - cu[b]), int(context_lens[b])
        if q_len == 0:
            continue
        slots = (block_tables[b, :, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)[:ctx]
        limits = np.arange(ctx - q_len, ctx)
        out[cu[b]:cu[b + 1]] = attend(query[cu[b]:cu[b + 1]], k_cache[slots], v_cache[slots], limits, qk_scale,
                                      head_num, kv_head_num, head_dim)
    return out


def _examples() -> Iterator[Example]:
    """Prefill chunks (fresh, over cached context, many query tiles), decodes, padding; every head grouping."""
    tolerance = dict(atol=1e-5, rtol=1e-4)
    for heads, kv_heads in ((4, 4), (4, 2), (6, 1), (9, 3)):
        rng = np.random.default_rng(heads * 10 + kv_heads)
        step = packed_step(rng, [5, 3, 130, 1, 1, 1], [5, 20, 150, 33, 1, 16], heads=heads, kv_heads=kv_heads,
                           head_dim=8, block_size=16, max_blocks=10, pad_seqs=2, pad_tokens=4)
        attrs = dict(head_num=heads, kv_head_num=kv_heads, head_dim=8, qk_scale=0.3, block_size=16)
        yield Example(step, attrs, label=f"mixed {heads}/{kv_heads} heads", **tolerance)
    rng = np.random.default_rng(0)
    smollm = dict(head_num=9, kv_head_num=3, head_dim=64, qk_scale=0.125, block_size=16)
    step = packed_step(rng, [5, 20, 70, 1, 1, 1], [5, 37, 150, 33, 1, 16], heads=9, kv_heads=3, head_dim=64,
                       block_size=16, max_blocks=10, pad_seqs=2, pad_tokens=3)
    yield Example(step, smollm, label="SmolLM2 heads, mixed", **tolerance)
    for lo, hi, label in ((0, 3, "prefill chunks only"), (3, 6, "decodes only")):
        query, k, v, tables, ctx, cu = step
        sub_cu = (cu[lo:hi + 1] - cu[lo]).astype(np.int32)
        yield Example((query[cu[lo]:cu[hi]], k, v, tables[lo:hi], ctx[lo:hi], sub_cu), smollm, label=label, **tolerance)
    long_chunk = packed_step(rng, [150, 1], [300, 77], heads=9, kv_heads=3, head_dim=64, block_size=16,
                             max_blocks=20, pad_tokens=2)
    yield Example(long_chunk, smollm, label="long chunk after a cached prefix", **tolerance)
    for context in ([700], [64, 200, 129], [1000] * 9):  # few decodes: keys split across threads
        yield Example(packed_step(rng, [1] * len(context), context, heads=9, kv_heads=3, head_dim=64, block_size=16,
                                  max_blocks=-(-max(context) // 16)), smollm, label=f"decodes at {context[:3]}",
                      **tolerance)
    for order in ("sorted", "unsorted"):  # the decode group is split where it saves the most context reads
        context = [150, 140, 30, 20, 17, 5, 3, 1]
        if order == "unsorted":
            context = rng.permutation(context).tolist()
        yield Example(packed_step(rng, [1] * 8, context, heads=4, kv_heads=2, head_dim=8, block_size=16, max_blocks=10,
                                  pad_seqs=2, pad_tokens=1),
                      dict(head_num=4, kv_head_num=2, head_dim=8, qk_scale=0.3, block_size=16),
                      label=f"decodes {order} by context", **tolerance)
    for seed, (heads, kv_heads) in enumerate(((4, 4), (4, 2), (8, 2), (9, 3), (6, 1))):  # random steps
        rng = np.random.default_rng(seed)
        head_dim, block_size = int(rng.choice([16, 32, 64])), int(rng.choice([16, 32]))
        for decode in (False, True):
            q_lens, context = random_step(rng, 5, 4, block_size, decode)
            step = packed_step(rng, q_lens, context, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                               block_size=block_size, max_blocks=4, pad_seqs=1, pad_tokens=int(rng.integers(0, 4)))
            attrs = dict(head_num=heads, kv_head_num=kv_heads, head_dim=head_dim, qk_scale=head_dim ** -0.5,
                         block_size=block_size)
            yield Example(step, attrs, label=f"random {'decode' if decode else 'prefill'} {heads}/{kv_heads} heads",
                          **tolerance)


PAGED_ATTENTION = Op(
    name="PagedAttention",
    atb="PagedAttentionOperation",
    inputs=(Tensor("query", ("T", "head_num * head_dim")),
            Tensor("k_cache", ("num_slots", "kv_head_num * head_dim")),
            Tensor("v_cache", ("num_slots", "kv_head_num * head_dim")),
            Tensor("block_tables", ("B", "M"), ("int32",)),
            Tensor("context_lens", ("B",), ("int32",)),
            Tensor("cu_seqlens_q", ("B + 1",), ("int32",))),
    outputs=(Tensor("out", ("T", "head_num * head_dim")),),
    attributes=PagedAttentionAttributes,
    reference=paged_attention,
    examples=_examples,
    doc="causal attention of each packed query over its sequence's cached K/V",
)
