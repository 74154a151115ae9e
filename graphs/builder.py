"""The op vocabulary a model definition is written against; each lowering implements it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


class OpBuilder(ABC, Generic[T]):
    """Builds (or evaluates) one bucket graph. `T` is the lowering's tensor handle."""

    @abstractmethod
    def input(self, name: str) -> T: ...

    @abstractmethod
    def weight(self, name: str) -> T: ...

    @abstractmethod
    def output(self, name: str, value: T) -> None: ...

    @abstractmethod
    def gather(self, table: T, indices: T) -> T:
        """Rows of `table` (axis 0) picked by `indices`."""

    @abstractmethod
    def add(self, a: T, b: T) -> T: ...

    @abstractmethod
    def split(self, x: T, sizes: Sequence[int]) -> list[T]:
        """Split the last axis into consecutive pieces."""

    @abstractmethod
    def linear(self, x: T, weight: T, bias: T | None = None) -> T: ...

    @abstractmethod
    def rms_norm(self, x: T, weight: T, epsilon: float) -> T: ...

    @abstractmethod
    def rope(self, query: T, key: T, cos: T, sin: T, head_dim: int) -> tuple[T, T]: ...

    @abstractmethod
    def swiglu(self, x: T) -> T: ...

    @abstractmethod
    def reshape_and_cache(self, key: T, value: T, k_cache: T, v_cache: T, slot_mapping: T) -> tuple[T, T]:
        """Returns the written pools; later readers must use these so the write is ordered first."""

    @abstractmethod
    def paged_attention(self, query: T, k_cache: T, v_cache: T, block_tables: T, context_lens: T,
                        cu_seqlens_q: T | None, *, head_num: int, kv_head_num: int, qk_scale: float,
                        block_size: int) -> T: ...

    @abstractmethod
    def self_attention(self, query: T, key: T, value: T, cu_seqlens_q: T, *, head_num: int,
                       kv_head_num: int, qk_scale: float) -> T: ...
