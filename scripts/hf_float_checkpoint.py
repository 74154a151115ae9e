"""The default model as the float HF directory the GPTQ / AWQ checkpoint scripts quantize, and their calibration.

scripts/gptq_checkpoint.py and scripts/awq_checkpoint.py both start from the bundled SmolLM2 GGUF as transformers
reads it (dequantized to float32, nothing from a hub) and calibrate on the shipped calibration text, never on the
held-out text the perplexity is measured on.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from pagedgraph.texts import shipped_text
from scripts.hf_perplexity import load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options both checkpoint scripts take: where to write, and the calibration windows."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=8, help="calibration windows")
    parser.add_argument("--context", type=int, default=512, help="tokens per calibration window")


def save_float_checkpoint(out: Path) -> tuple[Any, Any]:
    """The default GGUF's model (float32, eval mode) and tokenizer, saved to `out` as a plain HF directory."""
    model, tokenizer = load()
    # save_pretrained refuses a GGUF-loaded model ("quantized with gguf"): its weights are float32 by now
    model.config.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tied = model.config.tie_word_embeddings
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
              str(out / "model.safetensors"))
    tokenizer.save_pretrained(out)
    return model, tokenizer


def calibration_windows(tokenizer: Any, windows: int, context: int) -> list[list[int]]:
    """The shipped calibration text's tokens in at most `windows` windows of `context` (the last may be shorter)."""
    ids = tokenizer(shipped_text("calibration"))["input_ids"]
    return [ids[begin:begin + context] for begin in range(0, min(len(ids), windows * context), context)]
