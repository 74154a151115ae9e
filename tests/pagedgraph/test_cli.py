"""The console script as a user runs it: export errors, JSONL generation, one bad request among good ones."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagedgraph.cli import main
from pagedgraph.runtime.bench.suite import BenchOptions
from pagedgraph.runtime.engine import LLM, LLMEngine

pytestmark = pytest.mark.e2e


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedgraph.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("yaml_text,expected", [
    ("export:\n  block_size: sixteen\n", "export.block_size = 'sixteen'"),
    ("export:\n  blocksize: 16\n", "export.blocksize"),
    ("export:\n  block_size: 24\n", "export.block_size = 24: Input should be a multiple of 16"),
    ("export:\n  buckets:\n    decode_batch: [4, 2]\n", "strictly ascending"),
    ("model:\n  source: /nonexistent/model.gguf\n", "/nonexistent/model.gguf does not exist"),
])
def test_export_errors_name_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str,
                                      expected: str) -> None:
    config = tmp_path / "export.yaml"
    config.write_text(yaml_text)
    assert main(["export", "--config", str(config), "--out", str(tmp_path / "out")]) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "a failed export must not leave an artifact"


def test_generate_jsonl_in_order_with_one_bad_request(smollm2_artifact: Path, tmp_path: Path) -> None:
    requests = [
        {"prompt": "The capital of France is", "max_tokens": 8},
        {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6},
        {"prompt_token_ids": [504] * 1300},  # longer than max_model_len (1280): fails alone
        {"prompt_token_ids": [504, 3458, 282], "max_tokens": 3, "temperature": 0.8, "seed": 7},
        {"prompt": "x", "temperature": -1},  # invalid sampling field
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in requests))
    result = _cli("generate", "--artifact", str(smollm2_artifact), "--input", str(tmp_path / "in.jsonl"),
                  "--output", str(tmp_path / "out.jsonl"), "--max-tokens", "64", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(lines) == len(requests)
    assert lines[0]["text"].strip().startswith("Paris") and lines[0]["finish_reason"] in ("stop", "length")
    assert lines[0]["prompt_token_ids"][:2] and len(lines[0]["token_ids"]) <= 8
    assert lines[1]["prompt_token_ids"][0] == 1  # <|im_start|>: the chat template was applied
    assert "max_model_len" in lines[2]["error"] and lines[2]["finish_reason"] == "error"
    assert len(lines[3]["token_ids"]) == 3
    assert "temperature" in lines[4]["error"]


def test_generate_progress_on_a_pipe_is_whole_lines(tiny_artifact: Path, tmp_path: Path) -> None:
    """Off a terminal no bar redraws its line: stderr (a file here) holds whole lines, the last a summary."""
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 4})
                                                 for _ in range(3)))
    with open(tmp_path / "err.txt", "w") as err:
        result = subprocess.run([sys.executable, "-m", "pagedgraph.cli", "generate", "--artifact", str(tiny_artifact),
                                 "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")],
                                stdout=subprocess.PIPE, stderr=err, text=True, timeout=600)
    stderr = (tmp_path / "err.txt").read_text()
    assert result.returncode == 0, stderr
    assert "\r" not in stderr and stderr.endswith("\n"), repr(stderr)
    assert re.fullmatch(r"3/3 requests done in \d+\.\d s", stderr.splitlines()[-1]), repr(stderr)


def test_generate_single_prompt_prints_completion(smollm2_artifact: Path) -> None:
    result = _cli("generate", "--artifact", str(smollm2_artifact), "--prompt", "The capital of France is",
                  "--max-tokens", "4", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("The capital of France is Paris")


def test_generate_refuses_a_non_artifact(tmp_path: Path) -> None:
    result = _cli("generate", "--artifact", str(tmp_path), "--prompt", "hi")
    assert result.returncode == 2
    assert "not a pagedgraph artifact" in result.stderr and "pagedgraph export" in result.stderr


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[LLMEngine]:
    """The engines `pagedgraph generate` builds, in order."""
    built: list[LLMEngine] = []

    class Recorded(LLM):
        def __init__(self, artifact: str | Path, **config: object) -> None:
            super().__init__(artifact, **config)
            built.append(self.engine)

    monkeypatch.setattr("pagedgraph.runtime.engine.LLM", Recorded)
    return built


@pytest.mark.parametrize("mode", ["on", "off"])
def test_generate_custom_ops_flag_reaches_the_executor(tiny_artifact: Path, engines: list[LLMEngine],
                                                       mode: str) -> None:
    """With "on" the ops must be active: scripts/test.sh fetches the ONNX Runtime header they are built with."""
    assert main(["generate", "--artifact", str(tiny_artifact), "--prompt", "hello", "--max-tokens", "2",
                 "--custom-ops", mode]) == 0
    assert engines[0].runner.executor.custom_ops is (mode == "on")


def test_generate_pool_flags_size_the_pool_and_a_too_small_one_stops_before_any_request(
        tiny_artifact: Path, engines: list[LLMEngine], capsys: pytest.CaptureFixture[str]) -> None:
    per_block = LLMEngine(tiny_artifact).runner.pools.bytes_per_block
    assert main(["generate", "--artifact", str(tiny_artifact), "--prompt", "hello", "--max-tokens", "2",
                 "--kv-cache-bytes", f"{12 * per_block / 2**10}KiB", "--max-model-len", "64"]) == 0
    assert engines[0].runner.pools.num_blocks == 12 and engines[0].max_model_len == 64
    capsys.readouterr()
    # The tiny artifact's max_model_len 128 needs 8 blocks of 16 plus the null block.
    assert main(["generate", "--artifact", str(tiny_artifact), "--prompt", "hello", "--num-blocks", "5"]) == 2
    error = capsys.readouterr().err
    assert "num_blocks = 5 (kv_cache.num_blocks, --num-blocks)" in error and "at least 9" in error
    assert "to at most 64 tokens" in error and len(engines) == 1  # refused before the LLM existed
    with pytest.raises(SystemExit):
        main(["generate", "--artifact", str(tiny_artifact), "--prompt", "hello", "--kv-cache-bytes", "4 gigs"])
    assert "give bytes (1073741824) or a size with KiB, MiB, GiB, TiB (4GiB)" in capsys.readouterr().err


def test_bench_custom_ops_flag_reaches_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench itself on the real model: tests/runtime/test_bench.py; here only that the flag gets to it."""
    class Ran(Exception):
        pass

    seen: list[BenchOptions] = []

    def run_bench(options: BenchOptions) -> None:
        seen.append(options)
        raise Ran

    monkeypatch.setattr("pagedgraph.runtime.bench.suite.run_bench", run_bench)
    with pytest.raises(Ran):
        main(["bench", "--artifact", "unused", "--custom-ops", "off"])
    assert seen[0].custom_ops == "off"


def test_help_explains_every_option_and_version_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option of every command has help text, and one with a default shows it (the rest say what
    happens without them); the top-level help carries no internal notes."""
    import argparse

    from pagedgraph import __version__
    from pagedgraph.cli import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            text = formatter._get_help_string(action)
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            if action.default not in (None, False):
                assert "(default: " in text, f"{name} {action.option_strings[0]} hides its default"
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"pagedgraph {__version__}"
    assert "importing" not in (parser.description or "")
