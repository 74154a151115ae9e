"""Bucket planning: YAML ladders -> gears per family, checked against the Ascend limits."""
from __future__ import annotations

import math

from .config import ExportOptions
from ..graphs.config import ModelConfig
from ..graphs.contract import MAX_GEARS_PER_FAMILY, Gear, ladder_gears


class BucketError(ValueError):
    pass


def check_ascend_limits(model: ModelConfig, block_size: int) -> None:
    problems = []
    if block_size % 16:
        problems.append(f"export.block_size = {block_size}: must be a multiple of 16")
    if block_size * model.head_dim > 16384:
        problems.append(f"export.block_size * head_dim = {block_size * model.head_dim}: must be <= 16384")
    if model.head_dim > 256:
        problems.append(f"head_dim = {model.head_dim}: must be <= 256")
    if model.num_heads % model.num_kv_heads:
        problems.append(f"num_heads {model.num_heads} must be a multiple of num_kv_heads {model.num_kv_heads}")
    if problems:
        raise BucketError("the export breaks Ascend limits:\n  " + "\n  ".join(problems))


def context_ladder(options: ExportOptions) -> tuple[int, ...]:
    needed = math.ceil(options.max_model_len / options.block_size)
    ladder = options.buckets.context_blocks
    if ladder is None:
        ladder = tuple(sorted({min(2 ** i, needed) for i in range(2, needed.bit_length() + 1)} | {needed}))
    if ladder[-1] < needed:
        raise BucketError(f"export.buckets.context_blocks tops out at {ladder[-1]} blocks but max_model_len "
                          f"{options.max_model_len} needs {needed}: add {needed} to the ladder")
    return ladder


def plan_gears(model: ModelConfig, options: ExportOptions) -> dict[str, tuple[Gear, ...]]:
    check_ascend_limits(model, options.block_size)
    if options.max_model_len > model.max_position_embeddings:
        raise BucketError(f"export.max_model_len = {options.max_model_len} exceeds the model's "
                          f"max_position_embeddings {model.max_position_embeddings}")
    ladders = options.buckets
    gears = ladder_gears(ladders.decode_batch, [*ladders.prefill_tokens, *ladders.verify_tokens],
                         ladders.prefill_max_seqs, context_ladder(options))
    for family, family_gears in gears.items():
        if len(family_gears) > MAX_GEARS_PER_FAMILY:
            raise BucketError(f"the {family} family has {len(family_gears)} gears (ladder x context_blocks); "
                              f"ATC allows at most {MAX_GEARS_PER_FAMILY}: shorten a ladder")
    return gears
