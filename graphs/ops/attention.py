"""The softmax attention both attention ops reduce to (numpy), grouped-query.

Query head h reads kv head h // (head_num // kv_head_num); sequence b owns the packed query
rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
"""
from __future__ import annotations

import numpy as np


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, limits: np.ndarray, scale: float,
           head_num: int, kv_head_num: int, head_dim: int) -> np.ndarray:
    """q [S, H*D], k/v [L, KV*D]; query s sees keys 0..limits[s] inclusive. Returns [S, H*D]."""
    s_len, l_len = q.shape[0], k.shape[0]
    group = head_num // kv_head_num
    qh = q.reshape(s_len, kv_head_num, group, head_dim).transpose(1, 2, 0, 3)  # [KV, G, S, D]
    kh = k.reshape(l_len, kv_head_num, head_dim).transpose(1, 0, 2)[:, None]  # [KV, 1, L, D]
    vh = v.reshape(l_len, kv_head_num, head_dim).transpose(1, 0, 2)[:, None]
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * np.float32(scale)  # [KV, G, S, L]
    visible = np.arange(l_len)[None, :] <= limits[:, None]
    scores = np.where(visible, scores, np.float32(-1e30))
    scores = scores - scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ vh  # [KV, G, S, D]
    return out.transpose(2, 0, 1, 3).reshape(s_len, head_num * head_dim).astype(np.float32)
