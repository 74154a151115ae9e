"""ReshapeAndCache: the KV-cache write, in place into one layer's pools."""
from __future__ import annotations

import numpy as np


def reshape_and_cache(
    key: np.ndarray,
    value: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    slot_mapping: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Write row t of key/value into slot slot_mapping[t] of the [num_slots, kv_heads*head_dim] pools.

    Padding tokens carry slots inside the null block (block 0), so the write is unconditional.
    Mutates and returns the pools, as ATB does.
    """
    k_cache[slot_mapping] = key
    v_cache[slot_mapping] = value
    return k_cache, v_cache
