"""`pagedgraph inspect` on an artifact, and `pagedgraph serve --model` on a GGUF file and an HF folder (exported
into a cache keyed by the checkpoint and the options, then served with the defaults), as `vllm serve MODEL`."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pagedgraph.artifact.manifest import MANIFEST, Manifest
from pagedgraph.cli import main

pytestmark = pytest.mark.slow


def test_inspect_shows_model_buckets_sizes_config_versions_and_checksums(tiny_artifact: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    manifest = Manifest.load(tiny_artifact)
    assert main(["inspect", "--artifact", str(tiny_artifact)]) == 0
    out = capsys.readouterr().out
    assert f"llama: 2 layers, hidden 64, 4/2 heads of 16, vocab {manifest.model.vocab_size}" in out
    assert "dtype         float32, block_size 16, max_model_len 128" in out
    assert "prefill: 2 gears, T 64 x B 4 x M 4 8 (2)" in out and "decode: 2 gears, B 4 x M 4 8 (2)" in out
    assert "sha256 verified: all match" in out and "graphs/weights.bin" in out
    assert f"pagedgraph {manifest.exported_with['pagedgraph']}" in out and "onnx " in out

    assert main(["inspect", "--artifact", str(tiny_artifact), "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["families"]["decode"]["gear_list"] == [[g.tokens, g.seqs, g.blocks]
                                                         for g in manifest.families["decode"].gears]
    assert record["export_config"] == manifest.export_config
    sizes = {rel: (tiny_artifact / rel).stat().st_size for rel in manifest.files}
    assert {rel: f["bytes"] for rel, f in record["files"].items()} == sizes
    assert all(f["ok"] and f["sha256"] == manifest.files[rel] for rel, f in record["files"].items())


def test_inspect_reports_a_corrupted_file(tiny_artifact: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_artifact, copy)
    with open(copy / "tokenizer.json", "a") as f:
        f.write(" ")
    assert main(["inspect", "--artifact", str(copy)]) == 1
    assert "MISMATCH in tokenizer.json" in capsys.readouterr().out
    assert main(["inspect", "--artifact", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


class Served:
    def __init__(self, args: list[str], cache: Path) -> None:
        env = {**os.environ, "PAGEDGRAPH_CACHE": str(cache)}
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedgraph.cli", "serve", *args, "--port", "0"],
                                     stderr=subprocess.PIPE, text=True, env=env)
        lines = []
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            lines.append(line)
            if "Application startup complete" in line or "error:" in line:
                break
        self.log = "".join(lines)
        found = re.search(r"listening on (http://127\.0\.0\.1:\d+)", self.log)
        assert found, self.log
        self.url = found.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def served() -> Iterator[list[Served]]:
    started: list[Served] = []
    yield started
    for s in started:
        s.stop()


def test_serve_model_on_the_bundled_gguf(tmp_path: Path, served: list[Served]) -> None:
    from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path

    gguf = default_model_path()
    start = time.monotonic()
    served.append(Served(["--model", str(gguf), "--num-blocks", "129"], tmp_path / "cache"))
    first = time.monotonic() - start
    server = served[-1]
    assert "exporting" in server.log and str(tmp_path / "cache") in server.log
    models = httpx.get(f"{server.url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 4,
            "temperature": 0}
    text = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert text.strip().startswith("Paris")
    (artifact,) = (tmp_path / "cache").iterdir()
    manifest = Manifest.load(artifact, verify=False)
    assert manifest.sampling_defaults == {"temperature": 0.2, "top_p": 0.9}  # the bundled model's, recorded
    server.stop()
    served.clear()
    # The second start finds the export in the cache.
    start = time.monotonic()
    served.append(Served(["--model", str(gguf), "--num-blocks", "129", "--served-model-name", "smol"],
                         tmp_path / "cache"))
    assert "cached export" in served[-1].log and time.monotonic() - start < first
    assert [m["id"] for m in httpx.get(f"{served[-1].url}/v1/models").json()["data"]] == ["smol"]
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_serve_model_on_an_hf_folder_and_serve_artifact_with_defaults(tmp_path: Path, served: list[Served]) -> None:
    pytest.importorskip("transformers")
    from tests.tiny_models import make_tiny_hf_checkpoint

    checkpoint = make_tiny_hf_checkpoint(tmp_path / "tiny-llama")
    served.append(Served(["--model", str(checkpoint)], tmp_path / "cache"))
    server = served[-1]
    assert [m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]] == ["tiny-llama"]
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny-llama", "prompt": "hello",
                                                              "max_tokens": 3, "temperature": 0}, timeout=60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] <= 3
    (artifact,) = (tmp_path / "cache").iterdir()
    assert (artifact / MANIFEST).is_file()
    server.stop()
    served.clear()
    served.append(Served(["--artifact", str(artifact), "--served-model-name", "mine"], tmp_path / "unused"))
    assert [m["id"] for m in httpx.get(f"{served[-1].url}/v1/models").json()["data"]] == ["mine"]
    assert not (tmp_path / "unused").exists()


def test_serve_needs_a_model_an_artifact_or_a_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["serve"]) == 2
    assert "give --model DIR|file.gguf" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path / "nope.gguf")]) == 2
    assert "does not exist" in capsys.readouterr().err
