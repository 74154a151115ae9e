"""The routing ops of a Mixture-of-Experts layer, with Ascend's names and contracts (ops-transformer's aclnn docs).

A MoE FFN on T tokens with top-k routing is, on Ascend and here alike (graphs/moe.py):
  MoeGatingTopKSoftmax(router logits) -> MoeInitRouting (V2: tokens sorted by expert, T*k rows)
  -> GroupedMatmul (graphs/ops/grouped_matmul.py) per expert group -> MoeTokenUnpermute (weighted sum back).
Every shape is static per bucket: T tokens always give T*k expanded rows, whatever the routing; only how those
rows split into expert groups changes from step to step, so the work follows the k chosen experts per token and
never the E experts of the layer.

Why MoeTokenUnpermute and not MoeFinalizeRouting: Finalize reads expandedRowIdx as V1 routing lays it out
(index i + j*T, k-major), while MoeInitRoutingV2 writes it row-major (index i*k + j); the two agree only for k = 1,
the accuracy issue vllm-ascend reports. MoeTokenUnpermute reads it row-major (MindFormers and vllm-ascend pair it
with MoeInitRoutingV2), and the residual add stays the following AddRmsNorm's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .examples import normal
from .op import Attributes, Example, Op, Tensor

# expert_tokens_count_or_cumsum_flag (MoeInitRoutingV2): the tokens per expert as a running sum, or as counts.
CUMSUM, COUNT = 1, 2


@dataclass(frozen=True)
class GatingAttributes(Attributes):
    k: int  # experts per token
    renormalize: int  # 1: the k weights divided by their sum (Qwen3-MoE's norm_topk_prob, Mixtral); 0: as softmax gave


@dataclass(frozen=True)
class InitRoutingAttributes(Attributes):
    expert_num: int
    expert_tokens_count_or_cumsum_flag: int  # CUMSUM (1) or COUNT (2), MoeInitRoutingV2's values


def moe_gating_top_k_softmax(x: np.ndarray, *, k: int, renormalize: int) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over the experts, then the k largest (descending; ties to the lower expert id, as a stable sort)."""
    logits = x.astype(np.float32)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = p / p.sum(axis=1, keepdims=True)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :k]
    y = np.take_along_axis(p, idx, axis=1)
    if renormalize:
        y = y / y.sum(axis=1, keepdims=True)
    return y.astype(np.float32), idx.astype(np.int32)


