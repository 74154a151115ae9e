"""The C++ kernels' own checks: bad inputs are errors, a missing compiler says what to install.

Their results against the ops' numpy references are the "kernels" column of tests/graphs/test_op_walk.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.kernels import binding
from pagedgraph.kernels.build import KernelBuildError

pytestmark = pytest.mark.usefixtures("kernel_library")  # fails in CI, skips elsewhere without a compiler


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
    from pagedgraph.kernels import build, cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))  # nothing built there yet
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(KernelBuildError, match=r"no C\+\+ compiler found .*apt-get install g\+\+"):
        build.library_path()
