"""The per-layer K/V pools: the one owner of their memory, their size and block copies.

Every executor wraps these arrays once (an OrtValue, a MindSpore Tensor, both without a copy) and
its graphs write them in place; the engine sizes them from a memory budget and runs the
copy-on-write block copies on them between steps. The KV cache manager only hands out block ids
into them.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from ..artifact.manifest import Manifest
from ..graphs import contract as c
from ..graphs import kv_cache


def bytes_per_block(manifest: Manifest, kv_cache_dtype: str = "auto") -> int:
    """One block's K and V in every layer, in the cache dtype: what each block of the budget costs."""
    model = manifest.model
    return kv_cache.bytes_per_block(manifest.kv_cache_dtype(kv_cache_dtype), model.num_layers, manifest.block_size,
                                    model.kv_size)


class KVPools(Mapping[str, np.ndarray]):
    """`k_cache_<l>`/`v_cache_<l>` -> [num_blocks * block_size, kv_heads * head_dim], zero-initialised.

    Zeroed because NaN/Inf in never-written rows (the null block, block tails) would poison real
    rows through 0 * NaN in the attention's P.V product, even under the mask.
    """

    def __init__(self, manifest: Manifest, num_blocks: int, kv_cache_dtype: str = "auto") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks}: need at least 2 (block 0 is the null block); "
                             f"raise num_blocks or kv_cache_bytes")
        self.num_blocks = num_blocks
        self.block_size = manifest.block_size
        # What the pools hold ("auto": the compute dtype); the artifact must have that dtype's graphs.
        self.kv_cache_dtype = manifest.kv_cache_dtype(kv_cache_dtype)
        self.format = kv_cache.cache_format(self.kv_cache_dtype)
        self.dtype = self.format.numpy_dtype
        self.bytes_per_block = bytes_per_block(manifest, self.kv_cache_dtype)
        model = manifest.model
        self._arrays = {name: np.zeros((self.num_slots, model.kv_size), self.dtype)
                        for name in c.cache_names(model.num_layers)}

    @classmethod
    def for_budget(cls, manifest: Manifest, budget_bytes: int, kv_cache_dtype: str = "auto") -> "KVPools":
        """As many blocks of `kv_cache_dtype` as `budget_bytes` holds (at least 2)."""
        return cls(manifest, max(2, budget_bytes // bytes_per_block(manifest, kv_cache_dtype)), kv_cache_dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every pool (copy-on-write); touches only those rows."""
        if not pairs:
            return
        src, dst = (np.array(side, np.int64) for side in zip(*pairs))
        for pool in self._arrays.values():
            blocks = pool.reshape(self.num_blocks, self.block_size, pool.shape[1])
            blocks[dst] = blocks[src]
