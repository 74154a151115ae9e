"""Block hashes for prefix caching: each full block's hash chains its parent's hash and its token ids.

Chaining makes a hash name the whole prefix up to the block's end, so equal hashes mean equal
K/V (same model, same positions). SHA-256 keeps accidental collisions, which would silently
serve another prompt's K/V, out of reach; the salt separates deployments that must not share
blocks (its digest is the root parent).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence


def root_hash(salt: bytes) -> bytes:
    return hashlib.sha256(b"pagedgraph-prefix-root:" + salt).digest()


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_hashes(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int,
                  num_blocks: int) -> None:
    """Grow `hashes` (one per full block of `token_ids`, in order) to `num_blocks` entries."""
    for b in range(len(hashes), num_blocks):
        parent = hashes[b - 1] if b else root
        hashes.append(block_hash(parent, token_ids[b * block_size:(b + 1) * block_size]))
