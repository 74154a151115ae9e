"""Linear in ATB's layout (weight [out, in], transposeB): one op, one function."""
from __future__ import annotations

import numpy as np


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    out = x @ weight.T
    if bias is not None:
        out = out + bias
    return out.astype(np.float32)
