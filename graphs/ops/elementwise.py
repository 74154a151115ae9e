"""Row-wise ops: RmsNorm, Rope, SwiGLU (numpy references, float32)."""
from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, epsilon: float) -> np.ndarray:
    """ATB RmsNormOperation: x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    variance = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(variance + np.float32(epsilon)) * weight).astype(np.float32)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int) -> np.ndarray:
    """ATB RopeOperation in rotate-half layout: x [T, n*head_dim], cos/sin [T, head_dim] per token."""
    t = x.shape[0]
    heads = x.reshape(t, -1, head_dim)
    half = head_dim // 2
    rotated = np.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
    out = heads * cos[:, None, :] + rotated * sin[:, None, :]
    return out.reshape(t, -1).astype(np.float32)


def swiglu(x: np.ndarray) -> np.ndarray:
    """ATB SwiGLU: x = [gate | up] along the last axis; silu(gate) * up."""
    gate, up = np.split(x, 2, axis=-1)
    return (gate / (1.0 + np.exp(-gate)) * up).astype(np.float32)
