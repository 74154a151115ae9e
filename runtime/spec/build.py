"""The engine's speculator from its config: checks against the artifact, then the proposer of the method."""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from ...artifact.manifest import Manifest
from ...artifact.settings import ConfigError
from ...graphs.contract import DECODE
from .config import SpeculativeConfig
from .draft import DraftModel, DraftProposer
from .ngram import NgramProposer
from ..kv_cache_manager import SharedKV
from ..sampler import Sampler
from ..scheduler import ScheduledBatch
from ..structured_output import StructuredOutputs
from ..tokenizer import Tokenizer
from .proposer import Proposer
from .speculator import Speculator


log = logging.getLogger(__name__)
CALIBRATION_RUNS = 3  # of the smallest decode gear per engine, the fastest taken (the first also warms it up)


class Target(DraftModel, Protocol):
    """What is read of the engine that speculates (it passes itself: runtime/spec never imports the engine)."""

    artifact: Path
    manifest: Manifest
    max_model_len: int
    max_logits_rows: int
    model: Any  # graphs.config.ModelConfig
    sampler: Sampler
    structured: StructuredOutputs  # one of the sampler's processors: grammar masks
    tokenizer: Tokenizer


def check_query_buckets(spec: SpeculativeConfig, max_rows: int, artifact: object) -> None:
    """A verification needs K+1 logits rows for one sequence in one prefill gear."""
    if spec.num_speculative_tokens + 1 > max_rows:
        raise ConfigError(f"speculative_config.num_speculative_tokens = {spec.num_speculative_tokens}: verifying K "
                          f"drafts takes K+1 logits rows in one prefill gear, and the gears of {artifact} hold at "
                          f"most {max_rows}; use at most {max_rows - 1}, or export more rows "
                          f"(export.buckets.verify_tokens)")


def _draft(spec: SpeculativeConfig, config: Any, target: Target) -> Proposer:
    """The draft artifact in an engine of the target's own class and settings (the engine's EngineConfig), but not
    batch-invariant: its rows only propose, the target's verification decides every token, so the draft's single
    decodes take the B=1 gear (block-quantized drafts would pad them to two rows)."""
    assert spec.model is not None
    shared = shares_kv(Manifest.load(Path(spec.model), verify=False), target)
    draft = type(target)(spec.model, replace(config, speculative_config=None, gears=None,
                                              max_model_len=target.max_model_len, kv_cache_dtype="auto",
                                              batch_invariant=False),
                         SharedKV(target.pools, target.kv) if shared else None)
    problems = []
    if draft.model.vocab_size != target.model.vocab_size:
        problems.append(f"its vocabulary has {draft.model.vocab_size} entries, the target's {target.model.vocab_size}")
    elif draft.tokenizer.backend.get_vocab(True) != target.tokenizer.backend.get_vocab(True):
        problems.append("its tokenizer maps tokens to other ids than the target's")
    if draft.max_model_len < target.max_model_len:
        problems.append(f"it was exported for max_model_len {draft.max_model_len}, the target runs "
                        f"{target.max_model_len}")
    if problems:
        raise ConfigError(f"speculative_config.model = {spec.model!r}: a draft must share the target's tokenizer and "
                          f"context; " + "; ".join(problems) + " (export the draft from the same checkpoint or family)")
    cost = _decode_step_s(draft) / _decode_step_s(target)
    log.info("draft %s: %s; a draft token costs %.2f target decode steps", spec.model,
             "the target's model at another precision, on the target's KV pools" if shared
             else "a KV pool of its own (it prefills every prompt)", cost)
    return DraftProposer(draft, spec.num_speculative_tokens, target.model.vocab_size, cost, shared)


def shares_kv(draft: Manifest, target: Target) -> bool:
    """Whether the draft is the target's model at another precision (the same ModelConfig, block size and ranks)
    with graphs for the target's cache dtype, a float one: then its K/V rows mean what the target's mean, and it
    runs on the target's pools instead of prefilling every prompt into its own (runtime/spec/draft.py). An int8
    cache is not shared: its scales are calibrated on each artifact's own graph and stored in it."""
    mine, dtype = target.manifest, target.pools.kv_cache_dtype
    return (draft.model == mine.model and draft.block_size == mine.block_size
            and draft.tensor_parallel_size == mine.tensor_parallel_size
            and dtype in draft.served_kv_cache_dtypes and not target.pools.format.quantized)


def _decode_step_s(engine: DraftModel) -> float:
    """Seconds of one step in the smallest decode gear, all padding (its slots are the null block's): what a
    draft token costs against a target decode, measured on this machine when the engines load."""
    gear = engine.packer.gears[DECODE][0]
    inputs = engine.packer.pack(ScheduledBatch(), gear)
    times = []
    for _ in range(CALIBRATION_RUNS):
        start = time.perf_counter()
        engine.executor.run(gear, inputs)
        times.append(time.perf_counter() - start)
    return min(times)


def speculator_for(config: Any, engine: Target) -> Speculator | None:
    """`config`: the engine's EngineConfig, its speculative_config already checked."""
    spec = config.speculative_config
    if spec is None:
        return None
    assert isinstance(spec, SpeculativeConfig)
    check_query_buckets(spec, engine.max_logits_rows, engine.artifact)
    proposer: Any = (NgramProposer(*spec.lookup_range, engine.max_model_len) if spec.method == "ngram"
                     else _draft(spec, config, engine))
    grammars = engine.structured
    others = [p for p in engine.sampler.processors if p is not grammars]
    return Speculator(spec, proposer, engine.max_model_len, engine.model.vocab_size,
                      lambda seq: not any(p.wants(seq) for p in others), grammars)
