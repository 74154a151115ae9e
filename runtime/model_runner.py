"""The model runner: a scheduled batch -> the smallest gear that holds it -> that gear's inputs, filled in place ->
its graph on the KV pools -> logits (vLLM v1's GPUModelRunner, nano-vllm's model_runner).

A `ModelRunner` owns the packer (gear choice, input buffers made once per gear and reused every step), the executor
and the pools' block copies. The engine runs its steps through one; a draft model is another, on the target's pools
or on its own (runtime/spec/draft.py).
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np

from ..artifact.manifest import Manifest
from ..graphs import contract as c
from ..graphs.contract import DECODE, PREFILL, Gear
from .executors import CustomOps, make_executor
from .kv_pools import KVPools
from .scheduler import ScheduledBatch, Sequence


class NoGearError(RuntimeError):
    pass


@dataclass(frozen=True)
class StepShape:
    """What one step asks of its gear: the families that can run it (in order of preference), the packed tokens T,
    the attention's sequences or logits rows B (whichever is more) and the blocks of the longest block table M."""

    families: tuple[str, ...]
    tokens: int
    seqs: int
    blocks: int


class GearSelector:
    """The smallest gear that holds a step: the one rule the engine serves by and the ladder planner
    (runtime/ladder_plan.py) estimates padding with."""

    def __init__(self, gears: Mapping[str, Iterable[Gear]], even_gears: bool = False) -> None:
        """`even_gears`: prefer gears whose T and B are both even (see Packer); an odd one serves where none fits."""
        self.gears = {name: sorted(family) for name, family in gears.items()}
        self.even_gears = even_gears
        self._passes = (True, False) if even_gears else (False,)

    def fit(self, shape: StepShape) -> tuple[str, Gear]:
        tokens, seqs, blocks = shape.tokens, shape.seqs, shape.blocks
        for family in shape.families:
            gears = self.gears[family]
            start = bisect.bisect_left(gears, Gear(tokens, 0, 0))
            for even in self._passes:
                for gear in gears[start:]:
                    if gear.tokens >= tokens and gear.seqs >= seqs and gear.blocks >= blocks and (
                            not even or gear.tokens % 2 == gear.seqs % 2 == 0):
                        return family, gear
        raise NoGearError(f"no {shape.families[-1]} gear holds T={tokens}, B={seqs}, M={blocks}; "
                          f"the scheduler limits must stay within the exported ladders")

    def fit_limits(self, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int]:
        """The scheduler's limits clamped to what the gears hold, so every step has a gear: sequences and tokens
        per step, and the most logits rows one step returns (the widest prefill gear's B: prompt logprobs need a
        row per token)."""
        prefill, decode = self.gears[PREFILL], self.gears[DECODE]
        max_seqs = min(max(g.seqs for g in decode), max(g.seqs for g in prefill))
        return (min(max_num_seqs, max_seqs), min(max_num_batched_tokens, max(g.tokens for g in prefill)),
                max(g.seqs for g in prefill))

    def odd_widest_gears(self) -> list[Gear]:
        """With even gears wanted, the widest gear of each family where its T or B is odd: steps that need it break
        batch invariance."""
        if not self.even_gears:
            return []
        widest = [max(gears, key=lambda g: (g.tokens, g.seqs)) for gears in self.gears.values()]
        return [g for g in widest if g.tokens % 2 or g.seqs % 2]


def as_decode_rows(batch: ScheduledBatch, seq: Sequence, verify_as_decode: bool) -> bool:
    """Whether `seq`'s tokens this step are fed as one-query decode rows (see Packer)."""
    return batch.decode_rows or (verify_as_decode and seq.num_draft_tokens > 0)


def step_shape(batch: ScheduledBatch, verify_as_decode: bool) -> StepShape:
    """What `batch` asks of its gear, as Packer.pack lays it out."""
    parts, single, as_rows = 0, True, True  # parts: the attention's sequences
    for seq, n in zip(batch.seqs, batch.num_tokens):
        if n == 1:
            parts += 1
        elif as_decode_rows(batch, seq, verify_as_decode):
            parts, single = parts + n, False
        else:
            parts, single, as_rows = parts + 1, False, False
    families = (DECODE,) if single else (DECODE, PREFILL) if as_rows else (PREFILL,)
    return StepShape(families, batch.total_tokens, max(batch.num_logits_rows, parts),
                     max(len(s.block_table) for s in batch.seqs))


