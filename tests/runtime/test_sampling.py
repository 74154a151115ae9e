"""The sampler's logits processors against direct numpy implementations of OpenAI's and vLLM's formulas.

References, on fixed random logits:
- OpenAI: logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty, c = counts in the output;
- vLLM: repetition_penalty over prompt and output tokens divides positive logits and multiplies the others,
  after logit_bias and before the OpenAI penalties; min_tokens masks EOS and stop_token_ids.
"""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest

from pagedgraph.runtime.logits_processors import Penalties
from pagedgraph.runtime.sampler import Sampler, sample_row
from pagedgraph.runtime.sampling_params import RequestError, SamplingParams
from pagedgraph.runtime.scheduler import Sequence

pytestmark = pytest.mark.e2e
VOCAB = 1000
EOS = 7


def reference(logits: np.ndarray, prompt: list[int], output: list[int], params: SamplingParams,
              eos: int = EOS) -> np.ndarray:
    vocab = logits.size
    out = logits.astype(np.float64)
    if len(output) < params.min_tokens:
        out[[*([] if params.ignore_eos else [eos]), *params.stop_token_ids]] = -np.inf
    for token, bias in (params.logit_bias or {}).items():
        out[token] += bias
    seen = np.zeros(vocab, bool)
    seen[prompt + output] = True
    p = params.repetition_penalty
    out = np.where(seen & (out > 0), out / p, np.where(seen & (out <= 0), out * p, out))
    counts = np.bincount(np.array(output, np.int64), minlength=vocab)
    return out - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty


def sequence(prompt: list[int], output: list[int], params: SamplingParams) -> Sequence:
    return Sequence("r", prompt, params, 0.0, token_ids=prompt + output)


CASES = [
    SamplingParams(presence_penalty=0.8),
    SamplingParams(frequency_penalty=1.3),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(logit_bias={3: 5.0, "11": -30, 500: 250}),  # 250 is clamped to 100
    SamplingParams(max_tokens=100, min_tokens=80, stop_token_ids=(9, 13)),
    SamplingParams(max_tokens=100, presence_penalty=0.4, frequency_penalty=0.9, repetition_penalty=1.3,
                   logit_bias={5: 2.0, 17: -4.0}, min_tokens=60, stop_token_ids=(21,)),
]


