"""ReshapeAndCache: the KV-cache write, in place into one layer's pools."""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def reshape_and_cache(key: np.ndarray, value: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                      slot_mapping: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Write row t of key/value into slot slot_mapping[t] of the [num_slots, kv_heads*head_dim] pools.

    Padding tokens carry slots inside the null block (block 0), so the write is unconditional.
    Mutates and returns the pools, as ATB does.
    """
    k_cache[slot_mapping] = key
    v_cache[slot_mapping] = value
    return k_cache, v_cache


def _examples() -> Iterator[Example]:
    """Distinct real slots, then padding tokens that all write (identical rows) into the null block."""
    for seed, (real, width, slots) in enumerate(((3, 8, 64), (23, 192, 640))):
        rng = np.random.default_rng(seed)
        padding = 3
        key, value = normal(rng, real + padding, width), normal(rng, real + padding, width)
        key[real:], value[real:] = key[real], value[real]
        slot_mapping = np.concatenate([rng.choice(np.arange(16, slots), real, replace=False), np.zeros(padding, int)])
        yield Example((key, value, normal(rng, slots, width), normal(rng, slots, width), slot_mapping.astype(np.int64)),
                      {}, atol=0, rtol=0, label=f"{real} rows into {slots} slots")


RESHAPE_AND_CACHE = Op(
    name="ReshapeAndCache",
    atb="ReshapeAndCacheOperation",
    inputs=(Tensor("key", ("T", "W")), Tensor("value", ("T", "W")), Tensor("k_cache", ("num_slots", "W")),
            Tensor("v_cache", ("num_slots", "W")), Tensor("slot_mapping", ("T",), ("int64",))),
    outputs=(Tensor("k_cache_out", ("num_slots", "W")), Tensor("v_cache_out", ("num_slots", "W"))),
    reference=reshape_and_cache,
    examples=_examples,
    writes=((0, 2), (1, 3)),
    doc="writes the step's K/V rows into their slots; later readers use its outputs, so the write runs first",
)
