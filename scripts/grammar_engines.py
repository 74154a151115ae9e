"""llguidance vs xgrammar on an artifact's tokenizer: the figures behind docs/performance.md's choice.

    pip install llguidance xgrammar   # xgrammar is not a pagedgraph dependency; this script alone needs it
    python scripts/grammar_engines.py ARTIFACT_DIR

Measures, on the artifact's vocabulary: tokenizer set-up, compile time per JSON schema (cold: first mask
included, since llguidance builds its lexer lazily), and the per-step mask time of B=16 matchers walking
valid documents token by token (what the sampler pays per decode step).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedgraph.runtime.tokenizer import Tokenizer  # noqa: E402

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False},
             {"name": "Ada Lovelace", "age": 36}),
    "enum+array": ({"type": "object", "properties": {
        "label": {"enum": ["positive", "negative", "neutral"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "score": {"type": "number"}}, "required": ["label", "tags", "score"], "additionalProperties": False},
        {"label": "neutral", "tags": ["a", "bb", "ccc"], "score": 0.25}),
    "nested": ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer"}, "email": {"type": "string", "format": "email"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                        "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["id", "email", "address"], "additionalProperties": False},
        "orders": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["user", "orders"], "additionalProperties": False},
        {"user": {"id": 7, "email": "ada@example.com", "address": {"city": "London", "zip": "12345"}},
         "orders": [{"sku": "X-1", "qty": 2}, {"sku": "Y-22", "qty": 1}]}),
    "json_object": ({"type": "object"}, {"answer": "yes", "reasons": ["one", "two"], "confidence": 0.9}),
}
BATCH = 16


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import llguidance
        import llguidance.numpy
        self.llg, self.np = llguidance, llguidance.numpy
        self.vocab = tokenizer.vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab,
                                                eos_token=list(tokenizer.eos_token_ids))
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        mask = self.np.allocate_token_bitmask(1, self.vocab)
        self.np.fill_next_token_bitmask(matcher, mask, 0)  # the lexer is built lazily: include it
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def allocate(self) -> np.ndarray:
        return self.np.allocate_token_bitmask(BATCH, self.vocab)

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            self.np.fill_next_token_bitmask(m, mask, i)

    def fill_parallel(self, matchers: list[Any], mask: np.ndarray) -> None:
        self.np.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast
        self.xgr = xgrammar
        self.vocab = tokenizer.vocab_size
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab,
                                                       stop_token_ids=list(tokenizer.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))
        matcher = self.xgr.GrammarMatcher(compiled)
        mask = self.allocate()
        matcher.fill_next_token_bitmask(mask, 0)
        return compiled

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def allocate(self) -> np.ndarray:
        return np.full((BATCH, (self.vocab + 31) // 32), -1, dtype=np.int32)

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    fill_parallel = None

    def accept(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token), token


def measure(engine_type: type, tokenizer: Tokenizer) -> dict[str, Any]:
    init_s, engine = timed(lambda: engine_type(tokenizer))
    row: dict[str, Any] = {"tokenizer_init_ms": init_s * 1e3, "compile_ms": {}, "mask_ms_per_step": {}}
    for name, (schema, instance) in SCHEMAS.items():
        compile_s, compiled = timed(lambda: engine.compile(schema))
        row["compile_ms"][name] = compile_s * 1e3
        tokens = tokenizer.encode(json.dumps(instance), add_special_tokens=False)
        for mode, fill in (("serial", engine.fill), ("parallel", engine.fill_parallel)):
            if fill is None:
                continue
            matchers = [engine.matcher(compiled) for _ in range(BATCH)]
            mask = engine.allocate()
            steps = []
            for token in tokens:
                step_s, _ = timed(lambda: fill(matchers, mask))
                steps.append(step_s)
                bits = mask[0, token // 32] >> (token % 32) & 1
                assert bits, f"{engine.name} masked out a token of a valid document ({name}, {token})"
                for m in matchers:
                    engine.accept(m, token)
            row["mask_ms_per_step"][f"{name}/{mode}"] = statistics.median(steps) * 1e3
    return row


def apply_cost(vocab: int) -> float:
    """ms to apply B=16 bitmasks to copies of B x vocab float32 logits rows, as StructuredOutputs does."""
    from pagedgraph.runtime.structured_output import _BYTE_BIAS
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((BATCH, vocab), dtype=np.float32)
    mask = rng.integers(-2**31, 2**31 - 1, size=(BATCH, (vocab + 31) // 32), dtype=np.int32)
    bias = np.empty((BATCH, mask.shape[1] * 4, 8), np.float32)
    rows = np.empty_like(logits)
    runs = []
    for _ in range(50):
        start = time.perf_counter()
        np.take(_BYTE_BIAS, mask.view(np.uint8), axis=0, out=bias)
        np.take(logits, list(range(BATCH)), axis=0, out=rows)
        np.add(rows, bias.reshape(BATCH, -1)[:, :vocab], out=rows)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs) * 1e3


def main() -> None:
    tokenizer = Tokenizer.from_dir(sys.argv[1])
    result = {"vocab": tokenizer.vocab_size, "apply_ms_B16": apply_cost(tokenizer.vocab_size)}
    for engine_type in (Llguidance, Xgrammar):
        import_s, _ = timed(lambda: __import__(engine_type.name))
        result[engine_type.name] = {"import_ms": import_s * 1e3, **measure(engine_type, tokenizer)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
