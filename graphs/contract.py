"""The bucket-graph contract: input/output names, dtypes and bucket (gear) shapes.

Names are those of the design page and are used verbatim by every lowering, the
manifest and the runtime packer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np

INPUT_IDS = "input_ids"
POSITIONS = "positions"
SLOT_MAPPING = "slot_mapping"
BLOCK_TABLES = "block_tables"
CONTEXT_LENS = "context_lens"
CU_SEQLENS_Q = "cu_seqlens_q"
LOGITS_INDICES = "logits_indices"
LOGITS = "logits"
# A slice of the model (graphs/decoder.py's `layers`; export-time calibration and checks only, never served): the
# residual stream and its normed copy (the next layer's input norm applied), float32 [T, hidden], in and out.
SLICE_INPUTS = ("hidden_in", "normed_in")
SLICE_OUTPUTS = ("hidden_out", "normed_out")

NULL_BLOCK = 0
PREFILL = "prefill"
DECODE = "decode"


def k_cache_name(layer: int) -> str:
    return f"k_cache_{layer}"


def v_cache_name(layer: int) -> str:
    return f"v_cache_{layer}"


def cache_output_name(cache_input: str) -> str:
    """Graph output that aliases a pool input; the executor binds both to one buffer."""
    return f"{cache_input}_out"


def cache_names(num_layers: int) -> list[str]:
    return [name for layer in range(num_layers) for name in (k_cache_name(layer), v_cache_name(layer))]


@dataclass(frozen=True, order=True)
class Gear:
    """One static shape of a bucket family: T packed tokens, B sequences, M blocks per sequence."""

    tokens: int
    seqs: int
    blocks: int

    def label(self, family: str) -> str:
        """How metrics and benchmarks name the gear: `decode:T16xB16xM8`."""
        return f"{family}:T{self.tokens}xB{self.seqs}xM{self.blocks}"

    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            INPUT_IDS: (self.tokens,),
            POSITIONS: (self.tokens,),
            SLOT_MAPPING: (self.tokens,),
            BLOCK_TABLES: (self.seqs, self.blocks),
            CONTEXT_LENS: (self.seqs,),
            CU_SEQLENS_Q: (self.seqs + 1,),
            LOGITS_INDICES: (self.seqs,),
        }


MAX_GEARS_PER_FAMILY = 100  # ATC --dynamic_dims: gears per family an Ascend graph may have


def ladder_gears(decode_batch: Iterable[int], prefill_tokens: Iterable[int], prefill_max_seqs: int,
                 context_blocks: Iterable[int]) -> dict[str, tuple[Gear, ...]]:
    """The gears of each family from its ladders: every rung at every context-block size M; a decode gear feeds
    one token per sequence (T = B), a prefill gear T packed tokens of at most `prefill_max_seqs` sequences."""
    blocks = sorted(set(context_blocks))
    return {
        PREFILL: tuple(Gear(t, min(prefill_max_seqs, t), m) for t in sorted(set(prefill_tokens)) for m in blocks),
        DECODE: tuple(Gear(b, b, m) for b in sorted(set(decode_batch)) for m in blocks),
    }


INPUT_DTYPES: dict[str, type] = {
    INPUT_IDS: np.int64,
    POSITIONS: np.int64,
    SLOT_MAPPING: np.int64,
    BLOCK_TABLES: np.int32,
    CONTEXT_LENS: np.int32,
    CU_SEQLENS_Q: np.int32,
    LOGITS_INDICES: np.int64,
}
# Symbolic dimension names of the bucket inputs, shared by every family.
INPUT_DIMS: dict[str, tuple[str, ...]] = {
    INPUT_IDS: ("T",),
    POSITIONS: ("T",),
    SLOT_MAPPING: ("T",),
    BLOCK_TABLES: ("B", "M"),
    CONTEXT_LENS: ("B",),
    CU_SEQLENS_Q: ("B_plus_1",),
    LOGITS_INDICES: ("B",),
}
