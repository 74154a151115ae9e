"""Checkpoint readers: each returns a `Checkpoint` with weights under canonical (HF LLaMA) names."""
from __future__ import annotations

import os
from pathlib import Path

from ...graphs.config import Pooling
from .base import Checkpoint, CheckpointError, TokenizerSpec
from .hf_reader import read_hf_dir

__all__ = ["Checkpoint", "CheckpointError", "TokenizerSpec", "read_checkpoint", "read_hf_dir", "source_path"]


DEFAULT_SOURCE = "default"


def source_path(path: str | os.PathLike[str]) -> Path:
    """The file or directory a model source names ("default": the bundled SmolLM2 GGUF)."""
    if str(path) == DEFAULT_SOURCE:
        from .gguf_reader import default_model_path

        return default_model_path()
    return Path(path)


def read_checkpoint(path: str | os.PathLike[str], keep_blocks: bool = False,
                    pooling: Pooling | None = None) -> Checkpoint:
    """Pick the reader from what `path` is: a HF directory, a `.gguf` file, or "default" (SmolLM2).

    `keep_blocks`: a GGUF's quantized tensors stay in their blocks (else dequantized to float32). A GPTQ / AWQ
    checkpoint directory's always do (`Checkpoint.quantization` says which): their blocks are only read as they are.
    `pooling`: the head of an embedding export (ModelConfig.pooling), which reads no LM head."""
    p = source_path(path)
    if p.is_dir():
        return read_hf_dir(p, pooling)
    if p.is_file() and p.suffix.lower() == ".gguf":
        # Imported lazily so HF-only users never need the gguf package.
        from .gguf_reader import read_gguf

        return read_gguf(p, keep_blocks=keep_blocks, pooling=pooling)
    if not p.exists():
        raise CheckpointError(f"{p} does not exist; pass a Hugging Face checkpoint directory or a .gguf file")
    raise CheckpointError(
        f"{p} is neither a directory nor a .gguf file; pass a Hugging Face checkpoint directory "
        "(config.json + safetensors + tokenizer.json) or a .gguf file"
    )
