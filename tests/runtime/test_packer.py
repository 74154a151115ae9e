"""The packer fills a gear's buffers exactly: packed tokens, no per-request padding, null-block padding."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.artifact.manifest import Family, Manifest
from pagedgraph.graphs import contract as c
from pagedgraph.graphs.config import ModelConfig
from pagedgraph.graphs.contract import DECODE, PREFILL, Gear
from pagedgraph.runtime.model_runner import Packer
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.scheduler import ScheduledBatch
from pagedgraph.runtime.scheduler import Sequence

pytestmark = pytest.mark.unit
MODEL = ModelConfig("llama", vocab_size=100, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                    tie_word_embeddings=True)


def _manifest() -> Manifest:
    prefill = tuple(Gear(t, 4, m) for t in (8, 32) for m in (2, 4))
    decode = tuple(Gear(b, b, m) for b in (2, 4) for m in (2, 4))
    families = {PREFILL: Family("graphs/model.onnx", prefill), DECODE: Family("graphs/model.onnx", decode)}
    return Manifest(MODEL, 16, 64, "float32", families, {})


def _packer() -> Packer:
    return Packer(_manifest())


def _seq(tokens: list[int], computed: int, table: list[int]) -> Sequence:
    seq = Sequence("r", tokens, SamplingParams(), 0.0)
    seq.num_computed_tokens = computed
    seq.block_table = table
    return seq


def test_mixed_batch_exact_arrays() -> None:
    packer = _packer()
    fresh = _seq(list(range(1, 6)), 0, [3])  # 5-token prompt
    chunk = _seq(list(range(10, 30)), 16, [5, 7])  # second chunk: tokens 16..19 after 16 cached
    decode = _seq([40, 41, 42], 2, [9])  # decoding its third token
    batch = ScheduledBatch([fresh, chunk, decode], [5, 4, 1])
    family, gear = packer.select(batch)
    assert (family, gear) == (PREFILL, Gear(32, 4, 2))
    buf = packer.pack(batch, gear)
    padding = 32 - 10
    np.testing.assert_array_equal(buf[c.INPUT_IDS], [1, 2, 3, 4, 5, 26, 27, 28, 29, 42] + [0] * padding)
    np.testing.assert_array_equal(buf[c.POSITIONS], [0, 1, 2, 3, 4, 16, 17, 18, 19, 2] + [0] * padding)
    np.testing.assert_array_equal(
        buf[c.SLOT_MAPPING], [48, 49, 50, 51, 52, 112, 113, 114, 115, 146] + [0] * padding)  # null block: slot 0
    np.testing.assert_array_equal(buf[c.BLOCK_TABLES], [[3, 0], [5, 7], [9, 0], [0, 0]])
    np.testing.assert_array_equal(buf[c.CONTEXT_LENS], [5, 20, 3, 0])
    np.testing.assert_array_equal(buf[c.CU_SEQLENS_Q], [0, 5, 9, 10, 10])
    np.testing.assert_array_equal(buf[c.LOGITS_INDICES], [4, 8, 9, 0])


def test_decode_batch_uses_decode_family_and_reuses_buffers() -> None:
    packer = _packer()
    seqs = [_seq([1, 2, 3], 2, [4]), _seq([5, 6], 1, [6, 8])]
    batch = ScheduledBatch(seqs, [1, 1])
    family, gear = packer.select(batch)
    assert (family, gear) == (DECODE, Gear(2, 2, 2))
    first = packer.pack(batch, gear)
    np.testing.assert_array_equal(first[c.SLOT_MAPPING], [4 * 16 + 2, 6 * 16 + 1])
    np.testing.assert_array_equal(first[c.CU_SEQLENS_Q], [0, 1, 2])
    again = packer.pack(ScheduledBatch(seqs[:1], [1]), gear)
    assert all(again[k] is first[k] for k in first), "buffers must be created once per gear"
    np.testing.assert_array_equal(again[c.BLOCK_TABLES], [[4, 0], [0, 0]])  # stale rows cleared
    np.testing.assert_array_equal(again[c.CU_SEQLENS_Q], [0, 1, 1])


def test_batch_invariant_selection_runs_even_gears_where_one_fits() -> None:
    """MatMulNBits computes a lone last row another way (docs/performance.md, "Batch invariance"): with
    block-quantized linears a single decode runs the B = 2 gear, not B = 1; where only an odd gear fits, it serves
    and the packer names it. Dense linears (quantization none) compute each row alike: no padding."""
    decode = tuple(Gear(b, b, 2) for b in (1, 2, 3))
    families = {PREFILL: Family("graphs/model.onnx", (Gear(8, 4, 2),)), DECODE: Family("graphs/model.onnx", decode)}
    quantized = Manifest(MODEL, 16, 64, "float32", families, {}, quantization="w8a8")
    dense = Manifest(MODEL, 16, 64, "float32", families, {})
    one = ScheduledBatch([_seq([1, 2], 1, [3])], [1])
    three = ScheduledBatch([_seq([1, 2], 1, [3]) for _ in range(3)], [1, 1, 1])
    assert Packer(quantized).select(one)[1] == Gear(1, 1, 2)
    invariant = Packer(quantized, batch_invariant=True)
    assert invariant.select(one)[1] == Gear(2, 2, 2)
    assert invariant.select(three)[1] == Gear(3, 3, 2)
    assert invariant.odd_widest_gears() == [Gear(3, 3, 2)]
    unpadded = Packer(dense, batch_invariant=True)
    assert unpadded.select(one)[1] == Gear(1, 1, 2) and unpadded.odd_widest_gears() == []


def test_batch_invariant_feeds_drafts_as_decode_rows_of_one_block_table() -> None:
    """A verification of 2 drafts becomes 3 one-query sequences (context 3, 4, 5) sharing the block table, so
    PagedAttention computes each as a plain decode row; the logits rows stay per sequence, then per draft."""
    verify = _seq([1, 2, 3, 4, 5], 2, [6])
    verify.num_draft_tokens = 2
    decode = _seq([7, 8], 1, [9])
    batch = ScheduledBatch([verify, decode], [3, 1], token_rows=2)
    packer = Packer(_manifest(), batch_invariant=True)
    family, gear = packer.select(batch)
    assert (family, gear) == (DECODE, Gear(4, 4, 2))
    buf = packer.pack(batch, gear)
    np.testing.assert_array_equal(buf[c.INPUT_IDS], [3, 4, 5, 8])
    np.testing.assert_array_equal(buf[c.SLOT_MAPPING], [98, 99, 100, 145])
    np.testing.assert_array_equal(buf[c.CU_SEQLENS_Q], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(buf[c.CONTEXT_LENS], [3, 4, 5, 2])
    np.testing.assert_array_equal(buf[c.BLOCK_TABLES], [[6, 0], [6, 0], [6, 0], [9, 0]])
    np.testing.assert_array_equal(buf[c.LOGITS_INDICES], [2, 3, 0, 1])
    fresh = _seq(list(range(20, 30)), 0, [11])  # a prompt chunk in the step: the prefill family, same layout
    mixed = ScheduledBatch([verify, fresh], [3, 10], token_rows=2)
    assert packer.select(mixed)[0] == PREFILL
    buf = packer.pack(mixed, packer.select(mixed)[1])
    np.testing.assert_array_equal(buf[c.CU_SEQLENS_Q], [0, 1, 2, 3, 13])
    np.testing.assert_array_equal(buf[c.CONTEXT_LENS], [3, 4, 5, 10])
    assert Packer(_manifest()).select(batch)[0] == PREFILL  # without batch invariance: one sequence of 3 queries


def test_decode_rows_feed_a_short_chunk_as_one_query_rows_in_a_decode_gear() -> None:
    """A draft's catch-up: 3 tokens of one sequence (context 3, 4, 5) and a single decode, in the B=4 decode gear
    of a packer that is not batch-invariant; only each sequence's last row reaches the LM head."""
    catch_up = _seq([1, 2, 3, 4, 5], 2, [6])
    batch = ScheduledBatch([catch_up, _seq([7, 8], 1, [9])], [3, 1], decode_rows=True)
    packer = _packer()
    family, gear = packer.select(batch)
    assert (family, gear) == (DECODE, Gear(4, 4, 2))
    buf = packer.pack(batch, gear)
    np.testing.assert_array_equal(buf[c.CU_SEQLENS_Q], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(buf[c.CONTEXT_LENS], [3, 4, 5, 2])
    np.testing.assert_array_equal(buf[c.LOGITS_INDICES], [2, 3, 0, 0])
    batch.decode_rows = False
    assert packer.select(batch)[0] == PREFILL


def test_moe_padding_decode_rows_copy_the_first_sequence() -> None:
    """A MoE model's padding decode rows repeat the first sequence (token, position, block table, context) and write
    into the null block: they choose its experts, so padding reads no other expert's weights. Prefill padding and
    dense models keep null rows."""
    from dataclasses import replace

    from pagedgraph.graphs.config import MoeConfig

    manifest = _manifest()
    packer = Packer(replace(manifest, model=replace(MODEL, moe=MoeConfig(8, 2, 16, True, (0,)))))
    first, second = _seq([1, 2, 3], 2, [4]), _seq([5, 6, 7, 8], 3, [6, 8])
    batch = ScheduledBatch([first, second], [1, 1])
    buf = packer.pack(batch, Gear(4, 4, 2))
    np.testing.assert_array_equal(buf[c.INPUT_IDS], [3, 8, 3, 3])
    np.testing.assert_array_equal(buf[c.POSITIONS], [2, 3, 2, 2])
    np.testing.assert_array_equal(buf[c.SLOT_MAPPING], [66, 99, 0, 0])  # the copies write into the null block
    np.testing.assert_array_equal(buf[c.BLOCK_TABLES], [[4, 0], [6, 8], [4, 0], [4, 0]])
    np.testing.assert_array_equal(buf[c.CONTEXT_LENS], [3, 4, 3, 3])
    np.testing.assert_array_equal(buf[c.CU_SEQLENS_Q], [0, 1, 2, 3, 4])
    np.testing.assert_array_equal(buf[c.LOGITS_INDICES], [0, 1, 0, 0])
    dense = Packer(manifest).pack(batch, Gear(4, 4, 2))
    np.testing.assert_array_equal(dense[c.INPUT_IDS], [3, 8, 0, 0])
    np.testing.assert_array_equal(dense[c.CONTEXT_LENS], [3, 4, 0, 0])
    fresh = ScheduledBatch([_seq(list(range(1, 6)), 0, [3])], [5])
    prefill = packer.pack(fresh, Gear(8, 4, 2))
    np.testing.assert_array_equal(prefill[c.INPUT_IDS], [1, 2, 3, 4, 5, 0, 0, 0])
