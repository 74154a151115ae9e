"""Structured output in the engine, on the real model: grammar masks per sequence, beside unconstrained rows.

The masks are checked against llguidance's own per-token answer (`compute_logit_bias`), the outputs against
`jsonschema`, and unconstrained requests against their solo greedy output; n > 1, chunked prefill,
preemption and prefix-cache hits must not change a constrained greedy output.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import pytest

from pagedgraph.runtime.constraints import Constraint
from pagedgraph.runtime.engine import LLM, RequestOutput
from pagedgraph.runtime.sampling_params import RequestError, SamplingParams
from pagedgraph.runtime.structured_output import GrammarCompiler, StructuredOutputs
from pagedgraph.runtime.scheduler import Sequence
from pagedgraph.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.e2e
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 130},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"], "additionalProperties": False}},
    "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False}
ASK = {"messages": [{"role": "user", "content": "Give me a JSON record of a user of a web site."}]}
PLAIN = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
MAX_TOKENS = 96


def constrained(**extra: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0, "structured_outputs": {"json": PERSON}, **extra})


def check_person(text: str) -> None:
    jsonschema.validate(json.loads(text), PERSON)


@pytest.fixture(scope="module")
def tokenizer(smollm2_artifact: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_artifact)


@pytest.fixture(scope="module")
def llm(smollm2_artifact: Path) -> LLM:
    return LLM(smollm2_artifact, threads=2, num_blocks=256)


@pytest.fixture(scope="module")
def solo(llm: LLM) -> dict[str, RequestOutput]:
    """Each unconstrained prompt and the constrained request alone, greedy."""
    out = {p: llm.generate(p, SamplingParams(max_tokens=12, temperature=0))[0] for p in PLAIN}
    out["person"] = llm.generate(ASK, constrained())[0]
    return out


def test_masks_equal_llguidance_per_token_answer(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    processor = StructuredOutputs(compiler)
    prefix = tokenizer.encode('{"name": "A', add_special_tokens=False)  # walks the first one into a string
    fields = [{"json": PERSON}, {"regex": "[0-9]+(ab|cd)"}, {"choice": ["yes", "no", "maybe"]}]
    seqs = [Sequence(f"r{i}", [1], SamplingParams(structured_outputs=f), 0.0) for i, f in enumerate(fields)]
    for seq in seqs:
        processor.start(seq)
    for token in prefix:
        processor.accepted(seqs[0], token)
        seqs[0].token_ids.append(token)
    fork = Sequence("r0", [1], seqs[0].params, 0.0, token_ids=list(seqs[0].token_ids))  # rebuilt from its tokens
    plain = Sequence("plain", [1], SamplingParams(), 0.0)
    batch = [seqs[0], plain, seqs[1], seqs[2], fork]
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((len(batch), tokenizer.vocab_size)).astype(np.float32)
    rows = logits.copy()
    processor.apply(rows, batch)
    assert np.array_equal(rows[1], logits[1])
    for row, fields_, walked in ((0, fields[0], prefix), (2, fields[1], []), (3, fields[2], []), (4, fields[0], prefix)):
        reference = compiler.compile(SamplingParams(structured_outputs=fields_).structured_outputs)
        assert reference.consume_tokens(walked)
        allowed = np.frombuffer(reference.compute_logit_bias(), np.uint8)[:tokenizer.vocab_size] > 0
        assert np.array_equal(np.isfinite(rows[row]), allowed)
        assert np.array_equal(rows[row][allowed], logits[row][allowed])
    assert 100 < np.isfinite(rows[0]).sum() < tokenizer.vocab_size  # string content: many tokens, not all
    assert np.isfinite(rows[3]).sum() < 10  # the first token of "yes" / "no" / "maybe"


def test_a_complete_grammar_outranks_min_tokens(llm: LLM) -> None:
    """min_tokens masks EOS, but a request ends as soon as its grammar allows nothing else (only EOS)."""
    out = llm.generate("A colour:", SamplingParams(max_tokens=8, temperature=0, min_tokens=6,
                                                   structured_outputs={"choice": ["red", "green", "blue"]}))[0]
    assert out.text in ("red", "green", "blue") and out.finish_reason == "stop" and out.error is None


def test_compiled_grammars_are_cached_per_constraint(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, capacity=2)
    first, second, third = (Constraint("regex", r, "regex") for r in ("a+", "b+", "c+"))
    compiler.compile(first)
    compiler.compile(Constraint("regex", "a+", "structured_outputs.regex"))  # the field is not part of the key
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(second)
    compiler.compile(third)  # evicts the least recently used: `first`
    compiler.compile(first)
    assert (compiler.hits, compiler.misses) == (1, 4)


@pytest.mark.parametrize("fields, field, problem", [
    ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "structured_outputs.json", "JSON schema"),
    ({"json": {"type": "string", "pattern": "("}}, "structured_outputs.json", "JSON schema"),
    ({"regex": "a(b"}, "structured_outputs.regex", "regular expression"),
    ({"grammar": "start: missing_rule"}, "structured_outputs.grammar", "grammar"),
    ({"choice": []}, "structured_outputs.choice", "non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs", "exactly one"),
])
def test_a_bad_constraint_is_a_request_error_naming_the_field(llm: LLM, fields: dict[str, Any], field: str,
                                                              problem: str) -> None:
    with pytest.raises(RequestError) as info:
        llm.engine.add_request(llm.engine.prompts.encode("hi"), SamplingParams(structured_outputs=fields))
    assert info.value.field == field and problem in str(info.value)
    assert not llm.engine.has_unfinished()


def test_constrained_and_unconstrained_requests_share_a_batch(llm: LLM, solo: dict[str, RequestOutput]) -> None:
    check_person(solo["person"].text)
    assert solo["person"].finish_reason == "stop"
    params = [constrained(), *[SamplingParams(max_tokens=12, temperature=0)] * len(PLAIN),
              SamplingParams(max_tokens=16, temperature=0, structured_outputs={"regex": "[A-Z][a-z]+ [0-9]{2}"}),
              SamplingParams(max_tokens=8, temperature=0, structured_outputs={"choice": ["red", "green", "blue"]})]
    outputs = llm.generate([ASK, *PLAIN, "Name and age:", "A colour:"], params)
    assert outputs[0].token_ids == solo["person"].token_ids
    assert [o.token_ids for o in outputs[1:1 + len(PLAIN)]] == [solo[p].token_ids for p in PLAIN]
    assert re.fullmatch("[A-Z][a-z]+ [0-9]{2}", outputs[-2].text), outputs[-2].text
    assert outputs[-1].text in ("red", "green", "blue") and outputs[-1].finish_reason == "stop"
    assert llm.engine.sampler.seconds["structured_output"] > 0


def test_every_fork_of_a_sampled_request_follows_the_schema(llm: LLM) -> None:
    out = llm.generate(ASK, constrained(n=3, temperature=0.9, seed=3))[0]
    assert len(out.outputs) == 3 and len({c.text for c in out.outputs}) > 1
    for completion in out.outputs:
        check_person(completion.text)


def test_chunking_preemption_and_cache_hits_keep_the_constrained_output(smollm2_artifact: Path,
                                                                         solo: dict[str, RequestOutput]) -> None:
    small = LLM(smollm2_artifact, threads=2, num_blocks=10, max_model_len=144, max_num_batched_tokens=16)
    outputs = small.generate([ASK] * 2, constrained())
    assert [o.token_ids for o in outputs] == [solo["person"].token_ids] * 2
    assert len(outputs[0].prompt_token_ids) > 16  # so the prompt went in several chunks
    assert small.engine.scheduler.num_preemptions > 0 and small.engine.stats.cache.hits > 0


def test_the_jsonl_of_pagedgraph_generate_takes_vllms_fields(smollm2_artifact: Path, tmp_path: Path) -> None:
    from pagedgraph.cli import main

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"prompt": "A colour:", "max_tokens": 8, "temperature": 0,
              "structured_outputs": {"choice": ["red", "green", "blue"]}},
             {"prompt": "Digits:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"regex": "[0-9]{3}"}},
             {"prompt": "Bad:", "structured_outputs": {"regex": "(("}}]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["generate", "--artifact", str(smollm2_artifact), "--input", str(src), "--output", str(out),
                 "--threads", "2"]) == 0
    colour, digits, bad = (json.loads(line) for line in out.read_text().splitlines())
    assert colour["text"] in ("red", "green", "blue") and re.fullmatch("[0-9]{3}", digits["text"])
    assert bad["finish_reason"] == "error" and bad["error"].startswith("structured_outputs.regex: invalid regular")


def test_a_closed_schema_allows_no_property_the_schema_leaves_out() -> None:
    """Every object schema that says nothing gets additionalProperties false; what a schema says, it keeps."""
    from pagedgraph.runtime.constraints import closed_schema

    point = {"type": "object", "properties": {"x": {"type": "number"}}}
    schema = {"$defs": {"point": point}, "properties": {
        "at": {"$ref": "#/$defs/point"}, "path": {"type": "array", "items": point},
        "either": {"anyOf": [point, {"type": "string"}]}, "open": {**point, "additionalProperties": True},
        "tagged": {"type": "object", "additionalProperties": point},
        "both": {"type": "object", "allOf": [point, {"properties": {"y": {"type": "number"}}}]},
        "maybe": {"type": ["object", "null"], "properties": {}}}}
    shut = closed_schema(schema)
    closed = {**point, "additionalProperties": False}
    props = shut["properties"]
    assert shut["additionalProperties"] is False and shut["$defs"]["point"] == closed
    assert props["path"]["items"] == closed and props["either"]["anyOf"] == [closed, {"type": "string"}]
    assert props["open"]["additionalProperties"] is True
    assert props["tagged"]["additionalProperties"] == closed and props["maybe"]["additionalProperties"] is False
    assert props["both"] == schema["properties"]["both"]  # composed: closed, it would refuse x and y
    assert "additionalProperties" not in point and "additionalProperties" not in schema  # the input is not changed
    jsonschema.validate({"at": {"x": 1}, "both": {"x": 1, "y": 2}, "either": {"x": 2}}, shut)
    for extra in ({"at": {"x": 1, "z": 0}}, {"either": {"x": 1, "z": 0}}, {"path": [{"z": 0}]}, {"z": 0}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(extra, shut)
