"""The pool of KV blocks: ownership by reference count, block 0 reserved as the null block."""
from __future__ import annotations

from collections import deque

from graphs.contract import NULL_BLOCK


class BlockPool:
    """Hands out block ids; a block returns to the free list when its last reference drops.

    Invariant: every block but the null block is either free (ref count 0, in the free list)
    or referenced (ref count > 0, not in the free list).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(b for b in range(num_blocks) if b != NULL_BLOCK)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise MemoryError(f"asked for {count} blocks, {len(self.free)} free")
        blocks = [self.free.popleft() for _ in range(count)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference of each; freed blocks go back in reverse so a sequence's tail is reused first."""
        for b in reversed(blocks):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free.append(b)
