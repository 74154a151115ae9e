"""The KV pools: sized from the cache dtype and a memory budget, zeroed, and block copies touch only their rows."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.graphs.config import ModelConfig
from pagedgraph.artifact.manifest import ArtifactError, Manifest
from pagedgraph.runtime.kv_pools import KVPools, bytes_per_block

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
    pools = KVPools.for_budget(manifest, 10 * bytes_per_block(manifest) + 1)
    assert pools.num_blocks == 10 and pools.bytes_per_block == bytes_per_block(manifest)
    assert sorted(pools) == [f"{kv}_cache_{layer}" for kv in "kv" for layer in range(3)]
    assert all(a.dtype == np.dtype(dtype) and a.shape == (10 * BLOCK, 16) for a in pools.values())
    assert pools.nbytes == sum(a.nbytes for a in pools.values())


def test_budget_below_two_blocks_still_gives_the_null_block_and_one_more() -> None:
    assert KVPools.for_budget(_manifest("float32"), 0).num_blocks == 2
    with pytest.raises(ValueError, match="num_blocks = 1: need at least 2"):
        KVPools(_manifest("float32"), 1)


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
