"""`speculative_config` with vLLM's keys: one schema for the deployment YAML, `LLM(...)` and the CLI's JSON."""
from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from pydantic import Field, model_validator

from ...artifact.settings import ConfigError, Settings, shown, validate

Method = Literal["ngram", "draft_model"]


class SpeculativeConfig(Settings):
    method: Method = Field(description="`ngram`: prompt lookup, the tokens that followed the latest earlier occurrence "
                                       "of the longest suffix of the sequence's own tokens (prompt and output); "
                                       "`draft_model`: a smaller artifact with the same tokenizer proposes")
    num_speculative_tokens: int = Field(ge=1, description="K: tokens proposed per step, verified in one step with the "
                                                          "last real token (K+1 logits rows per sequence); at most "
                                                          "the prefill gears' rows minus one (`pagedgraph inspect` "
                                                          "shows it)")
    prompt_lookup_min: int | None = Field(None, ge=1, json_schema_extra=shown("5 (vLLM's)"),
                                          description="`ngram`: the shortest suffix that may match; one of the two "
                                                      "given sets both. `prompt_lookup_min: 1` lets the drafts' "
                                                      "record (below) decide whether single tokens are worth "
                                                      "drafting from")
    prompt_lookup_max: int | None = Field(
        None, ge=1, json_schema_extra=shown("5 (vLLM's)"),
        description="`ngram`: the longest suffix, tried first. The match goes on growing past it (up to 64 tokens) "
                    "while it still matches, to pick the right one of several earlier occurrences; and each draft's "
                    "length follows how many tokens the sequence's earlier drafts from matches of that length kept "
                    "(a 1-token match is a guess, a 20-token one a copy in progress): as many as pay for their "
                    "verification rows, none when a plain decode does better (`runtime/spec/ngram.py`)")
    model: str | None = Field(None, description="`draft_model`: the draft's artifact directory, e.g. the w4a16 export "
                                                "drafting for the fp32 one (below: which drafts run on the target's "
                                                "KV pools)")
    disable_by_batch_size: int | None = Field(
        None, ge=1, json_schema_extra=shown("unset"),
        description="set: every sequence speculates while at most this many run, none above (vLLM's rule); unset: "
                    "a speculating step holds at most max(8, K+1) tokens (one per running sequence plus the drafts, "
                    "shared out in arrival order), so at B=1 K drafts, at B=4 one each, from B=8 none: past a small "
                    "gear the step costs grow with its tokens")

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if self.method == "draft_model" and not self.model:
            raise ValueError("model: method draft_model needs the draft's artifact directory in `model`")
        if self.method == "ngram" and self.model:
            raise ValueError(f"model = {self.model!r}: method ngram proposes from the prompt and takes no model; "
                             f"drop `model`, or set method draft_model")
        if self.method == "draft_model" and (self.prompt_lookup_min or self.prompt_lookup_max):
            raise ValueError("prompt_lookup_min / prompt_lookup_max belong to method ngram; drop them for draft_model")
        low, high = self.lookup_range
        if self.method == "ngram" and low > high:
            raise ValueError(f"prompt_lookup_min = {low} exceeds prompt_lookup_max = {high}")
        return self

    @property
    def lookup_range(self) -> tuple[int, int]:
        """(min, max) suffix lengths, with vLLM's defaults: 5 and 5 when neither is set, else the one given."""
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            return 5, 5
        return (low or high, high or low)  # type: ignore[return-value]


def speculative_config(value: SpeculativeConfig | Mapping[str, Any] | str | None,
                       source: str = "speculative_config") -> SpeculativeConfig | None:
    """Accept what users pass: the model, a mapping (YAML, `LLM(speculative_config={...})`) or JSON text (CLI)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not JSON ({exc}); e.g. "
                              '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{source} must be a mapping of its keys, got {type(value).__name__}")
    return validate(SpeculativeConfig, dict(value), source)
