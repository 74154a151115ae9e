"""Structured output: constraints compiled by llguidance, one matcher per sequence, token masks in the sampler.

A request's `Constraint` (a JSON schema, any JSON object, a regex, a choice, a GBNF/Lark grammar) is
compiled once per distinct constraint against the model's tokenizer (`GrammarCompiler`, an LRU cache):
a bad constraint is a `RequestError` naming the request field, before anything is queued. The sampler's
`StructuredOutputs` processor then keeps one matcher per constrained sequence (an n > 1 fork rebuilds its
own) and, per step, computes the masks of the rows being sampled only (chunked prefill's unsampled rows
never reach it) into the sampler's copies of those rows: the executor's logits stay untouched, so
logprobs report the model's distribution, and a batch without constraints pays nothing. Preemption
keeps a sequence's output tokens, and so its matcher.

llguidance was chosen over xgrammar on this model's vocabulary; the figures are in docs/performance.md.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence as Seq

import numpy as np

from .constraints import Constraint
from .sampling_params import RequestError

if TYPE_CHECKING:
    import llguidance

    from .scheduler import Sequence
    from .tokenizer import Tokenizer

# JSON is written on one line with the standard separators and no free whitespace: a small model
# given free whitespace tends to emit newlines until max_tokens cuts the document off.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256


def _grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of `constraint`; raises ValueError with the compiler's message."""
    import llguidance
    from llguidance.gbnf_to_lark import any_to_lark

    matcher = llguidance.LLMatcher
    kind, spec = constraint.kind, constraint.spec
    if kind in ("json", "json_object"):
        options: dict[str, Any] = {**JSON_OPTIONS, "lenient": not constraint.strict}
        if constraint.whitespace_pattern is not None:
            options.update(whitespace_flexible=True, whitespace_pattern=constraint.whitespace_pattern)
        return matcher.grammar_from_json_schema(spec if kind == "json" else '{"type": "object"}', defaults=options)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(spec)))
    if kind == "grammar":
        try:
            lark = any_to_lark(spec)
        except Exception as exc:  # its GBNF converter raises bare Exceptions
            raise ValueError(str(exc)) from None
        return matcher.grammar_from_lark(lark)
    if kind == "lark":
        return matcher.grammar_from_lark(spec)
    raise ValueError(f"unknown constraint kind {kind!r}")


class GrammarCompiler:
    """Constraints -> validated llguidance matchers in their start state, cached (LRU) per constraint.

    Thread-safe: the server compiles on its tokenizer thread (so a bad constraint is refused before it
    is queued, and a large schema never stalls the engine), the engine then finds it cached.
    """

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int, capacity: int = CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the LM head's width; a padded head's extra ids are never allowed
        self.capacity = capacity
        self._cache: OrderedDict[Constraint, "llguidance.LLMatcher"] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: "llguidance.LLTokenizer | None" = None
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self) -> "llguidance.LLTokenizer":
        """Built on first use (0.24 s on a 49k vocabulary, docs/performance.md), so unconstrained deployments never pay it."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, constraint: Constraint) -> "llguidance.LLMatcher":
        """A fresh matcher for `constraint`; raises RequestError naming `constraint.field` if it is invalid."""
        with self._lock:
            template = self._cache.get(constraint)
            if template is not None:
                self._cache.move_to_end(constraint)
                self.hits += 1
                return template.deep_copy()
        template = self._build(constraint)
        with self._lock:  # copies are made under the lock: a template is never read by two threads at once
            self.misses += 1
            self._cache[constraint] = template
            self._cache.move_to_end(constraint)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
            return template.deep_copy()

    def _build(self, constraint: Constraint) -> "llguidance.LLMatcher":
        import llguidance

        tokenizer = self.ll_tokenizer
        try:
            grammar = _grammar_text(constraint)
        except ValueError as exc:
            raise RequestError(constraint.field, f"invalid {_WHAT[constraint.kind]}: {exc}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if failed:
            raise RequestError(constraint.field, f"invalid {_WHAT[constraint.kind]}: {messages[0]}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(constraint.field, f"invalid {_WHAT[constraint.kind]}: {matcher.get_error()}")
        return matcher


_WHAT = {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar", "lark": "tool-call grammar"}


@dataclass
class GrammarState:
    """One sequence's matcher; `complete`: nothing but EOS may follow; `error`: the grammar rejected a token."""

    matcher: "llguidance.LLMatcher"
    complete: bool = False
    error: str | None = None


