"""One request's state as it moves through the engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .prompt_logprobs import PromptLogprobs
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, cache position and block table of a request.

    `num_computed_tokens` counts tokens whose K/V are in the pool; the next step feeds
    tokens[num_computed_tokens : num_computed_tokens + chunk].
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # filled in prompt order while `wants_prompt_logprobs`
    first_scheduled_time: float | None = None  # perf_counter of the first step that fed it
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    rng: np.random.Generator | None = None
    # The sampler's logits processors keep what they track of this sequence here, by processor name.
    processor_state: dict[str, Any] = field(default_factory=dict)
    # Proposed tokens (speculative decoding) at the end of token_ids, fed with the last real token for the
    # target to verify; only within a step: runtime/spec/speculator.py adds them before scheduling and
    # removes them when the step's logits are in (or the sequence was not scheduled).
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.rng is None and not self.params.greedy:
            self.rng = np.random.default_rng(self.params.seed)
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no prefix to be predicted from

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True until every prompt token has its log-probability: until then each token fed needs a logits
        row of its own (the scheduler and packer make room) and the prefix cache is not read."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[self.num_tokens - self.num_draft_tokens:]

    @property
    def num_verified_tokens(self) -> int:
        """Tokens that are the sequence's own: the drafts excluded (only those may enter the prefix cache)."""
        return self.num_tokens - self.num_draft_tokens

    def set_drafts(self, draft: list[int]) -> None:
        self.drop_drafts()
        self.token_ids.extend(draft)
        self.num_draft_tokens = len(draft)

    def drop_drafts(self, keep: int = 0) -> None:
        """Remove the drafts after the first `keep`."""
        if self.num_draft_tokens > keep:
            del self.token_ids[self.num_tokens - self.num_draft_tokens + keep:]
            self.num_draft_tokens = keep

    @property
    def wants_token_rows(self) -> bool:
        """A logits row for every token fed this step: prompt logprobs, or drafts to verify."""
        return self.num_draft_tokens > 0 or self.wants_prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
