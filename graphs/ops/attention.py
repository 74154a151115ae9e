"""Attention ops: PagedAttention over the pool through block tables, packed SelfAttention.

Both are causal per sequence over a packed query stream delimited by `cu_seqlens_q`
(sequence b owns query rows cu[b]:cu[b+1]). Grouped-query: query head h reads kv head
h // (head_num // kv_head_num).
"""
from __future__ import annotations

import numpy as np


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, limits: np.ndarray, scale: float,
            head_num: int, kv_head_num: int) -> np.ndarray:
    """q [S, H*D], k/v [L, KV*D]; query s sees keys 0..limits[s] inclusive. Returns [S, H*D]."""
    s_len, l_len = q.shape[0], k.shape[0]
    d = q.shape[1] // head_num
    group = head_num // kv_head_num
    qh = q.reshape(s_len, kv_head_num, group, d).transpose(1, 2, 0, 3)  # [KV, G, S, D]
    kh = k.reshape(l_len, kv_head_num, d).transpose(1, 0, 2)[:, None]  # [KV, 1, L, D]
    vh = v.reshape(l_len, kv_head_num, d).transpose(1, 0, 2)[:, None]
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(scale)  # [KV, G, S, L]
    visible = np.arange(l_len)[None, :] <= limits[:, None]
    scores = np.where(visible, scores, np.float32(-1e30))
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ vh  # [KV, G, S, D]
    return out.transpose(2, 0, 1, 3).reshape(s_len, head_num * d).astype(np.float32)


def paged_attention(
    query: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    cu_seqlens_q: np.ndarray | None,
    *,
    head_num: int,
    kv_head_num: int,
    qk_scale: float,
    block_size: int,
) -> np.ndarray:
    """ATB PagedAttentionOperation: each query attends to its sequence's cached K/V.

    The cache already holds this step's keys (ReshapeAndCache runs first), so sequence b
    has context_lens[b] cached tokens, the last q_len of which are its queries: query i
    sits at position context_lens[b] - q_len + i. Without cu_seqlens_q every sequence
    has one query (decode). Rows outside every sequence (padding) come back as zeros.
    """
    batch = block_tables.shape[0]
    cu = np.arange(batch + 1) if cu_seqlens_q is None else np.asarray(cu_seqlens_q, dtype=np.int64)
    out = np.zeros_like(query)
    for b in range(batch):
        q_len, ctx = int(cu[b + 1] - cu[b]), int(context_lens[b])
        if q_len == 0:
            continue
        slots = (block_tables[b, :, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)[:ctx]
        limits = np.arange(ctx - q_len, ctx)
        out[cu[b]:cu[b + 1]] = _attend(query[cu[b]:cu[b + 1]], k_cache[slots], v_cache[slots], limits,
                                       qk_scale, head_num, kv_head_num)
    return out


def self_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    cu_seqlens_q: np.ndarray,
    *,
    head_num: int,
    kv_head_num: int,
    qk_scale: float,
) -> np.ndarray:
    """ATB SelfAttentionOperation (calcType=PA_ENCODER): packed prefill, causal within each sequence."""
    out = np.zeros_like(query)
    for b in range(len(cu_seqlens_q) - 1):
        lo, hi = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        if hi > lo:
            out[lo:hi] = _attend(query[lo:hi], key[lo:hi], value[lo:hi], np.arange(hi - lo),
                                 qk_scale, head_num, kv_head_num)
    return out
