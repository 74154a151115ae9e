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

from .logits_processors import LogitsProcessor
from .scheduler import Sequence


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def sample_row(row: np.ndarray, seq: Sequence, scaled: np.ndarray | None = None) -> int:
    """One token from `row` under the request's temperature, top_k, min_p and top_p (vLLM's order).

    `scaled` (float64, the row's size) is the caller's scratch: the whole-vocabulary work happens in
    it, and only the candidates a truncation keeps (top_k, min_p, the top_p nucleus) get sorted, so
    a plain temperature draw sorts nothing and allocates nothing.
    """
    params = seq.params
    if params.greedy:
        return int(np.argmax(row))
    assert seq.rng is not None
    top_k = params.top_k if 0 < params.top_k < row.size else 0
    if top_k and params.min_p == 0:  # only the top_k logits matter: nothing over the whole vocabulary but one pass
        best = np.argpartition(row, -top_k)[-top_k:]
        return _draw(best, np.exp((row[best].astype(np.float64) - row[best].max()) / params.temperature),
                     None, params.top_p, seq.rng)
    probs = np.empty(row.size, np.float64) if scaled is None else scaled
    np.multiply(row, 1.0 / params.temperature, out=probs)
    probs -= probs.max()
    np.exp(probs, out=probs)  # unnormalized; the top token's is 1
    if not (top_k or params.min_p > 0 or params.top_p < 1.0):
        np.cumsum(probs, out=probs)
        return int(np.searchsorted(probs, seq.rng.random() * probs[-1], side="right"))
    candidates = None
    if params.min_p > 0:  # against the top token's probability (1 here), then top_k among what is left
        candidates = np.flatnonzero(probs >= params.min_p)
        if top_k and candidates.size > top_k:
            candidates = candidates[np.argpartition(probs[candidates], -top_k)[-top_k:]]
    kept = None  # the mass top_p is a share of: all the candidates', unless they are only a top-m subset
    if candidates is None:  # top_p alone: widen a top-m set until it holds the nucleus, then sort only it
        kept, m = probs.sum(), 64
        while True:
            candidates = np.argpartition(probs, -m)[-m:] if m < probs.size else np.arange(probs.size)
            if m >= probs.size or probs[candidates].sum() >= params.top_p * kept:
                break
            m *= 8
    return _draw(candidates, probs[candidates], kept, params.top_p, seq.rng)


def _draw(candidates: np.ndarray, weights: np.ndarray, kept: float | None, top_p: float,
          rng: np.random.Generator) -> int:
    """One of `candidates` (unnormalized `weights`), within the top_p nucleus of `kept` (None: their own sum)."""
    by_weight = np.argsort(weights)[::-1]
    order, mass = candidates[by_weight], np.cumsum(weights[by_weight])
    if top_p < 1.0:
        keep = int(np.searchsorted(mass, top_p * (mass[-1] if kept is None else kept)) + 1)
        order, mass = order[:keep], mass[:keep]
    return int(order[np.searchsorted(mass, rng.random() * mass[-1], side="right")])


class Sampler:
    """One token per row; `processors` run in order on the rows that want them (append to extend)."""

    def __init__(self, vocab_size: int, processors: Seq[LogitsProcessor] = ()) -> None:
        self.vocab_size = vocab_size
        self.processors: list[LogitsProcessor] = list(processors)
        self.seconds: dict[str, float] = {p.name: 0.0 for p in self.processors}  # cumulative, per processor
        self._rows = np.empty((0, vocab_size), np.float32)  # grown once to the most processed rows of a step
        self._scaled = np.empty(vocab_size, np.float64)  # sample_row's scratch

    def add(self, processor: LogitsProcessor) -> None:
        self.processors.append(processor)
        self.seconds.setdefault(processor.name, 0.0)

    def sample(self, logits: np.ndarray, seqs: list[Sequence]) -> list[int]:
        processed = [i for i, s in enumerate(seqs) if self.wants(s)] if self.processors else []
        if not processed:
            if all(s.params.greedy for s in seqs):  # one vectorized argmax
                return np.argmax(logits, axis=1).tolist()
            return [sample_row(logits[i], s, self._scaled) for i, s in enumerate(seqs)]
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
        tokens = [sample_row(rows[slot[i]] if i in slot else logits[i], s, self._scaled) for i, s in enumerate(seqs)]
        for processor in self.processors:
            start = time.perf_counter()
            for seq, i in zip(chosen, processed):
                if processor.wants(seq):
                    processor.accepted(seq, tokens[i])
            self.seconds[processor.name] += time.perf_counter() - start
        return tokens

    def wants(self, seq: Sequence, ignoring: LogitsProcessor | None = None) -> bool:
        """Whether some logits processor (but `ignoring`) edits this sequence's rows."""
        for processor in self.processors:
            if processor is not ignoring and processor.wants(seq):
                return True
        return False


def top_logprobs(row: np.ndarray, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability plus the k most likely alternatives (model distribution)."""
    logp = _log_softmax(row.astype(np.float64))
    best = np.argpartition(logp, -k)[-k:] if k else np.empty(0, np.int64)
    return {int(t): float(logp[t]) for t in (token, *best.tolist())}
