"""Per-request embedding settings (vLLM's PoolingParams), validated where they enter, and the refusal of a request
of the other task."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..graphs.config import Pooling
from .sampling_params import RequestError, SamplingParams

# What an embedding sequence carries where a generation carries its SamplingParams (the scheduler reads their
# prompt-logprob and seeding fields): greedy and one token, never sampled, since the sequence ends with its prompt.
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0)


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's settings (vLLM's PoolingParams): `dimensions` keeps the first d of a Matryoshka
    model's vector (normalised after the cut)."""

    dimensions: int | None = None

    def check(self, pooling: Pooling, hidden_size: int) -> None:
        """`dimensions` against what the model was exported for; a RequestError naming the field otherwise."""
        d = self.dimensions
        if d is None:
            return
        if not isinstance(d, int) or isinstance(d, bool) or d < 1:
            raise RequestError("dimensions", f"{d!r} must be an integer >= 1")
        if not pooling.matryoshka:
            raise RequestError("dimensions", f"{d}: this model was not exported as a Matryoshka model, so its vectors "
                                             f"are not truncated; leave dimensions out (its vectors have {hidden_size} "
                                             "dimensions), or export with export.pooling.matryoshka: true if it was "
                                             "trained so")
        allowed = pooling.matryoshka_dimensions
        if allowed and d not in allowed:
            raise RequestError("dimensions", f"{d}: this model serves dimensions {', '.join(map(str, allowed))}")
        if d > hidden_size:
            raise RequestError("dimensions", f"{d}: this model's vectors have {hidden_size} dimensions; ask for at "
                                             "most that many")


def wrong_task(params: SamplingParams | PoolingParams, artifact: Path) -> RequestError:
    """Why `params` cannot run on `artifact`, exported for the other task: PoolingParams need an embedding artifact
    (export.task embed), SamplingParams a generation one."""
    if isinstance(params, PoolingParams):
        return RequestError("task", f"{artifact} was exported for generation (export.task generate): it has no "
                                    "pooling head to embed with; export the model with export.task: embed")
    return RequestError("task", f"{artifact} was exported for embeddings (export.task embed): its graphs end in a "
                                "pooling head, not the LM head, so it generates nothing; embed with it "
                                "(/v1/embeddings, LLM.embed), or export the model with export.task: generate")
