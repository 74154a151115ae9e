"""The engine's speculator from its config: checks against the artifact, then the proposer of the method."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...artifact.manifest import Manifest
from ...artifact.settings import ConfigError
from ..kv_cache_manager import KVCacheManager
from ..kv_pools import KVPools
from ..model_runner import ModelRunner, step_limits
from ..scheduler import Sequence
from ..structured_output import StructuredOutputs
from ..tokenizer import Tokenizer
from .config import SpeculativeConfig
from .draft import DraftProposer
from .ngram import NgramProposer
from .proposer import Proposer
from .speculator import Speculator


log = logging.getLogger(__name__)
CALIBRATION_RUNS = 3  # of the smallest decode gear per runner, the fastest taken (the first also warms it up)


@dataclass(frozen=True)
class Target:
    """What speculation needs of the engine that speculates, handed over by it (runtime/spec never imports it)."""

    artifact: Path
    manifest: Manifest
    max_model_len: int
    max_logits_rows: int
    tokenizer: Tokenizer
    runner: ModelRunner  # its decode step prices a draft token; its pools serve a draft of the same model
    kv: KVCacheManager  # the block manager of those pools
    grammars: StructuredOutputs  # one of the sampler's logits processors: grammar masks
    eligible: Callable[[Sequence], bool]  # the sequence's rows need no logits processor but grammars


def check_query_buckets(spec: SpeculativeConfig, max_rows: int, artifact: object) -> None:
    """A verification needs K+1 logits rows for one sequence in one prefill gear."""
    if spec.num_speculative_tokens + 1 > max_rows:
        raise ConfigError(f"speculative_config.num_speculative_tokens = {spec.num_speculative_tokens}: verifying K "
                          f"drafts takes K+1 logits rows in one prefill gear, and the gears of {artifact} hold at "
                          f"most {max_rows}; use at most {max_rows - 1}, or export more rows "
                          f"(export.buckets.verify_tokens)")


def _check_draft(spec: SpeculativeConfig, manifest: Manifest, tokenizer: Tokenizer, target: Target) -> None:
    """A draft must share the target's tokenizer and context."""
    problems = []
    vocab, target_vocab = manifest.model.vocab_size, target.manifest.model.vocab_size
    if vocab != target_vocab:
        problems.append(f"its vocabulary has {vocab} entries, the target's {target_vocab}")
    elif tokenizer.backend.get_vocab(True) != target.tokenizer.backend.get_vocab(True):
        problems.append("its tokenizer maps tokens to other ids than the target's")
    if manifest.max_model_len < target.max_model_len:
        problems.append(f"it was exported for max_model_len {manifest.max_model_len}, the target runs "
                        f"{target.max_model_len}")
    if problems:
        raise ConfigError(f"speculative_config.model = {spec.model!r}: a draft must share the target's tokenizer and "
                          f"context; " + "; ".join(problems) + " (export the draft from the same checkpoint or family)")


def _draft(spec: SpeculativeConfig, config: Any, target: Target) -> Proposer:
    """The draft artifact in a model runner with the target's executor settings (the engine's EngineConfig), on the
    target's pools when it is the same model, else on pools of its own sized as the engine sizes its own. Not
    batch-invariant: its rows only propose, the target's verification decides every token, so the draft's single
    decodes take the B=1 gear (block-quantized drafts would pad them to two rows)."""
    assert spec.model is not None
    artifact = Path(spec.model)
    manifest = Manifest.load(artifact)
    _check_draft(spec, manifest, Tokenizer.from_dir(artifact), target)
    shared = shares_kv(manifest, target)
    if shared:
        pools, kv = target.runner.pools, target.kv
    else:
        max_num_seqs, _, _ = step_limits(manifest, config.max_num_seqs, config.max_num_batched_tokens)
        pools = KVPools.sized(artifact, manifest, manifest.kv_cache_dtype("auto"), target.max_model_len, max_num_seqs,
                              config.num_blocks, config.kv_cache_bytes)
        kv = KVCacheManager.for_pools(pools, config.enable_prefix_caching, config.prefix_cache_salt)
    runner = ModelRunner(artifact, manifest, pools, config.executor, config.threads, config.custom_ops)
    cost = runner.decode_step_s(CALIBRATION_RUNS) / target.runner.decode_step_s(CALIBRATION_RUNS)
    log.info("draft %s: %s; a draft token costs %.2f target decode steps", spec.model,
             "the target's model at another precision, on the target's KV pools" if shared
             else "a KV pool of its own (it prefills every prompt)", cost)
    return DraftProposer(runner, kv, spec.num_speculative_tokens, target.manifest.model.vocab_size, cost, shared)


def shares_kv(draft: Manifest, target: Target) -> bool:
    """Whether the draft is the target's model at another precision (the same ModelConfig, block size and ranks)
    with graphs for the target's cache dtype, a float one: then its K/V rows mean what the target's mean, and it
    runs on the target's pools instead of prefilling every prompt into its own (runtime/spec/draft.py). An int8
    cache is not shared: its scales are calibrated on each artifact's own graph and stored in it."""
    mine, pools = target.manifest, target.runner.pools
    return (draft.model == mine.model and draft.block_size == mine.block_size
            and draft.tensor_parallel_size == mine.tensor_parallel_size
            and pools.kv_cache_dtype in draft.served_kv_cache_dtypes and not pools.format.quantized)


def speculator_for(config: Any, target: Target) -> Speculator | None:
    """`config`: the engine's EngineConfig, its speculative_config already checked."""
    spec = config.speculative_config
    if spec is None:
        return None
    assert isinstance(spec, SpeculativeConfig)
    check_query_buckets(spec, target.max_logits_rows, target.artifact)
    proposer: Any = (NgramProposer(*spec.lookup_range, target.max_model_len) if spec.method == "ngram"
                     else _draft(spec, config, target))
    return Speculator(spec, proposer, target.max_model_len, target.manifest.model.vocab_size, target.eligible,
                      target.grammars)
