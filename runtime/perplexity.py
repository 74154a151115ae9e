"""Perplexity of a text through the engine's own graphs (`pagedgraph eval`), from prompt logprobs.

The text's tokens are cut into windows of `context` tokens starting every `stride` tokens (the
sliding-window scheme of Hugging Face's perplexity guide): each window is one request whose prompt
logprobs score the tokens no earlier window scored, so with `stride < context` every scored token
sees at least `context - stride` tokens of its own window before it, and with `stride == context`
the windows do not overlap and each window's first token goes unscored (it has no prefix there).
Comparisons (precisions, KV-cache dtypes) are meaningful only on the same text, context and stride.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from .engine import EngineConfig, LLMEngine
from .sampling_params import SamplingParams


@dataclass(frozen=True)
class Window:
    """Tokens [begin, end) of the text as one prompt; the tokens from `first_scored` on are scored."""

    begin: int
    end: int
    first_scored: int

    @property
    def scored(self) -> int:
        return self.end - self.first_scored


@dataclass
class PerplexityResult:
    artifact: str
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token, nats
    num_tokens: int  # tokens of the whole text
    num_scored: int
    context: int
    stride: int
    num_windows: int
    executor: str
    custom_ops: bool
    dtype: str
    quantization: str
    kv_cache_dtype: str
    precision: str  # the manifest's one-line summary (weight forms included)
    windows: list[Window] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows every `stride` tokens until one reaches the end; each scores the tokens past the last one's end."""
    if context < 2:
        raise ValueError(f"context = {context}: a window needs at least 2 tokens (one to predict from)")
    if not 1 <= stride <= context:
        raise ValueError(f"stride = {stride}: must be in [1, context = {context}]")
    if num_tokens < 2:
        raise ValueError(f"the text has {num_tokens} token(s); perplexity needs at least 2")
    windows, scored_to = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + context, num_tokens)
        windows.append(Window(begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return windows


def perplexity(engine: LLMEngine, token_ids: list[int], context: int, stride: int | None = None) -> PerplexityResult:
    """Run every window as a request (together, the scheduler batches them) and average the scored tokens' NLL."""
    stride = stride or context
    if context >= engine.max_model_len:
        raise ValueError(f"context = {context}: prompts must be shorter than the engine's max_model_len "
                         f"{engine.max_model_len}; lower --context")
    windows = plan_windows(len(token_ids), context, stride)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    requests = {engine.add_request(token_ids[w.begin:w.end], params).request_id: w
                for w in windows}
    nll, scored = 0.0, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"window {requests[out.request_id]} failed: {out.error}")
            if not out.finished:
                continue
            w = requests[out.request_id]
            assert out.prompt_logprobs is not None
            for position in range(w.first_scored, w.end):
                nll -= out.prompt_logprobs[position - w.begin][token_ids[position]].logprob
            scored += w.scored
    info = engine.runtime_info()
    return PerplexityResult(
        artifact=str(engine.artifact), perplexity=math.exp(nll / scored), nll=nll / scored,
        num_tokens=len(token_ids), num_scored=scored, context=context, stride=stride, num_windows=len(windows),
        executor=info.executor, custom_ops=info.custom_ops, dtype=info.dtype,
        quantization=info.quantization or "none", kv_cache_dtype=info.kv_cache_dtype,
        precision=engine.manifest.precision(), windows=windows)


def evaluate_text(artifact: str | Path, text: str, context: int = 512, stride: int | None = None,
                  config: EngineConfig = EngineConfig()) -> PerplexityResult:
    """`pagedgraph eval`: tokenize `text` as the model does by default (BOS where it wants one) and score it."""
    engine = LLMEngine(artifact, config)
    return perplexity(engine, engine.tokenizer.encode(text), context, stride)


def evaluate_artifacts(artifacts: list[str], text: str, context: int = 512, stride: int | None = None,
                       config: EngineConfig = EngineConfig(),
                       kv_cache_dtypes: Sequence[str] = ()) -> list[PerplexityResult]:
    """Each artifact in turn (with each KV-cache dtype, when given) on the same windows; the first run is
    the baseline of `ratio_table`."""
    configs = [replace(config, kv_cache_dtype=d) for d in kv_cache_dtypes] or [config]
    return [evaluate_text(a, text, context, stride, c) for a in artifacts for c in configs]


def ratio_table(results: list[PerplexityResult]) -> str:
    """One line per run: perplexity and its ratio to the first run (the fp32 baseline)."""
    base = results[0].perplexity
    lines = [f"{'artifact':40} {'dtype':9} {'quant':6} {'kv cache':9} {'tokens':>7} {'windows':>7} "
             f"{'perplexity':>11} {'ratio':>8}"]
    for r in results:
        lines.append(f"{r.artifact[-40:]:40} {r.dtype:9} {r.quantization:6} {r.kv_cache_dtype:9} {r.num_scored:7d} "
                     f"{r.num_windows:7d} {r.perplexity:11.4f} {r.perplexity / base:8.5f}")
    return "\n".join(lines)
