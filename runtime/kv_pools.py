"""The per-layer K/V pools: the one owner of their memory, their size and block copies.

Every executor wraps these arrays once (an OrtValue, a MindSpore Tensor, both without a copy) and
its graphs write them in place; the engine sizes them (`pool_blocks`) and runs the copy-on-write block
copies on them between steps (a draft that shares them, runtime/spec/draft.py, also while it proposes). The
KV cache manager only hands out block ids into them.
"""
from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..artifact.manifest import Manifest
from ..graphs import contract as c
from ..graphs import kv_cache


def bytes_per_block(manifest: Manifest, kv_cache_dtype: str = "auto") -> int:
    """One block's K and V in every layer, in the cache dtype: what each block of the budget costs."""
    model = manifest.model
    return kv_cache.bytes_per_block(manifest.kv_cache_dtype(kv_cache_dtype), model.num_layers, manifest.block_size,
                                    model.kv_size)


def _zeroed_pool(shape: tuple[int, int], dtype: np.dtype) -> np.ndarray:
    """A zeroed pool whose pages become resident block by block, as they are written: an anonymous mapping with
    transparent huge pages off. numpy asks for huge pages on its large allocations, so a 12 KiB block written could
    make 2 MiB resident, and the pool's resident bytes followed the kernel's page policy, not the blocks in use."""
    region = mmap.mmap(-1, max(1, shape[0] * shape[1] * np.dtype(dtype).itemsize))
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux
        region.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(region, dtype, shape[0] * shape[1]).reshape(shape)


class KVPools(Mapping[str, np.ndarray]):
    """`k_cache_<l>`/`v_cache_<l>` -> [num_blocks * block_size, kv_heads * head_dim], zero-initialised.

    Zeroed because NaN/Inf in never-written rows (the null block, block tails) would poison real
    rows through 0 * NaN in the attention's P.V product, even under the mask.

    With tensor parallelism each rank's pools hold only its KV heads ([num_slots, kv_size / ranks], `rank(r)`),
    every rank's blocks under the same ids; the Mapping is rank 0's.
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
        self.ranks = manifest.tensor_parallel_size
        self._ranks = [{name: _zeroed_pool((self.num_slots, model.kv_size // self.ranks), self.dtype)
                        for name in c.cache_names(model.num_layers)} for _ in range(self.ranks)]
        self._arrays = self._ranks[0]

    @classmethod
    def sized(cls, artifact: Path, manifest: Manifest, kv_cache_dtype: str, max_model_len: int, max_num_seqs: int,
              num_blocks: int | None = None, kv_cache_bytes: int | None = None) -> "KVPools":
        """Pools of `pool_blocks`' size: num_blocks, else kv_cache_bytes, else every sequence at max_model_len within
        the memory left free after the artifact's weights."""
        request = PoolRequest(bytes_per_block(manifest, kv_cache_dtype), manifest.block_size, max_model_len,
                              max_num_seqs, num_blocks, kv_cache_bytes, weights_bytes(artifact))
        return cls(manifest, pool_blocks(request), kv_cache_dtype)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def rank(self, rank: int) -> Mapping[str, np.ndarray]:
        """Rank `rank`'s pools (tensor parallelism; rank 0's are this Mapping's)."""
        return self._ranks[rank]

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
        for pool in (pool for arrays in self._ranks for pool in arrays.values()):
            blocks = pool.reshape(self.num_blocks, self.block_size, pool.shape[1])
            blocks[dst] = blocks[src]


# The share of the memory left free after the weights that a pool of the default size may take: the rest is for
# activations, the tokenizer and whatever else runs on the machine. A pool costs only the pages written (its zero
# pages are mapped on first write), so the share bounds what a full pool may grow to, not what loading takes.
KV_MEMORY_SHARE = 0.5
GIB = 1 << 30


class PoolSizeError(ValueError):
    """The KV pool cannot hold one sequence of max_model_len: raised when the engine starts, before any request."""


