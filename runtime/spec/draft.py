"""`draft_model` proposals: a smaller artifact with the same tokenizer, run by a model runner of its own (its own
gears and executor), K tokens per step.

Each target sequence has a shadow sequence that holds its verified tokens and, while proposing, the drafts. Where
the K/V of those tokens comes from depends on the draft:
- the target's model at another precision (runtime/spec/build.py, `shares_kv`) runs on the target's pools: the
  verified tokens' K/V is the target's, so nothing is prefilled or caught up. The shadow borrows the target's
  block table; the slots past its computed tokens, where the drafts' K/V is written, are allocated in the target's
  pool for the proposal and given back after it (a last block shared with a fork is copied first, as the
  target's step would copy it), and the verification writes those positions again before any query reads them.
  Each proposal is K decode steps, the first feeding the target's last token. A float cache only: an int8 one's
  scales belong to each artifact's graph.
- any other draft keeps its own pool with prefix caching. Before a proposal the shadow keeps its K/V up to the
  longest prefix its own earlier drafts share with the verified tokens (the draft's cache rolls back like the
  target's); the rest is fed in one packed step with every other speculating sequence (as decode rows in a decode
  gear when they fit one, which at B=1 costs a decode step where a prefill gear's tile costs several; chunked when
  it exceeds the draft's largest prefill gear), and the last row gives the first draft; then K - 1 decode steps of
  the draft give the others. Every prompt is prefilled by the draft too.
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from ..kv_cache_manager import KVCacheManager
from ..model_runner import ModelRunner
from ..sampling_params import SamplingParams
from ..scheduler import ScheduledBatch, Sequence, packing_order
from ...graphs.contract import DECODE, PREFILL
from .rejection import target_probs

SHADOW_PARAMS = SamplingParams(temperature=0)  # what the shadow carries: nothing the packer or pool reads


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, k: int, vocab_size: int, cost: float,
                 shared: bool = False) -> None:
        """`runner`: the draft's model runner; `kv`: the manager of its pools' blocks. `shared`: those are the
        target's pools and manager. `cost`: a draft token's cost in target decode steps (`Proposer.cost`), from both
        runners' decode steps timed."""
        self.runner = runner
        self.kv = kv
        self.shared = shared
        self.cost = cost
        self.sizes_drafts = False  # the speculator paces it by acceptance and cost
        self.k = k
        self.vocab_size = vocab_size
        prefill = runner.gears[PREFILL]
        self.max_tokens = max(g.tokens for g in prefill)
        self.max_seqs = max(g.seqs for g in prefill)
        self.max_decode_rows = max(g.seqs for g in runner.gears[DECODE])
        self._shadows: dict[Sequence, Sequence] = {}
        self._q: dict[Sequence, np.ndarray] = {}  # [k, vocab] float32, made once per sampled sequence
        self._scratch = np.empty(vocab_size, np.float64)

    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, holding its verified tokens: on the target's block table and computed tokens (shared
        pools), or on its own K/V, kept where its last drafts were right."""
        kv, n = self.kv, seq.num_verified_tokens
        shadow = self._shadows.get(seq)
        if shadow is None:
            shadow = self._shadows[seq] = Sequence(seq.request_id, seq.prompt_token_ids, SHADOW_PARAMS, seq.arrival,
                                                   token_ids=seq.token_ids[:n])
            same = n
            if not self.shared:
                kv.allocate_slots(shadow, 0, kv.computed_blocks(shadow))  # prefix hits only: nothing to allocate
        else:
            tokens, verified = shadow.token_ids, seq.token_ids
            same = shadow.num_verified_tokens
            limit = min(len(tokens), n)
            while same < limit and tokens[same] == verified[same]:
                same += 1
            del tokens[same:]
            tokens.extend(verified[same:n])
        shadow.num_draft_tokens = 0
        if self.shared:
            shadow.block_table = seq.block_table
            shadow.num_computed_tokens = seq.num_computed_tokens
        elif shadow.num_computed_tokens > min(same, n - 1):  # the last token is always fed: its row gives a draft
            kv.rollback(shadow, min(same, n - 1))
        return shadow

    def _feed(self, group: list[tuple[Sequence, int]]) -> tuple[list[Sequence], np.ndarray]:
        """Run one draft step feeding n tokens of each shadow; the shadows that got room, and their logits rows."""
        kv, batch = self.kv, ScheduledBatch()
        for shadow, n in packing_order(group):
            copies = kv.allocate_slots(shadow, n)
            if copies is None:  # the pool is short: this sequence gets no proposal this step
                continue
            if not self.shared:
                kv.cache_blocks(shadow, shadow.num_computed_tokens + n)
            batch.add(shadow, n, copies)
        if not batch.seqs:
            return [], np.empty((0, self.vocab_size), np.float32)
        batch.decode_rows = batch.total_tokens <= self.max_decode_rows  # most catch-ups: the kept drafts, a few
        logits = self.runner.run(batch)
        for shadow, n in zip(batch.seqs, batch.num_tokens):
            shadow.num_computed_tokens += n
        return batch.seqs, logits

    def _catch_up(self, shadows: dict[Sequence, Sequence], drafts: dict[Sequence, list[int]]) -> None:
        """Feed every shadow's uncomputed tokens; the row after each one's last token gives its sequence's first
        draft, chosen before the next step overwrites the logits."""
        todo = list(shadows)
        bs = self.kv.block_size
        while todo:
            group, budget = [], self.max_tokens
            for shadow in todo:
                n = min(shadow.num_uncomputed, budget)
                if n < shadow.num_uncomputed:
                    n -= n % bs
                if n == 0 or len(group) == self.max_seqs:
                    break
                group.append((shadow, n))
                budget -= n
            fed, logits = self._feed(group)
            for i, shadow in enumerate(fed):
                if shadow.num_uncomputed == 0:
                    seq = shadows[shadow]
                    drafts[seq].append(self._choose(seq, logits[i], 0))
            todo = [s for s, _ in group if s in fed and s.num_uncomputed] + todo[len(group):]

    def _choose(self, seq: Sequence, row: np.ndarray, j: int) -> int:
        params = seq.params
        if params.greedy:
            return int(np.argmax(row))
        q = self._q.get(seq)
        if q is None:
            q = self._q[seq] = np.empty((self.k, self.vocab_size), np.float32)
        q[j] = target_probs(row, params, self._scratch)
        assert seq.rng is not None
        mass = np.cumsum(self._scratch)
        return int(np.searchsorted(mass, seq.rng.random() * mass[-1], side="right"))

    def propose(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[list[int]]:
        wanted = {seq: k for seq, k in zip(seqs, lengths) if k}
        shadows = {self._sync(seq): seq for seq in wanted}
        drafts: dict[Sequence, list[int]] = {seq: [] for seq in seqs}
        try:
            self._draft(shadows, wanted, drafts)
        finally:
            if self.shared:  # give the borrowed slots back (a shared last block stays copied, as the step would have)
                for shadow, seq in shadows.items():
                    self.kv.rollback(shadow, seq.num_computed_tokens)
        return [drafts[seq] for seq in seqs]

    def _draft(self, shadows: dict[Sequence, Sequence], wanted: dict[Sequence, int],
               drafts: dict[Sequence, list[int]]) -> None:
        self._catch_up(shadows, drafts)
        for j in range(1, max(wanted.values(), default=0)):
            group = []
            for shadow, seq in shadows.items():
                draft = drafts[seq]
                if len(draft) == j and j < wanted[seq]:
                    shadow.token_ids.append(draft[-1])
                    shadow.num_draft_tokens += 1
                    group.append((shadow, 1))
            if not group:
                break
            fed, logits = self._feed(group)
            for i, shadow in enumerate(fed):
                seq = shadows[shadow]
                drafts[seq].append(self._choose(seq, logits[i], j))

    def draft_probs(self, seq: Sequence) -> np.ndarray | None:
        return None if seq.params.greedy else self._q.get(seq)

    def release(self, seq: Sequence) -> None:
        shadow = self._shadows.pop(seq, None)
        if shadow is not None and not self.shared:
            self.kv.free(shadow)
        self._q.pop(seq, None)
