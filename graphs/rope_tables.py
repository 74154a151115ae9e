"""Rotary cos/sin tables, computed offline so every lowering only gathers rows by position."""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig, RopeScaling

ROPE_TABLES = ("rope_cos", "rope_sin")  # their graph weights


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths are slowed by `factor`, short ones kept, a smooth ramp between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    return np.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                    np.where(wavelen < high_wavelen, inv_freq, blended))


def rope_tables(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [max_positions, head_dim], halves duplicated (rotate-half layout)."""
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