@pytest.mark.parametrize("params", CASES)
def test_penalties_match_the_numpy_reference_step_by_step(params: SamplingParams) -> None:
    """Counts are kept incrementally: after every chosen token the row still equals a recount from scratch."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, VOCAB, 40).tolist()
    output = rng.integers(0, 50, 30).tolist()  # repeats, so counts > 1
    seq = sequence(prompt, output, params)
    penalties = Penalties(VOCAB, [EOS])
    for _ in range(40):
        logits = (rng.standard_normal(VOCAB) * 4).astype(np.float32)
        expected = reference(logits, prompt, seq.output_token_ids, params)
        row = logits[None].copy()
        if penalties.wants(seq):
            penalties.apply(row, [seq])
        np.testing.assert_allclose(row[0], expected, rtol=1e-6, atol=1e-5)
        token = int(rng.integers(0, 60))
        if penalties.wants(seq):
            penalties.accepted(seq, token)
        seq.token_ids.append(token)


def test_logit_bias_is_clamped_and_validated() -> None:
    assert SamplingParams(logit_bias={"5": 1000, 6: -1e9}).logit_bias == {5: 100.0, 6: -100.0}
    for bad, message in [({"x": 1}, "key 'x'"), ({-1: 1}, "key -1"), ({1: float("nan")}, "finite number"),
                         ([1, 2], "must be an object")]:
        with pytest.raises(RequestError, match=message) as err:
            SamplingParams(logit_bias=bad)
        assert err.value.field == "logit_bias"
    with pytest.raises(RequestError, match=r"token id 1000 is out of range.*\[0, 1000\)") as err:
        SamplingParams(logit_bias={1000: 1.0}).check_vocab(VOCAB)
    assert err.value.field == "logit_bias"


@pytest.mark.parametrize("field, value, rule", [
    ("presence_penalty", 2.5, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"), ("repetition_penalty", 0, "> 0"),
    ("min_p", 1.5, "[0, 1]"), ("min_tokens", -1, ">= 0"), ("min_tokens", 17, "at most max_tokens = 16"),
    ("presence_penalty", float("inf"), "[-2, 2]"),
])
def test_bad_sampling_values_name_field_value_and_rule(field: str, value: float, rule: str) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**{"max_tokens": 16, field: value})
    assert err.value.field == field and repr(value) in str(err.value) and rule in str(err.value)


def test_min_tokens_keeps_eos_out_even_when_it_is_the_top_token() -> None:
    params = SamplingParams(max_tokens=8, temperature=0, min_tokens=5, stop_token_ids=(3,))
    seqs = [sequence([1, 2], [], params), sequence([1, 2], [], SamplingParams(temperature=0))]
    sampler = Sampler(VOCAB, [Penalties(VOCAB, [EOS])])
    logits = np.zeros((2, VOCAB), np.float32)
    logits[:, EOS], logits[:, 3], logits[:, 42] = 10.0, 9.0, 8.0  # EOS first, then a stop token id, then 42
    picked = []
    for _ in range(7):
        tokens = sampler.sample(logits, seqs)
        picked.append(tokens)
        for seq, token in zip(seqs, tokens):
            seq.token_ids.append(token)
    assert [t[0] for t in picked] == [42] * 5 + [EOS, EOS]
    assert [t[1] for t in picked] == [EOS] * 7  # the unconstrained row in the same batch is untouched


def test_a_batch_without_processing_is_read_in_place_and_a_processed_one_allocates_no_rows() -> None:
    rng = np.random.default_rng(1)
    vocab = 49152
    logits = rng.standard_normal((16, vocab)).astype(np.float32)
    plain = [sequence([1], [], SamplingParams(temperature=0)) for _ in range(16)]
    sampler = Sampler(vocab, [Penalties(vocab, [EOS])])
    assert sampler.sample(logits, plain) == np.argmax(logits, axis=1).tolist()
    tracemalloc.start()
    sampler.sample(logits, plain)
    plain_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert plain_peak < 2048 and sampler._rows.shape[0] == 0  # never copied: only the 16 token ids

    penalized = [sequence([1, 2, 3], [4], SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5,
                                                          repetition_penalty=1.2, logit_bias={9: 3.0}))
                 for _ in range(16)]
    for _ in range(2):  # the first step builds the buffer and each sequence's state
        sampler.sample(logits, penalized)
    tracemalloc.start()
    for _ in range(3):
        sampler.sample(logits, penalized)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < vocab  # no row-sized (4 * vocab bytes) buffer per step
    assert sampler.seconds["penalties"] > 0


def test_min_p_drops_tokens_below_its_share_of_the_top_probability() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    row = np.full(VOCAB, -np.inf, np.float32)
    row[:4] = np.log(probs)
    seq = sequence([1], [], SamplingParams(temperature=1.0, min_p=0.4, seed=0))  # keeps p >= 0.2
    draws = np.bincount([sample_row(row, seq) for _ in range(4000)], minlength=4)
    assert draws[2:].sum() == 0
    assert abs(draws[0] / 4000 - 0.5 / 0.8) < 0.03


# -- the real model, offline: every greedy choice is the argmax of the reference-processed raw logits -------------
REPETITIVE = "one two three one two three one two three one two"


@pytest.fixture(scope="module")
def engine(smollm2_artifact):  # type: ignore[no-untyped-def]
    from pagedgraph.runtime.engine import EngineConfig, LLMEngine
    from tests.mindspore_support import RecordingExecutor

    engine = LLMEngine(smollm2_artifact, EngineConfig(num_blocks=64, max_model_len=1008, threads=2))
    engine.runner.executor = RecordingExecutor(engine.runner.executor)
    return engine


def _run(engine, prompt: str, params: SamplingParams):  # type: ignore[no-untyped-def]
    engine.runner.executor.steps.clear()
    seq = engine.add_request(engine.prompts.encode(prompt), params)
    while engine.has_unfinished():
        engine.step()
    return seq, [logits[0] for _, logits in engine.runner.executor.steps]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, temperature=0, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.8),
    SamplingParams(max_tokens=20, temperature=0, logit_bias={1167: 8.0, 1453: -100}, repetition_penalty=1.2,
                   frequency_penalty=0.5),
])
def test_penalized_greedy_on_the_real_model_follows_the_reference(engine, params: SamplingParams) -> None:
    plain, _ = _run(engine, REPETITIVE, SamplingParams(max_tokens=20, temperature=0))
    seq, rows = _run(engine, REPETITIVE, params)
    out = seq.output_token_ids
    assert len(rows) == len(out)
    for k, (row, token) in enumerate(zip(rows, out)):
        expected = reference(row, seq.prompt_token_ids, out[:k], params, engine.tokenizer.eos_token_ids[0])
        assert token == int(np.argmax(expected)), f"step {k}"
    assert out != plain.output_token_ids  # the penalties changed what the model says


def test_min_tokens_on_the_real_model_holds_back_eos_while_it_is_the_top_token(engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    seq, _ = _run(engine, "Hello", SamplingParams(max_tokens=10, temperature=0, min_tokens=5, logit_bias={eos: 100}))
    assert seq.output_token_ids[:5] == [t for t in seq.output_token_ids[:5] if t != eos]
    assert seq.output_token_ids[5:] == [eos] and seq.finish_reason == "stop"
    no_min, _ = _run(engine, "Hello", SamplingParams(max_tokens=10, temperature=0, logit_bias={eos: 100}))
    assert no_min.output_token_ids == [eos]  # EOS is the top token: without min_tokens it ends at once


def test_ignore_eos_keeps_generating_but_stop_token_ids_still_stop(engine) -> None:
    eos = engine.tokenizer.eos_token_ids[0]
    ignored, _ = _run(engine, "Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                      logit_bias={eos: 100}))
    assert ignored.output_token_ids == [eos] * 4 and ignored.finish_reason == "length"
    assert ignored.text == ""  # EOS is a special token: never in the text
    stopped, _ = _run(engine, "Hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                                      stop_token_ids=(eos,), logit_bias={eos: 100}))
    assert stopped.output_token_ids == [eos] and stopped.finish_reason == "stop"


def test_generate_jsonl_takes_the_sampling_fields(engine, smollm2_artifact, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from pagedgraph.cli import main

    fields = {"max_tokens": 12, "temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 0.8,
              "repetition_penalty": 1.3, "logit_bias": {"1167": 8}, "min_p": 0.1, "min_tokens": 3}
    requests = [{"prompt": REPETITIVE, **fields}, {"prompt": "x", "logit_bias": {"99999999": 1}},
                {"prompt": "x", "min_tokens": 50, "max_tokens": 4}]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in requests))
    assert main(["generate", "--artifact", str(smollm2_artifact), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--threads", "2"]) == 0
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    want, _ = _run(engine, REPETITIVE, SamplingParams.from_dict(fields))
    assert lines[0]["token_ids"] == want.output_token_ids
    assert lines[1]["error"].startswith("logit_bias: token id 99999999 is out of range")
    assert lines[2]["error"] == "min_tokens: 50 must be at most max_tokens = 4"


def reference_distribution(row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """vLLM's definitions, directly: softmax(row / T), then top_k, min_p (against the top probability), and the
    smallest top_p nucleus of what is left, renormalized."""
    probs = np.exp(row / params.temperature - np.max(row / params.temperature))
    probs /= probs.sum()
    keep = np.ones(row.size, bool)
    if 0 < params.top_k < row.size:
        keep[np.argsort(-probs)[params.top_k:]] = False
    keep &= probs >= params.min_p * probs.max()
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    if params.top_p < 1:
        order = np.argsort(-probs)
        inside = np.cumsum(probs[order]) - probs[order] < params.top_p  # the mass before it is short of top_p
        probs[order[~inside]] = 0.0
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("params, vocab", [
    (SamplingParams(temperature=1.0, seed=3), 300), (SamplingParams(temperature=0.7, top_k=5, seed=3), 300),
    (SamplingParams(temperature=1.3, top_p=0.8, seed=3), 300), (SamplingParams(temperature=1.0, min_p=0.2, seed=3), 300),
    (SamplingParams(temperature=0.9, top_k=12, min_p=0.05, top_p=0.9, seed=3), 300),
    (SamplingParams(temperature=1.0, top_k=40, top_p=0.8, seed=3), 300),
    # top_p alone over a top-m subset (nucleus of 24 tokens: m = 64; of 239: m = 512), not the whole vocabulary
    (SamplingParams(temperature=1.0, top_p=0.8, seed=3), 300), (SamplingParams(temperature=0.6, top_p=0.7, seed=3), 3000), (SamplingParams(temperature=1.0, top_p=0.7, seed=3), 3000),
])
def test_sampled_tokens_follow_the_reference_distribution(params: SamplingParams, vocab: int) -> None:
    row = np.random.default_rng(5).standard_normal(vocab).astype(np.float32) * 2
    want = reference_distribution(row, params)
    seq = sequence([1], [], params)
    scratch = np.empty(row.size)
    draws = 30000
    got = np.bincount([sample_row(row, seq, scratch) for _ in range(draws)], minlength=row.size)
    assert not got[want == 0].any()  # never outside the kept set
    # Pearson's chi-square over the tokens expected >= 5 times (the rest pooled), against its 1e-4 quantile
    # (Wilson-Hilferty): a wrong distribution fails, sampling noise passes.
    expected = want * draws
    big = expected >= 5
    observed = np.append(got[big], got[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    assert chi2 < df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3, (chi2, df)
