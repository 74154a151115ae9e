"""Per-request sampling settings, validated where they enter."""
from __future__ import annotations

import math

from dataclasses import dataclass, fields
from typing import Any


class RequestError(ValueError):
    """A request that cannot be served as given; `field` names the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # top-k logprobs reported per sampled token
    prompt_logprobs: int | None = None  # top-k logprobs per prompt token (vLLM's field); the first token has none

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("temperature", _number(self.temperature) and 0 <= self.temperature < math.inf, "must be a finite number >= 0"),
            ("top_p", _number(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "must be an integer >= -1 (0 or -1: off)"),
            ("seed", self.seed is None or (isinstance(self.seed, int) and self.seed >= 0), "must be an integer >= 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("n", isinstance(self.n, int) and self.n >= 1, "must be an integer >= 1"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
             "must be an integer in [0, 20]"),
            ("prompt_logprobs", self.prompt_logprobs is None or (
                isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20),
             "must be an integer in [0, 20]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise RequestError(name, f"{getattr(self, name)!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RequestError(unknown[0], f"unknown sampling field; known: {', '.join(sorted(known))}")
        return cls(**data)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

