"""The C++ kernels' own checks: bad inputs are errors, a missing compiler says what to install.

Their results against the ops' numpy references are the "kernels" column of tests/graphs/test_op_walk.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.graphs.ops.examples import packed_step
from pagedgraph.graphs.ops.kv_cache_variants import paged_attention_typed
from pagedgraph.cpu_kernels import binding
from pagedgraph.cpu_kernels.build import KernelBuildError

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("kernel_library")]  # fails in CI, skips elsewhere without a compiler


def test_out_of_pool_indices_are_errors_not_writes() -> None:
    pool = np.zeros((32, 8), np.float32)
    row = np.ones((1, 8), np.float32)
    with pytest.raises(binding.KernelError, match=r"slot_mapping\[0\] = 32 is outside the pool of 32 slots"):
        binding.reshape_and_cache(row, row, pool, pool.copy(), np.array([32], np.int64))
    assert not pool.any()
    query = np.ones((1, 16), np.float32)
    with pytest.raises(binding.KernelError, match=r"block_tables\[0, 0\] = 9 is outside the pool of 2 blocks"):
        binding.paged_attention(query, pool, pool, np.array([[9]], np.int32), np.array([1], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, head_dim=8, qk_scale=1.0,
                                block_size=16)
    with pytest.raises(binding.KernelError, match=r"head_dim 12 must be a positive multiple of 8"):
        binding.paged_attention(np.ones((1, 24), np.float32), np.zeros((32, 12), np.float32),
                                np.zeros((32, 12), np.float32), np.array([[1]], np.int32), np.array([1], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, head_dim=12, qk_scale=1.0,
                                block_size=16)
    with pytest.raises(binding.KernelError, match=r"context_lens\[0\] = 17 must cover its 1 queries and fit 1 blocks"):
        binding.paged_attention(query, pool, pool, np.array([[1]], np.int32), np.array([17], np.int32),
                                np.array([0, 1], np.int32), head_num=2, kv_head_num=1, head_dim=8, qk_scale=1.0,
                                block_size=16)


def test_missing_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from pagedgraph.cpu_kernels import build, cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(KernelBuildError, match=r"no C\+\+ compiler found .*apt-get install g\+\+"):
        build.library_path()


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 96), (4, 4, 8)])
def test_int8_decode_rows_at_the_extremes_equal_the_reference(heads: int, kv_heads: int, head_dim: int) -> None:
    """int8 decode rows (on AVX-512 VNNI: integer dot products of a query quantized in levels against keys
    read unsigned) equal dequantize-then-float32 attention where that form is most fragile: keys at -128 and
    127, channel scales and offsets 1,000x apart, a query with one outlier channel and a head of zeros,
    head_dim a whole, a partial and less than one 64-byte line, GQA groups of 3, 4 and 1, and decodes long
    enough to be split across threads next to short ones, with null-block padding."""
    rng = np.random.default_rng(heads * head_dim)
    width = kv_heads * head_dim
    context = [1000, 37, 1, 16, 300]
    query, k_f, v_f, tables, context_lens, cu = packed_step(
        rng, [1] * len(context), context, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=16,
        max_blocks=63, pad_seqs=2, pad_tokens=2)
    query[:, 5] *= 40.0
    query[1, :head_dim] = 0.0
    k_cache = rng.integers(-128, 128, k_f.shape).astype(np.int8)
    k_cache[::7] = 127
    k_cache[3::7] = -128
    v_cache = rng.integers(-128, 128, v_f.shape).astype(np.int8)
    scales = [(10.0 ** rng.uniform(-3, 0, width)).astype(np.float32) for _ in "kv"]
    offsets = [rng.integers(-128, 128, width).astype(np.int32) for _ in "kv"]
    attrs = dict(head_num=heads, kv_head_num=kv_heads, head_dim=head_dim, qk_scale=head_dim ** -0.5, block_size=16)
    inputs = (query, k_cache, v_cache, tables, context_lens, cu, scales[0], offsets[0], scales[1], offsets[1])
    want = paged_attention_typed(*inputs, **attrs)
    got = binding.paged_attention(*inputs, **attrs)
    # Outputs reach ~200 here: float32's own rounding differs by ~1e-4 near such values (the reference's from
    # exact is 5e-7 of the largest), so the bound is relative to it; one query level too few is 100x over.
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=1e-4)