@dataclass(frozen=True)
class PoolRequest:
    """What sizes the pool: an explicit setting wins (num_blocks, else kv_cache_bytes); without one the pool holds
    every sequence the scheduler may run at full length, capped to KV_MEMORY_SHARE of the memory left free after the
    weights (vLLM-CPU sizes its pool from the machine's memory the same way unless VLLM_CPU_KVCACHE_SPACE is set)."""

    bytes_per_block: int
    block_size: int
    max_model_len: int
    max_num_seqs: int
    num_blocks: int | None = None
    kv_cache_bytes: int | None = None
    weights_bytes: int = 0  # still to be loaded: what the free memory loses before the pool may have it

    @property
    def blocks_per_sequence(self) -> int:
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def full_blocks(self) -> int:
        """Every sequence the scheduler may run at full length, plus the null block: the default pool's size."""
        return self.max_num_seqs * self.blocks_per_sequence + 1

    @property
    def min_blocks(self) -> int:
        """One sequence of max_model_len, plus the null block."""
        return self.blocks_per_sequence + 1


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def free_memory_bytes() -> int:
    """Memory this process may still take: the kernel's MemAvailable, capped by the cgroup's limit where one is set
    (a container's memory.max is often far below the machine's)."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        with open("/proc/meminfo") as meminfo:
            free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def pool_blocks(request: PoolRequest, free_bytes: int | None = None) -> int:
    """The pool's size in blocks; PoolSizeError, naming the setting, the figure needed and the fix, when it cannot
    hold one max_model_len sequence or does not fit the memory left after the weights. `free_bytes`: default
    free_memory_bytes()."""
    r, need = request, request.min_blocks
    need_bytes = need * r.bytes_per_block
    free = (free_memory_bytes() if free_bytes is None else free_bytes) - r.weights_bytes
    left = f"{_mib(max(free, 0))} is left free after the weights ({_mib(r.weights_bytes)})"

    def lower(blocks: int) -> str:
        return (f"or lower max_model_len (scheduler.max_model_len) from {r.max_model_len} to at most "
                f"{max(0, blocks - 1) * r.block_size} tokens")

    if r.num_blocks is not None or r.kv_cache_bytes is not None:
        if r.num_blocks is not None:
            blocks, setting, unit = r.num_blocks, f"num_blocks = {r.num_blocks} (kv_cache.num_blocks, --num-blocks)", 1
        else:
            blocks = r.kv_cache_bytes // r.bytes_per_block
            setting = f"kv_cache_bytes = {r.kv_cache_bytes} (kv_cache.kv_cache_bytes, --kv-cache-bytes)"
            unit = r.bytes_per_block
        name = setting.split(" = ")[0]
        if blocks < need:
            raise PoolSizeError(
                f"{setting} holds {blocks} blocks of {r.block_size} tokens ({r.bytes_per_block} bytes each), but "
                f"max_model_len {r.max_model_len} needs {need} with the null block ({_mib(need_bytes)}): set {name} "
                f"to at least {need * unit}, " + lower(blocks))
        if blocks * r.bytes_per_block > free:
            raise PoolSizeError(f"{setting} asks for {_mib(blocks * r.bytes_per_block)} of KV pool, but {left}: "
                                f"lower {name} (at least {need * unit} for max_model_len {r.max_model_len}), or "
                                f"free memory")
        return blocks
    blocks = min(r.full_blocks, int(KV_MEMORY_SHARE * max(free, 0)) // r.bytes_per_block)
    if blocks >= need:
        return blocks
    if need_bytes <= free:  # past the share, but one full sequence still fits: serve it rather than refuse
        return need
    raise PoolSizeError(
        f"the KV pool's default size follows the free memory: {left}, but max_model_len {r.max_model_len} needs "
        f"{need} blocks of {r.bytes_per_block} bytes ({_mib(need_bytes)}); free memory, use a smaller kv_cache.dtype "
        f"the artifact has (--kv-cache-dtype), " + lower(max(free, 0) // r.bytes_per_block))


def weights_bytes(artifact: Path) -> int:
    """The artifact's weight files: what loading maps (and prepacking may copy); every rank's with tensor
    parallelism (the simulation loads them all)."""
    graphs = Path(artifact) / "graphs"
    return sum(p.stat().st_size for pattern in ("*.bin", "rank*/*.bin") for p in graphs.glob(pattern))