class StructuredOutputs:
    """The sampler's grammar-mask processor (runtime/logits_processors.py): one matcher per constrained sequence.

    A sequence's matcher lives in `seq.processor_state["structured_output"]`: made by `start` when the request
    is added, or, for an n > 1 fork, from its constraint and the tokens it copied. The mask buffers grow to
    the most constrained rows of one step and are reused after.
    """

    name = "structured_output"

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._executor: "llguidance.LLExecutor | None" = None
        self._words = -(-compiler.vocab_size // 32)
        self._bitmask = np.empty((0, self._words), np.int32)
        self._bias = np.empty((0, self._words * 4, 8), np.float32)

    def start(self, seq: "Sequence") -> None:
        """Compile (or find cached) `seq`'s constraint; raises RequestError naming the field if it is invalid."""
        constraint = seq.params.structured_outputs
        assert constraint is not None
        seq.processor_state[self.name] = GrammarState(self.compiler.compile(constraint))

    def state(self, seq: "Sequence") -> GrammarState:
        state = seq.processor_state.get(self.name)
        if state is None:  # a fork: same constraint, the tokens it copied
            self.start(seq)
            state = seq.processor_state[self.name]
            if not state.matcher.consume_tokens(seq.output_token_ids):
                state.error = f"structured output: the grammar rejected the output: {state.matcher.get_error()}"
        return state

    def wants(self, seq: "Sequence") -> bool:
        return seq.params.structured_outputs is not None

    def apply(self, rows: np.ndarray, seqs: Seq["Sequence"]) -> None:
        mine = [j for j, seq in enumerate(seqs) if self.wants(seq)]
        if not mine:
            return
        count = len(mine)
        if self._bitmask.shape[0] < count:
            self._bitmask = np.empty((count, self._words), np.int32)
            self._bias = np.empty((count, self._words * 4, 8), np.float32)
        if self._executor is None:
            import llguidance
            self._executor = llguidance.LLExecutor()
        bitmask, bias = self._bitmask[:count], self._bias[:count]
        work = [(self.state(seqs[j]).matcher, k) for k, j in enumerate(mine)]
        self._executor.unsafe_compute_mask_ptr(work, bitmask.ctypes.data, self._words * 4, count)
        # Adding 0 or -inf (looked up per mask byte) costs the same for any mask; a masked assignment
        # branches per token and is 10-30x slower on a dense mask.
        np.take(_BYTE_BIAS, bitmask.view(np.uint8), axis=0, out=bias)
        width = rows.shape[1]
        flat = bias.reshape(count, -1)[:, :width]
        if count == rows.shape[0]:
            np.add(rows, flat, out=rows)
        else:
            for k, j in enumerate(mine):
                np.add(rows[j], flat[k], out=rows[j])

    def valid_prefix(self, seq: "Sequence", tokens: list[int]) -> int:
        """How many of `tokens` the grammar would take in turn from here (speculative drafts; nothing consumed)."""
        state = self.state(seq)
        return 0 if state.error is not None or state.complete else state.matcher.validate_tokens(tokens)

    def rollback(self, seq: "Sequence", count: int) -> None:
        """Undo the last `count` accepted tokens (speculative verification looks ahead, then replays)."""
        state = self.state(seq)
        state.matcher.rollback(count)
        state.complete = state.matcher.is_stopped()

    def accepted(self, seq: "Sequence", token: int) -> None:
        state = self.state(seq)
        if state.error is None and not state.matcher.consume_token(token):
            state.error = f"structured output: the grammar rejected token {token}: {state.matcher.get_error()}"
        state.complete = state.matcher.is_stopped()


def _byte_bias() -> np.ndarray:
    """mask byte -> the logit bias of its 8 tokens (least significant bit first): 0 allowed, -inf not."""
    values = np.arange(256, dtype=np.uint16)[:, None]
    return np.where((values >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


_BYTE_BIAS = _byte_bias()
