"""The KV pools: sized from the settings, the model and the free memory (or a clear error), zeroed, and block copies
touch only their rows."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.graphs.config import ModelConfig
from pagedgraph.artifact.manifest import ArtifactError, Manifest
from pagedgraph.runtime.kv_pools import KV_MEMORY_SHARE, KVPools, PoolRequest, PoolSizeError, bytes_per_block, pool_blocks

pytestmark = pytest.mark.unit
MODEL = ModelConfig("llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4,
                    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                    tie_word_embeddings=True)
BLOCK = 16


def _manifest(dtype: str) -> Manifest:
    return Manifest(MODEL, BLOCK, 64, dtype, {}, {})


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("float16", 2)])
def test_bytes_per_block_follow_the_cache_dtype(dtype: str, itemsize: int) -> None:
    manifest = _manifest(dtype)
    # K and V, 3 layers, 16 rows of 2 kv heads x 8 dims.
    assert bytes_per_block(manifest) == 2 * 3 * BLOCK * 16 * itemsize
    pools = KVPools(manifest, 10)
    assert pools.num_blocks == 10 and pools.bytes_per_block == bytes_per_block(manifest)
    assert sorted(pools) == [f"{kv}_cache_{layer}" for kv in "kv" for layer in range(3)]
    assert all(a.dtype == np.dtype(dtype) and a.shape == (10 * BLOCK, 16) for a in pools.values())
    assert pools.nbytes == sum(a.nbytes for a in pools.values())


def test_fewer_than_two_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="num_blocks = 1: need at least 2"):
        KVPools(_manifest("float32"), 1)


BLOCK_BYTES = 1 << 20
GIB = 1 << 30


def _request(max_model_len: int = 1000, max_num_seqs: int = 8, **settings: int) -> PoolRequest:
    return PoolRequest(BLOCK_BYTES, BLOCK, max_model_len, max_num_seqs, weights_bytes=2 * GIB, **settings)


def test_explicit_settings_win_num_blocks_first() -> None:
    assert pool_blocks(_request(num_blocks=100), free_bytes=64 * GIB) == 100
    assert pool_blocks(_request(kv_cache_bytes=100 * BLOCK_BYTES + 5), free_bytes=64 * GIB) == 100
    assert pool_blocks(_request(num_blocks=70, kv_cache_bytes=100 * BLOCK_BYTES), free_bytes=64 * GIB) == 70


def test_default_follows_the_model_and_the_free_memory() -> None:
    # 1000 tokens = 63 blocks of 16 per sequence; 8 sequences + the null block are all it can use.
    assert pool_blocks(_request(), free_bytes=64 * GIB) == 8 * 63 + 1
    assert pool_blocks(_request(max_num_seqs=64), free_bytes=64 * GIB) == 64 * 63 + 1
    # Less memory: the share of what the weights leave (10 GiB free - 2 GiB of weights), in 1 MiB blocks.
    assert pool_blocks(_request(max_num_seqs=128), free_bytes=10 * GIB) == int(KV_MEMORY_SHARE * 8 * 1024)
    # Below the share but one full sequence still fits: that sequence, not an error.
    assert pool_blocks(_request(), free_bytes=2 * GIB + 100 * BLOCK_BYTES) == 64


def test_a_pool_too_small_for_max_model_len_names_the_setting_the_figure_and_the_fix() -> None:
    with pytest.raises(PoolSizeError, match=r"num_blocks = 50 \(kv_cache.num_blocks, --num-blocks\) holds 50 blocks "
                                            r".* max_model_len 1000 needs 64 .* set num_blocks to at least 64, or "
                                            r"lower max_model_len \(scheduler.max_model_len\) .* to at most 784"):
        pool_blocks(_request(num_blocks=50), free_bytes=64 * GIB)
    with pytest.raises(PoolSizeError, match=r"kv_cache_bytes = 1048576 \(kv_cache.kv_cache_bytes, --kv-cache-bytes\)"
                                            r" .* set kv_cache_bytes to at least 67108864"):
        pool_blocks(_request(kv_cache_bytes=BLOCK_BYTES), free_bytes=64 * GIB)
    with pytest.raises(PoolSizeError, match=r"default size follows the free memory: 50 MiB is left free after the "
                                            r"weights \(2,048 MiB\), but max_model_len 1000 needs 64 blocks .* "
                                            r"\(64 MiB\); .* to at most 784 tokens"):
        pool_blocks(_request(), free_bytes=2 * GIB + 50 * BLOCK_BYTES)


def test_an_explicit_pool_larger_than_the_free_memory_is_refused() -> None:
    with pytest.raises(PoolSizeError, match=r"num_blocks = 5000 .* asks for 5,000 MiB of KV pool, but 2,048 MiB is "
                                            r"left free after the weights \(2,048 MiB\): lower num_blocks \(at least "
                                            r"64 for max_model_len 1000\)"):
        pool_blocks(_request(num_blocks=5000), free_bytes=4 * GIB)


def test_unknown_cache_dtype_names_the_value() -> None:
    with pytest.raises(ValueError, match="kv cache dtype 'float99': choose one of"):
        KVPools(_manifest("float99"), 4)
    with pytest.raises(ArtifactError, match=r"kv_cache.dtype = 'int8': .* re-export with int8"):
        KVPools(_manifest("float32"), 4, "int8")  # an artifact without that dtype's graphs


def test_pools_start_zeroed_and_copy_blocks_touches_only_the_destinations() -> None:
    pools = KVPools(_manifest("float32"), 6)
    assert not any(a.any() for a in pools.values())
    rng = np.random.default_rng(0)
    for a in pools.values():
        a[:] = rng.standard_normal(a.shape)
    before = {name: a.copy() for name, a in pools.items()}
    pools.copy_blocks([(1, 4), (2, 5)])
    for name, a in pools.items():
        expected = before[name].copy()
        expected[4 * BLOCK:5 * BLOCK] = before[name][1 * BLOCK:2 * BLOCK]
        expected[5 * BLOCK:6 * BLOCK] = before[name][2 * BLOCK:3 * BLOCK]
        np.testing.assert_array_equal(a, expected, err_msg=name)
    after = {name: a.copy() for name, a in pools.items()}
    pools.copy_blocks([])
    assert all(np.array_equal(a, after[name]) for name, a in pools.items())
