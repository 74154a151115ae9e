"""Token selection from the LM-head rows: logits processors, greedy, temperature, min-p, top-k, top-p, seeds.

Rows of sequences that no logits processor wants are read in place (the executor's output, no copy);
only the others are copied into a buffer made once, edited there by the processors (penalties,
grammar masks) and chosen from. Log-probabilities are always the model's own (the unprocessed row),
as vLLM reports them by default.
"""
from __future__ import annotations

import time
from typing import Sequence as Seq

import numpy as np

from runtime.logits_processors import LogitsProcessor
from runtime.sequence import Sequence


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def sample_row(row: np.ndarray, seq: Sequence) -> int:
    params = seq.params
    if params.greedy:
        return int(np.argmax(row))
    scaled = row.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        candidates = np.argpartition(scaled, -params.top_k)[-params.top_k:]
    else:
        candidates = np.arange(scaled.size)
    order = candidates[np.argsort(scaled[candidates])[::-1]]
    probs = np.exp(scaled[order] - scaled[order[0]])  # probs[0] == 1: the top token
    if params.min_p > 0:  # probabilities relative to the top token's, so before normalizing
        keep = int(np.count_nonzero(probs >= params.min_p))
        order, probs = order[:keep], probs[:keep]
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    assert seq.rng is not None
    return int(order[seq.rng.choice(order.size, p=probs)])


class Sampler:
    """One token per row; `processors` run in order on the rows that want them (append to extend)."""

    def __init__(self, vocab_size: int, processors: Seq[LogitsProcessor] = ()) -> None:
        self.vocab_size = vocab_size
        self.processors: list[LogitsProcessor] = list(processors)
        self.seconds: dict[str, float] = {p.name: 0.0 for p in self.processors}  # cumulative, per processor
        self._rows = np.empty((0, vocab_size), np.float32)  # grown once to the most processed rows of a step

    def add(self, processor: LogitsProcessor) -> None:
        self.processors.append(processor)
        self.seconds.setdefault(processor.name, 0.0)

    def sample(self, logits: np.ndarray, seqs: list[Sequence]) -> list[int]:
        processed = [i for i, s in enumerate(seqs) if self._wanted(s)] if self.processors else []
        if not processed:
            if all(s.params.greedy for s in seqs):  # one vectorized argmax
                return np.argmax(logits, axis=1).tolist()
            return [sample_row(logits[i], s) for i, s in enumerate(seqs)]
        if len(processed) > self._rows.shape[0]:
            self._rows = np.empty((len(processed), self.vocab_size), np.float32)
        rows = self._rows[:len(processed)]
        chosen = [seqs[i] for i in processed]
        for j, i in enumerate(processed):
            np.copyto(rows[j], logits[i])
        for processor in self.processors:
            start = time.perf_counter()
            processor.apply(rows, chosen)
            self.seconds[processor.name] += time.perf_counter() - start
        slot = dict(zip(processed, range(len(processed))))
        tokens = [sample_row(rows[slot[i]] if i in slot else logits[i], s) for i, s in enumerate(seqs)]
        for processor in self.processors:
            start = time.perf_counter()
            for seq, i in zip(chosen, processed):
                if processor.wants(seq):
                    processor.accepted(seq, tokens[i])
            self.seconds[processor.name] += time.perf_counter() - start
        return tokens

    def _wanted(self, seq: Sequence) -> bool:
        for processor in self.processors:
            if processor.wants(seq):
                return True
        return False


def top_logprobs(row: np.ndarray, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability plus the k most likely alternatives (model distribution)."""
    logp = _log_softmax(row.astype(np.float64))
    best = np.argpartition(logp, -k)[-k:] if k else np.empty(0, np.int64)
    return {int(t): float(logp[t]) for t in (token, *best.tolist())}
