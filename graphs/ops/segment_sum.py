"""SegmentSum: each sequence's rows of the packed stream summed (mean pooling's numerator).

An embedding graph with mean pooling (graphs/decoder.py, ModelConfig.pooling) returns, per sequence, the sum of
the final norm's rows it fed in this step: sequence b owns rows cu_seqlens_q[b] : cu_seqlens_q[b + 1], padding
sequences own none (a zero row), padding tokens after the last sequence belong to none. A chunked prompt's sums are
added by the runtime across its steps and divided by its length there (runtime/pooling.py), so the graph stays the
one every step runs. vLLM's MeanPool does the same over its packed hidden states.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from .examples import normal
from .op import Example, Op, Tensor


def segment_sum(x: np.ndarray, cu_seqlens_q: np.ndarray) -> np.ndarray:
    sums = np.zeros((len(cu_seqlens_q) - 1, x.shape[1]), np.float64)
    for b, (start, end) in enumerate(zip(cu_seqlens_q[:-1], cu_seqlens_q[1:])):
        sums[b] = x[start:end].sum(axis=0, dtype=np.float64)
    return sums.astype(np.float32)


def _examples() -> Iterator[Example]:
    """Sequences of one row and many, padding sequences (empty ranges) and padding tokens after the last."""
    rng = np.random.default_rng(0)
    for lengths, pad_seqs, pad_tokens, width in (([1], 0, 0, 8), ([3, 1, 7], 2, 5, 16), ([64, 200, 1, 35], 1, 12, 64),
                                                 ([1, 1, 1, 1], 0, 0, 576)):
        cu = np.concatenate([[0], np.cumsum(lengths), np.full(pad_seqs, sum(lengths))]).astype(np.int32)
        x = normal(rng, sum(lengths) + pad_tokens, width)
        yield Example((x, cu), {}, atol=1e-4, rtol=1e-5,
                      label=f"{len(lengths)} sequences of {lengths}, {pad_seqs} padding, {pad_tokens} padding tokens")


SEGMENT_SUM = Op(
    name="SegmentSum",
    atb="none: mean pooling's per-sequence row sum over cu_seqlens_q (vLLM's MeanPool)",
    inputs=(Tensor("x", ("T", "W")), Tensor("cu_seqlens_q", ("B_plus_1",), ("int32",))),
    outputs=(Tensor("sums", ("B_plus_1 - 1", "W")),),
    reference=segment_sum,
    examples=_examples,
    doc="each sequence's rows of the packed stream summed: an embedding graph's mean-pooling head",
)
