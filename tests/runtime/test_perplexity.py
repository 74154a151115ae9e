"""`pagedgraph eval` on the real SmolLM2 artifact: against numpy on the engine's own logits, and against HF fp32."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.cli import main
from pagedgraph.texts import shipped_text
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.perplexity import Window, evaluate_text, plan_windows
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.mindspore_support import RecordingExecutor
from tests.paths import DATA
from tests.runtime.test_kv_cache_dtypes import kv_artifact  # noqa: F401 (the fixture)

pytestmark = pytest.mark.e2e
SHORT = ("The tide came in twice a day, and twice a day the keeper wrote it down: the hour, the height, "
         "and whether the gulls had gone quiet before it turned.")


def _log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - row.max() - np.log(np.exp(row - row.max()).sum())


def test_plan_windows() -> None:
    assert plan_windows(10, 4, 4) == [Window(0, 4, 1), Window(4, 8, 5), Window(8, 10, 9)]
    assert plan_windows(10, 4, 2) == [Window(0, 4, 1), Window(2, 6, 4), Window(4, 8, 6), Window(6, 10, 8)]
    assert sum(w.scored for w in plan_windows(1000, 64, 16)) == 999  # overlapping: every token but the first
    with pytest.raises(ValueError, match="stride"):
        plan_windows(10, 4, 5)


def test_eval_equals_numpy_on_the_logits_of_each_prefix(smollm2_artifact: Path, tmp_path: Path) -> None:
    """The CLI's figure against log-softmax of the logits the plain sampling path returns after each prefix."""
    text = tmp_path / "short.txt"
    text.write_text(SHORT)
    out = tmp_path / "eval.json"
    assert main(["eval", "--artifact", str(smollm2_artifact), "--text", str(text), "--context", "12",
                 "--stride", "8", "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]

    engine = LLMEngine(smollm2_artifact, EngineConfig(enable_prefix_caching=False))
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    ids = engine.tokenizer.encode(SHORT)
    nll, scored = 0.0, 0
    prev_end = 0
    for begin in range(0, len(ids), 8):  # the sliding-window loop of Hugging Face's perplexity guide
        end = min(begin + 12, len(ids))
        for target in range(max(prev_end, begin + 1), end):
            engine.add_request(ids[begin:target], SamplingParams(max_tokens=1, temperature=0))
            while engine.has_unfinished():
                engine.step()
            nll -= _log_softmax(recorder.steps[-1][1][0])[ids[target]]
            scored += 1
        prev_end = end
        if end == len(ids):
            break
    assert (run["num_tokens"], run["num_scored"], run["context"], run["stride"]) == (len(ids), scored, 12, 8)
    assert run["num_windows"] == len(run["windows"]) == math.ceil((len(ids) - 12) / 8) + 1
    precision = (run["dtype"], run["quantization"], run["kv_cache_dtype"], run["executor"])
    assert precision == ("float32", "none", "float32", "onnxruntime")
    assert run["ratio"] == 1.0 and run["precision"].startswith("float32, quantization none")
    assert run["perplexity"] == pytest.approx(math.exp(nll / scored), rel=1e-5)


def test_eval_matches_transformers_fp32(smollm2_artifact: Path) -> None:
    """Perplexity of the held-out text's first ~320 tokens equals HF transformers' fp32 on the GGUF's weights, as
    scripts/make_reference.py recorded it (tests/data/reference_perplexity.json: transformers is the oracle, run
    once, as for the greedy tokens of tests/runtime/test_reference_e2e.py)."""
    (reference,) = json.loads((DATA / "reference_perplexity.json").read_text())
    text = shipped_text(reference["text"])[:reference["characters"]]
    ours = evaluate_text(smollm2_artifact, text, context=reference["context"], stride=reference["stride"])
    assert (ours.num_tokens, ours.num_scored) == (reference["num_tokens"], reference["num_scored"])
    # Both fp32, different summation orders: measured 4e-7 relative (50.95065 vs 50.95066). One token scored
    # from a wrong row would move this perplexity by about 1e-2.
    assert ours.perplexity == pytest.approx(reference["perplexity"], rel=2e-5)


def test_shipped_texts_are_separate_and_sized() -> None:
    calibration, held_out = shipped_text("calibration"), shipped_text("heldout")
    assert 12_000 < len(calibration) < 30_000 and 12_000 < len(held_out) < 30_000
    lines = {line for line in calibration.splitlines() if len(line) > 40}
    assert not lines & set(held_out.splitlines())  # no shared passage


def test_several_artifacts_are_ratios_to_the_first(tiny_artifact: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "short.txt"
    text.write_text(SHORT * 3)
    out = tmp_path / "eval.json"
    assert main(["eval", "--artifact", str(tiny_artifact), "--artifact", str(tiny_artifact), "--text", str(text),
                 "--context", "32", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["ratio"] for r in runs] == [1.0, 1.0] and runs[0]["perplexity"] == runs[1]["perplexity"] > 1
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 3 and table[0].split()[-2:] == ["perplexity", "ratio"]


def test_kv_cache_dtypes_run_in_order_after_the_first(tmp_path: Path,
                                                       kv_artifact: tuple[Path, Path]) -> None:  # noqa: F811
    """--kv-cache-dtype: one run per dtype of the same artifact; the int8 cache really ran (a different figure)."""
    artifact, text = kv_artifact
    out = tmp_path / "eval.json"
    assert main(["eval", "--artifact", str(artifact), "--kv-cache-dtype", "auto,int8", "--text", str(text),
                 "--context", "32", "--json", str(out)]) == 0
    base, int8 = json.loads(out.read_text())["runs"]
    assert (base["kv_cache_dtype"], int8["kv_cache_dtype"]) == ("float32", "int8")
    assert base["ratio"] == 1.0 and int8["ratio"] != 1.0 and abs(int8["ratio"] - 1) < 0.05