class Packer:
    """Bucket selection and input packing; padding rows point at the null block."""

    def __init__(self, manifest: Manifest, batch_invariant: bool = False) -> None:
        """`batch_invariant` on an artifact with block-quantized linears (`Manifest.block_quantized`): every step
        runs a gear of even T and B where one fits. ONNX Runtime's MatMulNBits computes rows in pairs and a lone
        last row another way (docs/performance.md, "Batch invariance"), so a single decode pads to two rows and
        gets the logits it gets inside a batch. Dense linears compute each row alike at any M: no padding.

        `batch_invariant` also feeds a verification's K+1 tokens (a sequence with drafts) as K+1 one-query
        sequences sharing its block table, with context lengths of one more key each: PagedAttention computes each
        as the decode row a plain run would have computed for that token, where a sequence of K+1 queries would
        be a prompt tile, another reduction. So greedy output with speculation is the plain run's at every
        precision, and a step of decodes and verifications runs a decode gear."""
        self.block_size = manifest.block_size
        # A Mixture-of-Experts model's padding decode rows copy the first sequence (its token, position, block table
        # and context; their K/V written into the null block): each computes what that row computes, so it chooses
        # the same experts, and a padded step reads no expert weights that no real token chose (a row of token 0
        # would choose up to top_k others: twice the expert bytes of a single decode).
        self.copy_padding = manifest.model.moe is not None
        self.verify_as_decode = batch_invariant
        self.selector = GearSelector({name: f.gears for name, f in manifest.families.items()},
                                     batch_invariant and manifest.block_quantized)
        self.gears = self.selector.gears
        self.buffers: dict[Gear, dict[str, np.ndarray]] = {}
        self._arange = np.arange(max(g.tokens for gs in self.gears.values() for g in gs), dtype=np.int64)

    def select(self, batch: ScheduledBatch) -> tuple[str, Gear]:
        """The smallest gear that fits: decode family when every sequence feeds one token or its tokens as decode
        rows (verified drafts, `ScheduledBatch.decode_rows`; then the prefill family where no decode gear is wide
        enough)."""
        return self.selector.fit(step_shape(batch, self.verify_as_decode))

    def odd_widest_gears(self) -> list[Gear]:
        return self.selector.odd_widest_gears()

    def _buffers(self, gear: Gear) -> dict[str, np.ndarray]:
        buffers = self.buffers.get(gear)
        if buffers is None:
            buffers = {name: np.zeros(shape, c.INPUT_DTYPES[name]) for name, shape in gear.input_shapes().items()}
            self.buffers[gear] = buffers
        return buffers

    def pack(self, batch: ScheduledBatch, gear: Gear) -> dict[str, np.ndarray]:
        buf = self._buffers(gear)
        ids, positions, slots = buf[c.INPUT_IDS], buf[c.POSITIONS], buf[c.SLOT_MAPPING]
        tables, context_lens = buf[c.BLOCK_TABLES], buf[c.CONTEXT_LENS]
        cu, logits_indices = buf[c.CU_SEQLENS_Q], buf[c.LOGITS_INDICES]
        bs = self.block_size
        tables.fill(c.NULL_BLOCK)
        row = part = 0  # part: the attention's sequence index (several per sequence verified as decode rows)
        for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed_tokens
            table = seq.block_table
            tables[part, :len(table)] = table
            if n == 1:
                ids[row] = seq.token_ids[start]
                positions[row] = start
                slots[row] = table[start // bs] * bs + start % bs
            else:
                ids[row:row + n] = seq.token_ids[start:start + n]
                pos = positions[row:row + n]
                np.add(self._arange[:n], start, out=pos)
                np.add(tables[part, pos // bs].astype(np.int64) * bs, pos % bs, out=slots[row:row + n])
            if n > 1 and as_decode_rows(batch, seq, self.verify_as_decode):
                tables[part + 1:part + n] = tables[part]
                np.add(self._arange[:n], row, out=cu[part:part + n], casting="unsafe")
                np.add(self._arange[:n], start + 1, out=context_lens[part:part + n], casting="unsafe")
                part += n
            else:
                cu[part] = row
                context_lens[part] = start + n
                part += 1
            row += n
            logits_indices[b] = row - 1
        slots[row:] = c.NULL_BLOCK * bs
        if self.copy_padding and part == row and len(ids) - row == len(cu) - 1 - part:
            padding = len(ids) - row  # decode rows: one part each, copies of the first
            ids[row:], positions[row:] = ids[0], positions[0]
            tables[part:part + padding] = tables[0]
            np.add(self._arange[:padding], row, out=cu[part:part + padding], casting="unsafe")
            cu[part + padding:] = len(ids)
            context_lens[part:part + padding] = context_lens[0]
        else:
            ids[row:] = 0
            positions[row:] = 0
            cu[part:] = row
            context_lens[part:] = 0
        real = len(batch.seqs)
        rows = real + batch.token_rows
        if batch.token_rows:
            self._token_rows(batch, logits_indices[real:rows])
        logits_indices[rows:] = 0
        return buf

    def _token_rows(self, batch: ScheduledBatch, out: np.ndarray) -> None:
        """Point the spare logits rows at every fed token but the last (whose row the sampler already has)
        of each sequence that wants a row per token, in batch order (prompt logprobs, drafts to verify)."""
        at, row = 0, 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if seq.wants_token_rows and n > 1:
                np.add(self._arange[:n - 1], row, out=out[at:at + n - 1])
                at += n - 1
            row += n


def step_limits(manifest: Manifest, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int, int]:
    """`GearSelector.fit_limits` on the artifact's gears: for the engine and a draft, before their runners exist
    (their pools are sized by the clamped sequences)."""
    return GearSelector({name: f.gears for name, f in manifest.families.items()}).fit_limits(
        max_num_seqs, max_num_batched_tokens)


class GraphError(RuntimeError):
    """A step's graph (or the block copies before it) failed: the step's sequences fail, every other request goes
    on."""


@dataclass
class RunStats:
    """What a runner's graphs ran, cumulative (for metrics and benchmarks)."""

    steps: int = 0
    graph_s: float = 0.0  # the block copies and the graph
    tokens_computed: int = 0  # rows the graphs ran, padding included
    tokens_real: int = 0
    bucket_hits: dict[str, int] = field(default_factory=dict)

    def record(self, family: str, gear: Gear, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.graph_s += seconds
        self.tokens_computed += gear.tokens
        self.tokens_real += tokens
        key = gear.label(family)
        self.bucket_hits[key] = self.bucket_hits.get(key, 0) + 1


class ModelRunner:
    """Runs scheduled batches on one artifact's graphs over `pools` (its own, or a target's for a draft)."""

    def __init__(self, artifact: Path, manifest: Manifest, pools: KVPools, executor: str = "onnxruntime",
                 threads: int | None = None, custom_ops: CustomOps = "auto", batch_invariant: bool = False,
                 stats: RunStats | None = None) -> None:
        self.pools = pools
        self.packer = Packer(manifest, batch_invariant)
        self.executor_name = executor
        self.executor = make_executor(executor, artifact, manifest, pools, threads, custom_ops)
        self.stats = stats if stats is not None else RunStats()

    @property
    def gears(self) -> dict[str, list[Gear]]:
        """Each family's gears, ascending."""
        return self.packer.gears

    def run(self, batch: ScheduledBatch) -> np.ndarray:
        """The batch's logits rows (`batch.num_logits_rows` of them first), valid until the next run.

        The block copies run first: the batch's block tables already point at them. Choosing and packing only read
        the batch, so a failure there is a bug that fails the whole step; a failure from the copies on is a
        GraphError, which fails only this batch's sequences."""
        family, gear = self.packer.select(batch)
        inputs = self.packer.pack(batch, gear)
        start = time.perf_counter()
        try:
            if batch.copies:
                self.pools.copy_blocks(batch.copies)
            return self.executor.run(gear, inputs)
        except Exception as exc:
            raise GraphError(str(exc)) from exc
        finally:
            self.stats.record(family, gear, batch.total_tokens, time.perf_counter() - start)

    def batch_variance(self) -> str | None:
        """Why this runner's greedy rows may depend on the batch; None: they do not (with a batch-invariant
        scheduler: docs/performance.md, "Batch invariance")."""
        if self.executor_name != "onnxruntime":
            return f"not checked on the {self.executor_name} executor"
        if self.executor.custom_ops is False:
            return ("the fused ops run as their ONNX function bodies (custom ops off or unbuilt), whose attention "
                    "reductions follow the batch")
        odd = self.packer.odd_widest_gears()
        if odd:
            return f"the widest gears {odd} have an odd T or B: MatMulNBits computes a lone last row another way"
        return None

    def decode_step_s(self, runs: int) -> float:
        """Seconds of one step in the smallest decode gear, all padding (its slots are the null block's), the fastest
        of `runs` (the first also warms it up): what a draft token costs against a target decode, on this machine."""
        gear = self.gears[DECODE][0]
        inputs = self.packer.pack(ScheduledBatch(), gear)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            self.executor.run(gear, inputs)
            times.append(time.perf_counter() - start)
        return min(times)