def moe_init_routing(x: np.ndarray, expert_idx: np.ndarray, *, expert_num: int,
                     expert_tokens_count_or_cumsum_flag: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """V2, dropless: the flattened (token, slot) pairs stably sorted by expert; expanded_x[i] is the token of the
    i-th sorted pair, expanded_row_idx[t*k + j] the expanded row of pair (t, j), and the tokens per expert."""
    k = expert_idx.shape[1]
    flat = expert_idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    row_idx = np.empty(len(flat), np.int32)
    row_idx[order] = np.arange(len(flat), dtype=np.int32)
    counts = np.bincount(flat, minlength=expert_num).astype(np.int64)
    tokens = counts if expert_tokens_count_or_cumsum_flag == COUNT else np.cumsum(counts)
    return x[order // k].astype(x.dtype), row_idx, tokens


def moe_token_unpermute(permuted_tokens: np.ndarray, sorted_indices: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """out[t] = sum_j probs[t, j] * permuted_tokens[sorted_indices[t*k + j]] (the slots summed in order j = 0..k-1)."""
    tokens, k = probs.shape
    rows = permuted_tokens[sorted_indices].reshape(tokens, k, -1).astype(np.float32)
    out = np.zeros((tokens, rows.shape[2]), np.float32)
    for j in range(k):
        out += probs[:, j:j + 1] * rows[:, j]
    return out


def routing_example(rng: np.random.Generator, tokens: int, experts: int, k: int, skew: bool = False) -> np.ndarray:
    """expert_idx [tokens, k]: k distinct experts per token; `skew` sends most tokens to a few experts (empty groups
    and crowded ones, as real routers do)."""
    weights = np.arange(experts, 0, -1, dtype=np.float64) ** 4 if skew else np.ones(experts)
    return np.stack([rng.choice(experts, k, replace=False, p=weights / weights.sum())
                     for _ in range(tokens)]).astype(np.int32)


def _gating_examples() -> Iterator[Example]:
    rng = np.random.default_rng(0)
    for tokens, experts, k, renormalize, label in ((1, 8, 2, 1, "decode, Mixtral's top-2"),
                                                   (7, 64, 8, 0, "64 experts, top-8, softmax weights"),
                                                   (33, 64, 8, 1, "64 experts, top-8, norm_topk_prob")):
        yield Example((normal(rng, tokens, experts, scale=3.0),), dict(k=k, renormalize=renormalize), atol=1e-6,
                      label=label)


def _init_routing_examples() -> Iterator[Example]:
    rng = np.random.default_rng(1)
    for tokens, experts, k, skew, flag in ((1, 8, 2, False, COUNT), (5, 16, 4, True, CUMSUM),
                                           (40, 64, 8, True, COUNT), (40, 64, 8, False, CUMSUM)):
        label = f"{tokens} tokens, {experts} experts, top-{k}{', skewed' if skew else ''}, " \
                f"{'counts' if flag == COUNT else 'cumsum'}"
        yield Example((normal(rng, tokens, 24), routing_example(rng, tokens, experts, k, skew)),
                      dict(expert_num=experts, expert_tokens_count_or_cumsum_flag=flag), atol=0, rtol=0, label=label)


def _unpermute_examples() -> Iterator[Example]:
    rng = np.random.default_rng(2)
    for tokens, k in ((1, 8), (9, 2), (40, 8)):
        probs = rng.uniform(0.0, 1.0, (tokens, k)).astype(np.float32)
        yield Example((normal(rng, tokens * k, 24), rng.permutation(tokens * k).astype(np.int32), probs), {},
                      atol=1e-6, label=f"{tokens} tokens, top-{k}")


MOE_GATING_TOP_K_SOFTMAX = Op(
    name="MoeGatingTopKSoftmax",
    atb="aclnnMoeGatingTopKSoftmax (+ a Div for renormalize)",
    inputs=(Tensor("x", ("T", "E")),),
    outputs=(Tensor("y", ("T", "k")), Tensor("expert_idx", ("T", "k"), ("int32",))),
    reference=moe_gating_top_k_softmax,
    attributes=GatingAttributes,
    examples=_gating_examples,
    doc="router logits -> the top-k experts per token and their softmax weights (renormalized on request); "
        "Ascend's third output rowIdx feeds only V1 routing and is left out",
)

MOE_INIT_ROUTING = Op(
    name="MoeInitRouting",
    atb="aclnnMoeInitRoutingV2 (dropPadMode 0, dropless)",
    inputs=(Tensor("x", ("T", "H")), Tensor("expert_idx", ("T", "k"), ("int32",))),
    outputs=(Tensor("expanded_x", ("T * k", "H")), Tensor("expanded_row_idx", ("T * k",), ("int32",)),
             Tensor("expert_tokens", ("expert_num",), ("int64",))),
    reference=moe_init_routing,
    attributes=InitRoutingAttributes,
    examples=_init_routing_examples,
    doc="tokens copied into T*k rows sorted by expert, the row of each (token, slot), tokens per expert "
        "(GroupedMatmul's group list: counts or cumsum)",
)

MOE_TOKEN_UNPERMUTE = Op(
    name="MoeTokenUnpermute",
    atb="aclnnMoeTokenUnpermute (paddedMode false)",
    inputs=(Tensor("permuted_tokens", ("R", "H")), Tensor("sorted_indices", ("R",), ("int32",)),
            Tensor("probs", ("T", "k"))),
    outputs=(Tensor("out", ("T", "H")),),
    reference=moe_token_unpermute,
    examples=_unpermute_examples,
    doc="the experts' rows back to their tokens, weighted by the routing weights and summed over the k slots",
)
