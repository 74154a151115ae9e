"""Sampled tokens -> what a request has produced: text, stop conditions and finish reasons, logprobs, timing
(vLLM v1's OutputProcessor).

The engine hands over each token it samples or verifies; the processor appends it, detokenizes it incrementally
(a detokenizer per sequence, made with its first token), checks EOS, stop tokens, stop strings, a grammar's end,
`max_tokens` and `max_model_len`, and says which finish reason the token caused. The engine then frees what the
sequence held. `output` turns a request's sequences (its `n` completions) into the `RequestOutput` callers see.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .prompt_logprobs import PromptLogprobs, prompt_logprob_entries
from .sampler import top_logprobs
from .scheduler import Sequence
from .structured_output import StructuredOutputs
from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestMetrics:
    """A finished request's timeline (perf_counter seconds), as vLLM's RequestOutput.metrics reports it."""

    arrival_time: float
    first_scheduled_time: float | None  # None: never ran (aborted while waiting)
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float
    inter_token_latencies: list[float]  # gap before each token after the first, per completion of the request

    @property
    def time_in_queue(self) -> float:
        return (self.first_scheduled_time or self.finished_time) - self.arrival_time


@dataclass
class CompletionOutput:
    """One of a request's `n` completions."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] = field(default_factory=list)
    outputs: list[CompletionOutput] = field(default_factory=list)  # all n; token_ids/text above are the first's
    prompt_logprobs: PromptLogprobs | None = None  # with SamplingParams.prompt_logprobs: one entry per prompt token
    metrics: RequestMetrics | None = None  # set once the request has finished

    @property
    def finished(self) -> bool:
        if self.outputs:
            return all(o.finish_reason is not None for o in self.outputs)
        return self.finish_reason is not None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, grammars: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.grammars = grammars
        self._detok: dict[Sequence, IncrementalDetokenizer] = {}

    def append(self, seq: Sequence, token: int, row: np.ndarray) -> str | None:
        """Append `token`, sampled from logits `row`; the finish reason it causes, or None (the sequence goes on).

        Before `min_tokens` the sampler masks EOS and stop_token_ids, and stop strings do not count (as in vLLM). A
        stop string cuts the text before it, and the bytes the detokenizer still holds lie past the cut."""
        now = time.perf_counter()
        if seq.last_token_time is None:
            seq.first_token_time = now
        else:
            seq.inter_token_latencies.append(now - seq.last_token_time)
        seq.last_token_time = now
        seq.token_ids.append(token)
        params = seq.params
        if params.logprobs is not None:
            seq.logprobs.append(top_logprobs(row, token, params.logprobs))
        grammar = self.grammars.state(seq) if params.structured_outputs is not None else None
        if grammar is not None and grammar.error is not None:
            seq.error = grammar.error
            return "error"
        generated = len(seq.token_ids) - seq.num_prompt_tokens
        if (token in params.stop_token_ids or (not params.ignore_eos and token in self.tokenizer.eos_token_ids)) \
                and generated >= params.min_tokens:
            return "stop"
        if self._text(seq, token, generated > params.min_tokens):
            return "stop"
        if grammar is not None and grammar.complete:  # nothing but EOS could follow
            return "stop"
        if generated >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _text(self, seq: Sequence, token: int, stops: bool) -> bool:
        """Detokenize `token` onto the text; True when a stop string (looked for if `stops`) ended it."""
        detok = self._detok.get(seq)
        if detok is None:
            detok = self._detok[seq] = self.tokenizer.detokenizer(skip_special_tokens=True)
        piece = detok.push(token)
        if not piece:
            return False
        seen = len(seq.text)
        seq.text += piece
        for stop in seq.params.stop if stops else ():
            at = seq.text.find(stop, max(0, seen - len(stop) + 1))
            if at >= 0:
                seq.text = seq.text[:at]
                del self._detok[seq]  # what it holds back lies past the cut
                return True
        return False

    def finish(self, seq: Sequence, reason: str) -> None:
        """Record the finish and complete the text with what the detokenizer held back."""
        seq.finish_reason = reason
        seq.finished_time = time.perf_counter()
        detok = self._detok.pop(seq, None)
        if detok is not None:
            seq.text += detok.flush()

    @staticmethod
    def prompt_logprobs(seq: Sequence, n: int, logits: np.ndarray, row: int, extra: int) -> None:
        """Append the entries of the prompt tokens this step's chunk of `n` tokens predicts.

        The chunk's positions s .. s+n-2 are at logits rows extra .. extra+n-2 and its last position at
        `row`; position p predicts token p+1. After a preemption the chunks start again at 0, so the
        positions whose entries are already there are skipped.
        """
        assert seq.prompt_logprobs is not None
        start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
        lo, hi = done - 1 - start, min(n, seq.num_prompt_tokens - 1 - start)
        if hi <= lo:
            return
        picks = [extra + i if i < n - 1 else row for i in range(lo, hi)]
        targets = seq.prompt_token_ids[start + lo + 1:start + hi + 1]
        seq.prompt_logprobs.extend(prompt_logprob_entries(logits[picks], targets, seq.params.prompt_logprobs))

    @staticmethod
    def output(group: list[Sequence]) -> RequestOutput:
        """A request's output from its sequences (the first, then its forks); `metrics` once all have finished."""
        first = group[0]
        completions = [CompletionOutput(i, s.output_token_ids, s.text, s.finish_reason, s.logprobs)
                       for i, s in enumerate(group)]
        done = all(s.finished for s in group)
        return RequestOutput(first.request_id, first.prompt_token_ids, first.output_token_ids, first.text,
                             first.finish_reason, next((s.error for s in group if s.error), None),
                             first.num_cached_tokens, first.logprobs, completions, first.prompt_logprobs,
                             _metrics(group) if done else None)


def _metrics(group: list[Sequence]) -> RequestMetrics:
    first = [s.first_token_time for s in group if s.first_token_time is not None]
    last = [s.last_token_time for s in group if s.last_token_time is not None]
    return RequestMetrics(group[0].arrival, group[0].first_scheduled_time, min(first, default=None),
                          max(last, default=None), max(s.finished_time or 0.0 for s in group),
                          [gap for s in group for gap in s.inter_token_latencies])
