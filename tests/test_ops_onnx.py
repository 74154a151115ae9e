"""Each atb function, run by ONNX Runtime, equals its numpy reference in graphs/ops."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from graphs import ops
from tests.op_models import one_node_model


def run_op(op: str, inputs: dict[str, np.ndarray], outputs: list[str], **attrs: object) -> list[np.ndarray]:
    model = one_node_model(op, inputs, outputs, **attrs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, inputs)


def test_rms_norm_rope_swiglu() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 48), dtype=np.float32)
    w = rng.standard_normal(48, dtype=np.float32)
    (y,) = run_op("RmsNorm", {"x": x, "weight": w}, ["y"], epsilon=1e-5)
    np.testing.assert_allclose(y, ops.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    q, k = rng.standard_normal((7, 4 * 16), dtype=np.float32), rng.standard_normal((7, 2 * 16), dtype=np.float32)
    angles = rng.uniform(0, 6, (7, 8)).astype(np.float32)
    cos = np.cos(np.concatenate([angles, angles], 1))
    sin = np.sin(np.concatenate([angles, angles], 1))
    qo, ko = run_op("Rope", {"query": q, "key": k, "cos": cos, "sin": sin}, ["qo", "ko"])
    np.testing.assert_allclose(qo, ops.rope(q, cos, sin, 16), atol=1e-5)
    np.testing.assert_allclose(ko, ops.rope(k, cos, sin, 16), atol=1e-5)
    (s,) = run_op("SwiGLU", {"x": x}, ["s"])
    np.testing.assert_allclose(s, ops.swiglu(x), rtol=1e-5, atol=1e-6)


def test_reshape_and_cache_writes_only_its_slots() -> None:
    rng = np.random.default_rng(1)
    k_cache, v_cache = np.zeros((64, 8), np.float32), np.ones((64, 8), np.float32)
    key, value = rng.standard_normal((3, 8), dtype=np.float32), rng.standard_normal((3, 8), dtype=np.float32)
    slots = np.array([17, 5, 40])
    ko, vo = run_op("ReshapeAndCache", {"key": key, "value": value, "k_cache": k_cache, "v_cache": v_cache,
                                        "slot_mapping": slots}, ["ko", "vo"])
    want_k, want_v = ops.reshape_and_cache(key, value, k_cache.copy(), v_cache.copy(), slots)
    np.testing.assert_array_equal(ko, want_k)
    np.testing.assert_array_equal(vo, want_v)


def _mixed_batch(rng: np.random.Generator, heads: int, kv_heads: int, block_size: int = 16):
    """Prefill chunks (with and without cached context), then decodes, then padding; packer order."""
    d = 8
    q_lens = [5, 3, 130, 1, 1, 1]  # multi-query sequences first (one spans 3 query tiles), then single-query ones
    ctx = [5, 20, 150, 33, 1, 16]  # a fresh prompt, a chunk over 17 cached tokens, ..., decodes
    pad_seqs, pad_tokens = 2, 4
    blocks_per_seq = 10
    num_blocks = 1 + len(q_lens) * blocks_per_seq
    tables = np.zeros((len(q_lens) + pad_seqs, blocks_per_seq), np.int32)
    perm = rng.permutation(np.arange(1, num_blocks))
    for b, c in enumerate(ctx):
        used = -(-c // block_size)
        tables[b, :used] = perm[b * blocks_per_seq: b * blocks_per_seq + used]
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    context_lens = np.array(ctx + [0] * pad_seqs, np.int32)
    tokens = sum(q_lens) + pad_tokens
    query = rng.standard_normal((tokens, heads * d), dtype=np.float32)
    k_cache = rng.standard_normal((num_blocks * block_size, kv_heads * d), dtype=np.float32)
    v_cache = rng.standard_normal((num_blocks * block_size, kv_heads * d), dtype=np.float32)
    return query, k_cache, v_cache, tables, context_lens, cu, sum(q_lens)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (6, 1), (9, 3)])
def test_paged_attention_mixed_prefill_chunks_and_decodes(heads: int, kv_heads: int) -> None:
    rng = np.random.default_rng(heads * 10 + kv_heads)
    query, k_cache, v_cache, tables, ctx, cu, real = _mixed_batch(rng, heads, kv_heads)
    attrs = dict(head_num=heads, kv_head_num=kv_heads, qk_scale=0.3, block_size=16)
    onnx_attrs = dict(attrs, head_dim=query.shape[1] // heads)
    (got,) = run_op("PagedAttention", {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
                                       "context_lens": ctx, "cu_seqlens_q": cu}, ["out"], **onnx_attrs)
    want = ops.paged_attention(query, k_cache, v_cache, tables, ctx, cu, **attrs)
    assert got.shape == query.shape
    np.testing.assert_allclose(got[:real], want[:real], rtol=1e-4, atol=1e-5)
    assert np.isfinite(got).all()


def test_paged_attention_decode_only_and_prefill_only() -> None:
    rng = np.random.default_rng(7)
    query, k_cache, v_cache, tables, ctx, cu, _ = _mixed_batch(rng, 4, 2)
    attrs = dict(head_num=4, kv_head_num=2, qk_scale=0.3, block_size=16)
    for lo, hi in ((0, 3), (3, 6)):  # only the multi-query sequences, then only the decodes
        sub_cu = (cu[lo:hi + 1] - cu[lo]).astype(np.int32)
        sub_q = query[cu[lo]:cu[hi]]
        inputs = {"query": sub_q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables[lo:hi],
                  "context_lens": ctx[lo:hi], "cu_seqlens_q": sub_cu}
        (got,) = run_op("PagedAttention", inputs, ["out"], head_dim=8, **attrs)
        want = ops.paged_attention(sub_q, k_cache, v_cache, tables[lo:hi], ctx[lo:hi], sub_cu, **attrs)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_self_attention_packed_causal() -> None:
    rng = np.random.default_rng(3)
    cu = np.array([0, 6, 7, 90, 90], np.int32)
    query = rng.standard_normal((92, 4 * 8), dtype=np.float32)
    key = rng.standard_normal((92, 2 * 8), dtype=np.float32)
    value = rng.standard_normal((92, 2 * 8), dtype=np.float32)
    attrs = dict(head_num=4, kv_head_num=2, qk_scale=0.35)
    (got,) = run_op("SelfAttention", {"query": query, "key": key, "value": value, "cu_seqlens_q": cu}, ["out"],
                    head_dim=8, **attrs)
    want = ops.self_attention(query, key, value, cu, **attrs)
    np.testing.assert_allclose(got[:90], want[:90], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_paged_attention_decodes_split_by_context_length(order: str) -> None:
    """Decodes are split where it saves the most context reads; any order stays correct."""
    rng = np.random.default_rng(11)
    ctx = np.array([150, 140, 30, 20, 17, 5, 3, 1] + [0, 0], np.int32)
    if order == "unsorted":
        ctx[:8] = rng.permutation(ctx[:8])
    heads, kv_heads, d, bs = 4, 2, 8, 16
    tables = np.zeros((10, 10), np.int32)
    tables[:8] = rng.permutation(np.arange(1, 81)).reshape(8, 10)
    cu = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 8, 8], np.int32)
    query = rng.standard_normal((9, heads * d), dtype=np.float32)
    k_cache = rng.standard_normal((81 * bs, kv_heads * d), dtype=np.float32)
    v_cache = rng.standard_normal((81 * bs, kv_heads * d), dtype=np.float32)
    attrs = dict(head_num=heads, kv_head_num=kv_heads, qk_scale=0.3, block_size=bs)
    (got,) = run_op("PagedAttention", {"query": query, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
                                       "context_lens": ctx, "cu_seqlens_q": cu}, ["out"], head_dim=d, **attrs)
    want = ops.paged_attention(query, k_cache, v_cache, tables, ctx, cu, **attrs)
    np.testing.assert_allclose(got[:8], want[:8], rtol=1e-4, atol=1e-5)
