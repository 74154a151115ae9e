"""The GGUF-built tokenizer against transformers' committed outputs, and streaming detokenization.

tests/data/*.json come from scripts/make_reference.py (transformers 5.24); these tests need neither
torch nor transformers.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from pagedgraph.exporter.checkpoint.base import Checkpoint, TokenizerSpec
from pagedgraph.exporter.tokenizer_files import write_tokenizer
from pagedgraph.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.paths import DATA, REPO

pytestmark = pytest.mark.unit
TOKENIZER_CASES: list[dict[str, Any]] = json.loads((DATA / "tokenizer_reference.json").read_text(encoding="utf-8"))
PROMPTS: list[dict[str, Any]] = [json.loads(line) for line in (DATA / "reference_prompts.jsonl").read_text(encoding="utf-8").splitlines()]
REFERENCE: list[dict[str, Any]] = json.loads((DATA / "reference_smollm2.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def spec(smollm2_checkpoint: Checkpoint) -> TokenizerSpec:
    return smollm2_checkpoint.tokenizer


@pytest.fixture(scope="module")
def tok(spec: TokenizerSpec, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """Through the artifact files, as the runtime sees it."""
    out = tmp_path_factory.mktemp("artifact")
    write_tokenizer(spec, out)
    return Tokenizer.from_dir(out)


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_tokenizer_config_file(spec: TokenizerSpec, tok: Tokenizer) -> None:
    assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos_token
    assert tok.chat_template == spec.chat_template and "<|im_start|>" in spec.chat_template
    assert tok.vocab_size == 49152


@pytest.mark.parametrize("case", TOKENIZER_CASES, ids=range(len(TOKENIZER_CASES)))
def test_encode_decode_match_transformers(tok: Tokenizer, case: dict[str, Any]) -> None:
    assert tok.encode(case["text"]) == case["ids"]
    assert tok.decode(case["ids"]) == case["decoded"]


def test_reference_prompt_ids_match_transformers(tok: Tokenizer) -> None:
    assert len(PROMPTS) == len(REFERENCE) == 16
    for number, (request, reference) in enumerate(zip(PROMPTS, REFERENCE)):
        if "messages" in request:
            ids = tok.encode(tok.apply_chat_template(request["messages"]), add_special_tokens=False)
        else:
            ids = tok.encode(request["prompt"])
        assert ids == reference["prompt_token_ids"], f"request {number}"


def test_reference_prompts_span_short_to_long() -> None:
    lengths = [len(r["prompt_token_ids"]) for r in REFERENCE]
    assert min(lengths) == 1 and max(lengths) >= 900
    assert all(len(r["token_ids"]) == len(r["top2_gap"]) == 64 for r in REFERENCE)


def test_incremental_equals_full_decode(tok: Tokenizer) -> None:
    sequences = [c["ids"] for c in TOKENIZER_CASES]
    sequences += [r["prompt_token_ids"] + r["token_ids"] for r in REFERENCE]
    for skip in (False, True):
        for ids in sequences:
            assert "".join(_stream(tok.detokenizer(skip_special_tokens=skip), ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_never_splits_a_character(tok: Tokenizer) -> None:
    emoji = "👨‍👩‍👧‍👦"
    ids = tok.encode(f"family {emoji} and flag 🇫🇷!")
    assert len(ids) > 10  # the emoji really span several byte-level tokens
    chunks = _stream(tok.detokenizer(), ids)
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) == f"family {emoji} and flag 🇫🇷!"
    assert chunks.count("") > 0  # bytes were held back until a character completed


def test_incremental_matches_lossy_decode_of_random_ids(tok: Tokenizer) -> None:
    """Sampling can produce byte sequences that are not UTF-8; both paths must replace them alike."""
    rng = random.Random(0)
    for skip in (False, True):
        for _ in range(5):
            ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
            assert "".join(_stream(tok.detokenizer(skip_special_tokens=skip), ids)) == tok.decode(ids, skip_special_tokens=skip)


def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nHi"
    assert "".join(_stream(tok.detokenizer(skip_special_tokens=True), ids)) == "assistant\nHi"


def _byte_fallback_tokenizer(tmp_path: Path) -> Tokenizer:
    """A SentencePiece-style vocabulary (▁ for spaces, <0xNN> byte fallback): the window decoder."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    for word in ("▁", "h", "i", "▁h", "▁hi", "!"):
        vocab[word] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[("▁", "h"), ("▁h", "i")], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": None, "eos_token_ids": [0], "bos_token_id": None, "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(tmp_path)


def test_window_detokenizer_for_byte_fallback_vocabularies(tmp_path: Path) -> None:
    tok = _byte_fallback_tokenizer(tmp_path)
    ids = [tok.backend.token_to_id(t) for t in ("▁hi", "▁")] + [1 + b for b in "🎉".encode()] + [tok.backend.token_to_id("!")]
    chunks = _stream(tok.detokenizer(), ids)
    assert "".join(chunks) == tok.decode(ids) == "hi 🎉!"
    assert "🎉" in chunks and not any("\ufffd" in c for c in chunks)
    # an incomplete character at the end comes out as U+FFFD (one per byte here), as in a full decode
    truncated = ids[:4]
    assert "".join(_stream(tok.detokenizer(), truncated)) == tok.decode(truncated) == "hi \ufffd\ufffd"


def test_chat_template_environment() -> None:
    template = (
        "{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('role ' + m.role) }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{{ bos_token }}{{ m.content | tojson }}\n{% endfor %}"
    )
    tok = Tokenizer(Backend(models.BPE({"<s>": 0}, [])), chat_template=template, eos_token_ids=[0], bos_token_id=0,
                    add_bos_token=False)
    messages = [{"role": "user", "content": "<é>"}] * 3
    assert tok.apply_chat_template(messages) == '<s>"<é>"\n<s>"<é>"\n'
    with pytest.raises(jinja2.TemplateError, match="role bad"):
        tok.apply_chat_template([{"role": "bad", "content": ""}])


def test_no_chat_template_error(tmp_path: Path) -> None:
    tok = _byte_fallback_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_from_dir_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_runtime_tokenizer_does_not_import_exporter() -> None:
    code = "import sys, pagedgraph.runtime.tokenizer; sys.exit(any(m.startswith('pagedgraph.exporter') for m in sys.modules))"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
