"""The pooler: an embedding artifact's pooled rows -> each request's vector (vLLM's pooler, after the graph).

The graph (graphs/decoder.py, `pooled_rows`) returns one row per sequence of a step: the final norm's row of the
last token it fed (last pooling) or the sum of the rows it fed (mean pooling). A prompt fed in chunks keeps the
row of the step that ends it (last) or adds its steps' sums (mean; a chunk from position 0 starts the sum again,
as a prompt recomputed after preemption does); then the vector is divided by the prompt's length (mean), cut to
the request's `dimensions` (Matryoshka) and L2-normalised, as vLLM does.
"""
from __future__ import annotations

import numpy as np

from ..graphs.config import Pooling
from .pooling_params import PoolingParams
from .scheduler import ScheduledBatch, Sequence


class Pooler:
    """Pooled rows -> each request's vector, for one artifact's pooling head."""

    def __init__(self, pooling: Pooling) -> None:
        self.pooling = pooling

    def pool(self, batch: ScheduledBatch, rows: np.ndarray) -> list[Sequence]:
        """Take a step's rows (a view of the graph's output, valid until the next step) into its sequences' pooled
        state and advance them; the sequences whose prompt is now fed, each holding its vector in `pooled`."""
        done = []
        for seq, n, row in zip(batch.seqs, batch.num_tokens, rows):
            if seq.pooled is None:  # the request's one buffer, written in place by its later chunks
                seq.pooled = row.astype(np.float32, copy=True)
            elif self.pooling.type == "last" or seq.num_computed_tokens == 0:
                seq.pooled[:] = row
            else:
                seq.pooled += row
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                assert seq.pooling is not None
                seq.pooled = self.vector(seq.pooled, seq.num_tokens, seq.pooling)
                done.append(seq)
        return done

    def vector(self, pooled: np.ndarray, num_tokens: int, params: PoolingParams) -> np.ndarray:
        """The request's embedding from its pooled state once its whole prompt is fed."""
        vector = pooled / num_tokens if self.pooling.type == "mean" else pooled
        if params.dimensions is not None:
            vector = vector[:params.dimensions]
        if self.pooling.normalize:
            vector = vector / max(float(np.linalg.norm(vector)), 1e-12)  # as torch's F.normalize
        return vector.astype(np.float32, copy=False)
