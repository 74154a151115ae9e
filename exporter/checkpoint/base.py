"""What every checkpoint reader hands to the exporter."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ...graphs.config import ModelConfig
from ...graphs.quant import Weight


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message says which file and what to do."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as HF `tokenizers` JSON, plus what generation needs from it."""

    tokenizer_json: str
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool


class LazyTensors(Mapping[str, Weight]):
    """Checkpoint tensors read from their file each time they are accessed, and never kept: the exporter holds one
    tensor (or one fused graph weight) at a time, whatever the checkpoint's size."""

    def __init__(self, loaders: Mapping[str, Callable[[], Weight]]) -> None:
        self._loaders = loaders

    def __getitem__(self, name: str) -> Weight:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass(frozen=True)
class Checkpoint:
    """Weights under the Hugging Face names the model's family declares (graphs/models: `checkpoint_shapes`),
    [out, in] for linear layers (read on access: `LazyTensors`): float32 numpy, or `BlockQuantized` where a GGUF
    was read with its blocks kept (export `quantization: gguf`) or an HF checkpoint was quantized with GPTQ / AWQ
    (always kept: `quantization`). Q/K projections are in HF's rotate-half layout (GGUF's interleaved layout is
    undone by the reader)."""

    config: ModelConfig
    tensors: Mapping[str, Weight]
    tokenizer: TokenizerSpec
    source: str
    # The checkpoint's own sampling defaults (HF generation_config.json), under SamplingParams' names; GGUF has none.
    generation_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    generation_source: str = ""  # where generation_defaults came from, recorded in the manifest
    # The checkpoint's own quantization, read as it is: "gptq" / "awq" (HF quantization_config), else "none".
    quantization: str = "none"
