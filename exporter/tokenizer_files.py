"""Write a checkpoint's tokenizer into an artifact directory, in the format `pagedgraph.runtime.tokenizer` reads."""
from __future__ import annotations

import json
from pathlib import Path

from .checkpoint.base import TokenizerSpec

# Same names as runtime.tokenizer (the exporter does not import the runtime).
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def write_tokenizer(spec: TokenizerSpec, out_dir: str | Path) -> None:
    """`tokenizer.json` (HF tokenizers JSON, verbatim) and `tokenizer_config.json` (chat template,
    EOS ids, BOS id and whether to prepend it) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(spec.tokenizer_json, encoding="utf-8")
    config = {
        "chat_template": spec.chat_template,
        "eos_token_ids": list(spec.eos_token_ids),
        "bos_token_id": spec.bos_token_id,
        "add_bos_token": spec.add_bos_token,
    }
    (out / TOKENIZER_CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
