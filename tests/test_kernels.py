"""The C++ kernels against the numpy references of their ops (graphs/ops), on random packed batches."""
from __future__ import annotations

import numpy as np
import pytest

from graphs import ops
from graphs.contract import NULL_BLOCK
from kernels.build import KernelBuildError, library_path

try:
    library_path()
except KernelBuildError as exc:  # pragma: no cover - CI has g++
    pytest.skip(f"kernels cannot be built: {exc}", allow_module_level=True)

from kernels import binding  # noqa: E402

HEADS = [(4, 4), (4, 2), (8, 2), (9, 3), (6, 1)]  # (head_num, kv_head_num): MHA, GQA ratios, MQA


def _batch(rng: np.random.Generator, batch: int, block_size: int, num_blocks: int, max_blocks: int,
           decode: bool) -> dict[str, np.ndarray]:
    """A packed step: real sequences with random cached prefixes and query runs, then padding sequences.

    Blocks are drawn without repeats (block 0, the null block, is never handed out); padding tokens
    write into the null block and padding sequences have no queries, like the runtime's packer.
    """
    real = rng.integers(1, batch + 1)
    free = rng.permutation(np.arange(1, num_blocks))
    tables = np.full((batch, max_blocks), NULL_BLOCK, np.int32)
    context_lens = np.zeros(batch, np.int32)
    q_lens = np.zeros(batch, np.int64)
    used = 0
    for b in range(real):
        ctx = int(rng.integers(1, max_blocks * block_size + 1))
        q_lens[b] = 1 if decode else int(rng.integers(1, ctx + 1))
        context_lens[b] = ctx
        n = -(-ctx // block_size)
        tables[b, :n] = free[used:used + n]
        used += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + int(rng.integers(0, 5))  # padding rows after the last sequence
    slots = np.full(tokens, NULL_BLOCK * block_size, np.int64)
    for b in range(real):
        pos = np.arange(context_lens[b] - q_lens[b], context_lens[b])
        slots[cu[b]:cu[b + 1]] = tables[b, pos // block_size].astype(np.int64) * block_size + pos % block_size
    return {"block_tables": tables, "context_lens": context_lens, "cu_seqlens_q": cu, "slot_mapping": slots}


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("head_num,kv_head_num", HEADS)
@pytest.mark.parametrize("decode", [False, True])
def test_cache_write_then_paged_attention_match_references(seed: int, head_num: int, kv_head_num: int,
                                                           decode: bool) -> None:
    rng = np.random.default_rng(seed)
    head_dim = int(rng.choice([16, 32, 64]))
    block_size = int(rng.choice([4, 16]))
    batch, max_blocks = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    num_blocks = batch * max_blocks + 2
    step = _batch(rng, batch, block_size, num_blocks, max_blocks, decode)
    tokens = len(step["slot_mapping"])
    kv_width = kv_head_num * head_dim
    pools = [rng.standard_normal((num_blocks * block_size, kv_width)).astype(np.float32) for _ in range(2)]
    key, value = (rng.standard_normal((tokens, kv_width)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((tokens, head_num * head_dim)).astype(np.float32)

    want_k, want_v = ops.reshape_and_cache(key, value, pools[0].copy(), pools[1].copy(), step["slot_mapping"])
    got_k, got_v = pools[0].copy(), pools[1].copy()
    binding.reshape_and_cache(key, value, got_k, got_v, step["slot_mapping"])
    # Padding tokens all target slot 0: last write wins in both, so the pools match exactly.
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)

    attrs = dict(head_num=head_num, kv_head_num=kv_head_num, qk_scale=head_dim ** -0.5, block_size=block_size)
    tables, lens, cu = step["block_tables"], step["context_lens"], step["cu_seqlens_q"]
    want = ops.paged_attention(query, want_k, want_v, tables, lens, cu, **attrs)
    got = binding.paged_attention(query, got_k, got_v, tables, lens, cu, **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[cu[-1]:].any(), "padding rows must come back as zeros"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("head_num,kv_head_num", HEADS)
def test_self_attention_matches_reference(seed: int, head_num: int, kv_head_num: int) -> None:
    rng = np.random.default_rng(100 + seed)
    head_dim = int(rng.choice([8, 64]))
    q_lens = rng.integers(0, 40, size=int(rng.integers(1, 6)))
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1]) + int(rng.integers(0, 4))
    query = rng.standard_normal((tokens, head_num * head_dim)).astype(np.float32)
    key, value = (rng.standard_normal((tokens, kv_head_num * head_dim)).astype(np.float32) for _ in range(2))
    attrs = dict(head_num=head_num, kv_head_num=kv_head_num, qk_scale=0.3)
    np.testing.assert_allclose(binding.self_attention(query, key, value, cu, **attrs),
                               ops.self_attention(query, key, value, cu, **attrs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_num,kv_head_num,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 8)])
def test_long_prefill_chunk_after_cached_prefix(head_num: int, kv_head_num: int, head_dim: int) -> None:
    """Many query tiles and key chunks: causal limits cross tile and chunk edges, and a decode rides along."""
    rng = np.random.default_rng(head_dim)
    block_size, num_blocks = 16, 64
    context_lens = np.array([300, 77], np.int32)  # 300 = 150 cached + a 150-token chunk; 77 decodes one
    cu = np.array([0, 150, 151], np.int32)
    tables = np.zeros((2, 20), np.int32)
    tables[0, :19] = rng.permutation(np.arange(1, num_blocks))[:19]
    tables[1, :5] = np.arange(40, 45)
    pools = [rng.standard_normal((num_blocks * block_size, kv_head_num * head_dim)).astype(np.float32) for _ in range(2)]
    query = rng.standard_normal((153, head_num * head_dim)).astype(np.float32)
    attrs = dict(head_num=head_num, kv_head_num=kv_head_num, qk_scale=head_dim ** -0.5, block_size=block_size)
    got = binding.paged_attention(query, *pools, tables, context_lens, cu, **attrs)
    np.testing.assert_allclose(got, ops.paged_attention(query, *pools, tables, context_lens, cu, **attrs),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("context_lens", [[700], [64, 200, 129], [1000] * 9])
def test_few_decodes_split_their_keys_across_threads(context_lens: list[int]) -> None:
    """Fewer than 8 decode rows split their keys into parts whose softmax states are merged."""
    rng = np.random.default_rng(len(context_lens))
    block_size, batch = 16, len(context_lens)
    max_blocks = -(-max(context_lens) // block_size)
    tables = rng.permutation(np.arange(1, batch * max_blocks + 1)).reshape(batch, max_blocks).astype(np.int32)
    pools = [rng.standard_normal(((batch * max_blocks + 1) * block_size, 3 * 64)).astype(np.float32) for _ in range(2)]
    query = rng.standard_normal((batch, 9 * 64)).astype(np.float32)
    step = (tables, np.array(context_lens, np.int32), np.arange(batch + 1, dtype=np.int32))
    attrs = dict(head_num=9, kv_head_num=3, qk_scale=0.125, block_size=block_size)
    np.testing.assert_allclose(binding.paged_attention(query, *pools, *step, **attrs),
                               ops.paged_attention(query, *pools, *step, **attrs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5, 700])  # 700 rows take the parallel path
def test_rope_and_swiglu_match_references(tokens: int) -> None:
    rng = np.random.default_rng(tokens)
    head_dim = 64
    angles = rng.uniform(0, 100, (tokens, head_dim // 2))
    cos, sin = (np.concatenate([f(angles)] * 2, axis=1).astype(np.float32) for f in (np.cos, np.sin))
    x = rng.standard_normal((tokens, 9 * head_dim)).astype(np.float32)
    np.testing.assert_allclose(binding.rope(x, cos, sin, head_dim), ops.rope(x, cos, sin, head_dim),
                               rtol=1e-5, atol=1e-5)
    gate_up = (rng.standard_normal((tokens, 2 * 1536)) * 8).astype(np.float32)  # into silu's tails
    np.testing.assert_allclose(binding.swiglu(gate_up), ops.swiglu(gate_up), rtol=1e-5, atol=1e-5)


def test_out_of_pool_indices_are_errors_not_writes() -> None:
    pool = np.zeros((32, 8), np.float32)
    row = np.ones((1, 8), np.float32)
    with pytest.raises(binding.KernelError, match=r"slot_mapping\[0\] = 32 is outside the pool of 32 slots"):
        binding.reshape_and_cache(row, row, pool, pool.copy(), np.array([32], np.int64))
    assert not pool.any()
    query = np.ones((1, 16), np.float32)
    with pytest.raises(binding.KernelError, match=r"block_tables\[0, 0\] = 9 is outside the pool of 2 blocks"):
        binding.paged_attention(query, pool, pool, np.array([[9]], np.int32), np.array([1], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, qk_scale=1.0, block_size=16)
    with pytest.raises(binding.KernelError, match=r"head_dim 12 must be a positive multiple of 8"):
        binding.paged_attention(np.ones((1, 24), np.float32), np.zeros((32, 12), np.float32),
                                np.zeros((32, 12), np.float32), np.array([[1]], np.int32), np.array([1], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, qk_scale=1.0, block_size=16)
    with pytest.raises(binding.KernelError, match=r"context_lens\[0\] = 17 must cover its 1 queries and fit 1 blocks"):
        binding.paged_attention(query, pool, pool, np.array([[1]], np.int32), np.array([17], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, qk_scale=1.0, block_size=16)


def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from kernels import build, cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(KernelBuildError, match=r"no C\+\+ compiler found .*apt-get install g\+\+"):
        build.library_path()
