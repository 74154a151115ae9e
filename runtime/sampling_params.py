"""Per-request sampling settings, validated where they enter."""
from __future__ import annotations

import math

from dataclasses import dataclass, fields
from typing import Any, Mapping

from .constraints import Constraint, ConstraintError
from .request_limits import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS

# OpenAI's range for logit_bias values; larger biases are clamped to it (as vLLM does).
LOGIT_BIAS_LIMIT = 100.0

# The one max_tokens policy, shared by `pagedgraph generate`, `LLM` / `SamplingParams` and the server: a request
# that leaves max_tokens out gets DEFAULT_MAX_TOKENS, capped to what max_model_len leaves after its prompt; one
# that asks for more than fits is refused (RequestError offline, 400 from the server), never cut silently.
DEFAULT_MAX_TOKENS = 256


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # the OpenAI error code of a request too long for max_model_len


class RequestError(ValueError):
    """A request that cannot be served as given; `field` names the culprit, `code` an OpenAI error code if any."""

    def __init__(self, field_name: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.code = code


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and how. The penalty fields follow OpenAI (presence, frequency, logit_bias) and vLLM
    (repetition_penalty, min_p, min_tokens); runtime/logits_processors.py applies them."""

    max_tokens: int | None = None  # None: the default policy (see DEFAULT_MAX_TOKENS)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # keep tokens with probability >= min_p * the top token's (0: off)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # EOS does not end the request (it is sampled like any token; stop_token_ids still stop)
    min_tokens: int = 0  # EOS and stop_token_ids are masked, and stop strings ignored, until this many tokens
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: positive logits divided by it, negative multiplied
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    n: int = 1
    logprobs: int | None = None  # top-k logprobs reported per sampled token
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (vLLM's field); the first token has none
    structured_outputs: Constraint | None = None  # the output must match it (runtime/structured_output.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.structured_outputs, dict):  # vLLM's StructuredOutputsParams fields (JSONL, Python API)
            try:
                object.__setattr__(self, "structured_outputs", Constraint.from_vllm(self.structured_outputs,
                                                                                   "structured_outputs"))
            except ConstraintError as exc:
                raise RequestError(exc.field, exc.problem) from None
        self._check_caps()
        checks = [
            ("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             "must be an integer >= 1"),
            ("temperature", _number(self.temperature) and 0 <= self.temperature < math.inf, "must be a finite number >= 0"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be an integer >= -1 (0 or -1: off)"),
            ("min_p", _number(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1] (0: off)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "must be an integer >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(_integer(t) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("ignore_eos", isinstance(self.ignore_eos, bool), "must be true or false"),
            ("min_tokens", _integer(self.min_tokens) and 0 <= self.min_tokens, "must be an integer >= 0"),
            ("min_tokens", not _integer(self.min_tokens) or not _integer(self.max_tokens)
             or self.min_tokens <= self.max_tokens,
             f"must be at most max_tokens = {self.max_tokens}"),
            ("presence_penalty", _number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "must be in [-2, 2] (0: off)"),
            ("frequency_penalty", _number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "must be in [-2, 2] (0: off)"),
            ("repetition_penalty", _number(self.repetition_penalty) and 0 < self.repetition_penalty,
             "must be a finite number > 0 (1: off)"),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("structured_outputs", self.structured_outputs is None or isinstance(self.structured_outputs, Constraint),
             "must be a Constraint or vLLM's structured_outputs fields ({\"json\": schema}, {\"regex\": ...}, ...)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(name, f"{getattr(self, name)!r} {rule}")

    def _check_caps(self) -> None:
        """runtime/request_limits.py's caps, before any rule that quotes the value."""
        counts = (("stop", len(self.stop), "stop strings", MAX_STOP),
                  ("stop_token_ids", len(self.stop_token_ids), "stop token ids", MAX_STOP_TOKEN_IDS),
                  ("logit_bias", len(self.logit_bias or ()), "entries", MAX_LOGIT_BIAS))
        for name, count, what, cap in counts:
            if count > cap:
                raise RequestError(name, f"{count:,} {what}; at most {cap:,} are accepted per request")
        longest = max((len(s) for s in self.stop if isinstance(s, str)), default=0)
        if longest > MAX_STOP_CHARS:
            raise RequestError("stop", f"a stop string of {longest:,} characters; at most {MAX_STOP_CHARS} are "
                                       "accepted")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether any logits-changing field is set (min_p is not one: it acts on the probabilities)."""
        return bool(self.min_tokens or self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids a request names must exist; the engine calls this where it knows the vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise RequestError(name, f"token id {bad} is out of range: this model's vocabulary has "
                                         f"{vocab_size} tokens, so ids must be in [0, {vocab_size})")

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, Any], **given: Any) -> "SamplingParams":
        """`given` (checked as by from_dict) over a model's generation defaults; defaults this version cannot
        apply (min_p, ...) are skipped, and max_tokens keeps its own policy."""
        known = {f.name for f in fields(cls)} - {"max_tokens"}
        return cls.from_dict({**{k: v for k, v in defaults.items() if k in known}, **given})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(unknown[0], f"unknown sampling field; known: {', '.join(sorted(known))}")
        return cls(**data)


def resolve_max_tokens(max_tokens: int | None, num_prompt: int, max_model_len: int,
                       default: int = DEFAULT_MAX_TOKENS) -> int:
    """How many tokens a request may generate under the one policy (see DEFAULT_MAX_TOKENS)."""
    room = max_model_len - num_prompt
    if max_tokens is None:
        return max(1, min(default, room))
    if max_tokens > room:
        raise RequestError("max_tokens", f"{max_tokens} with a prompt of {num_prompt} tokens exceeds this model's "
                                         f"max_model_len = {max_model_len}; ask for at most {room} tokens, or leave "
                                         f"max_tokens out (default: {default}, capped to the context left)",
                           CONTEXT_LENGTH_EXCEEDED)
    return max_tokens


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """Token id (an int, or its decimal string as JSON keys are) -> finite bias clamped to [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, Mapping):
        raise RequestError("logit_bias", f"{bias!r} must be an object mapping token ids to biases")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not _integer(token) or token < 0:
            raise RequestError("logit_bias", f"key {key!r} must be a token id (a non-negative integer)")
        if not _number(value):
            raise RequestError("logit_bias", f"{{{key!r}: {value!r}}}: the bias must be a finite number "
                                             f"(clamped to [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}])")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out
