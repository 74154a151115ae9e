"""Artifacts: corruption and version mismatches are refused with a re-export hint; interrupted exports leave nothing.

Damaged copies of the real SmolLM2 artifact link every file but the damaged one to the original. An export
killed with SIGKILL at chosen points (a subprocess patches one exporter step to kill itself) must leave the
destination as it was: absent, or the previous complete artifact.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.artifact.manifest import MANIFEST, ArtifactError, Manifest
from pagedgraph.exporter.export import WEIGHTS
from pagedgraph.cli import main
from pagedgraph.runtime.engine import LLM
from tests.random_checkpoint import write_random_llama

pytestmark = pytest.mark.e2e
REDO = "re-export it with `pagedgraph export --config "  # + the artifact's own export_config.json and --out


def _damaged(artifact: Path, out: Path, name: str) -> Path:
    """`out` with every file of `artifact` linked, except `name`, which is a private copy to damage."""
    for path in artifact.rglob("*"):
        if path.is_file():
            rel = path.relative_to(artifact)
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            if str(rel) == name:
                shutil.copyfile(path, out / rel)
            else:
                (out / rel).symlink_to(path)
    return out / name


def _flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_a_flipped_or_truncated_weights_file_is_refused(smollm2_artifact: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    weights = _damaged(smollm2_artifact, tmp_path, WEIGHTS)
    _flip_byte(weights, weights.stat().st_size // 2)
    with pytest.raises(ArtifactError, match=f"{WEIGHTS} is corrupted \\(checksum mismatch\\); {REDO}{tmp_path}/export_config.json --out {tmp_path}`"):
        Manifest.load(tmp_path)
    assert main(["generate", "--artifact", str(tmp_path), "--prompt", "hi", "--max-tokens", "1"]) == 2
    assert "is corrupted" in capsys.readouterr().err
    _flip_byte(weights, weights.stat().st_size // 2)
    Manifest.load(tmp_path)  # restored: loads again
    os.truncate(weights, weights.stat().st_size - 1)
    with pytest.raises(ArtifactError, match=f"{WEIGHTS} is corrupted"):
        Manifest.load(tmp_path)


@pytest.mark.parametrize("name, damage, expected", [
    ("graphs/model.onnx", lambda p: _flip_byte(p, 100), "graphs/model.onnx is corrupted"),
    ("tokenizer.json", lambda p: p.unlink(), "tokenizer.json is missing"),
    (MANIFEST, lambda p: p.write_text(p.read_text()[:200]), "manifest.json is malformed"),
    (MANIFEST, lambda p: p.write_text(p.read_text().replace('"op_set_version": ', '"op_set_version": 9')),
     "op set 9"),
    (MANIFEST, lambda p: p.write_text(p.read_text().replace('"format_version": ', '"format_version": 7')),
     "has format 7"),
])
def test_damage_and_version_mismatches_are_refused_with_a_re_export_hint(smollm2_artifact: Path, tmp_path: Path,
                                                                        name: str, damage: object,
                                                                        expected: str) -> None:
    damage(_damaged(smollm2_artifact, tmp_path, name))  # type: ignore[operator]
    with pytest.raises(ArtifactError) as err:
        Manifest.load(tmp_path)
    assert expected in str(err.value) and REDO in str(err.value)


def test_an_artifact_holds_only_data_formats(smollm2_artifact: Path) -> None:
    """Graphs (ONNX protobuf), raw weights, JSON: no pickles, no code, nothing a loader would execute."""
    suffixes = {p.suffix for p in smollm2_artifact.rglob("*") if p.is_file()}
    assert suffixes <= {".onnx", ".bin", ".json"}, suffixes


# -- export interrupted by SIGKILL ------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_llama(tmp_path_factory.mktemp("random_llama"))


KILLER = """
import io, json, os, pathlib, signal, sys
import pagedgraph.exporter.export as ex
from pagedgraph.exporter.config import ExportConfig

point, config, out = sys.argv[1], json.loads(sys.argv[2]), pathlib.Path(sys.argv[3])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

def after(real, calls=1):
    def step(*args, **kwargs):
        result = real(*args, **kwargs)
        step.calls += 1
        if step.calls == calls:
            die()
        return result
    step.calls = 0
    return step

def half_then_die(path, *args, **kwargs):  # removing a directory: delete half of its files, then die
    for file in sorted(p for p in pathlib.Path(path).rglob("*") if p.is_file())[::2]:
        file.unlink()
    die()

if point == "rename":
    pathlib.Path.rename = after(pathlib.Path.rename)
elif point == "rmtree":
    ex.shutil.rmtree = half_then_die
elif point != "none":
    setattr(ex, point, after(getattr(ex, point), 2 if point == "file_sha256" else 1))
ex.export(ExportConfig.model_validate(config), out, log=io.StringIO())
"""
# Steps of an export, in order: graphs and weights, tokenizer, checksums, the move into place.
KILL_POINTS = ["_write_onnx", "write_tokenizer", "file_sha256", "rename", "rmtree"]


def _contents(artifact: Path) -> dict[str, bytes]:
    return {str(p.relative_to(artifact)): p.read_bytes() for p in artifact.rglob("*") if p.is_file()}


def _export_killed_at(point: str, checkpoint: Path, out: Path) -> int:
    config = {"model": {"source": str(checkpoint)},
              "export": {"max_model_len": 64, "verify_gears": False,
                         "buckets": {"decode_batch": [1, 2], "prefill_tokens": [16], "prefill_max_seqs": 2}}}
    return subprocess.run([sys.executable, "-c", KILLER, point, json.dumps(config), str(out)], timeout=120).returncode


@pytest.mark.parametrize("point", KILL_POINTS[:3])
def test_an_export_killed_mid_way_leaves_no_artifact_at_the_destination(checkpoint: Path, tmp_path: Path,
                                                                        point: str) -> None:
    out = tmp_path / "art"
    assert _export_killed_at(point, checkpoint, out) == -signal.SIGKILL
    assert not out.exists(), f"killed in {point}, the export left {sorted(out.rglob('*'))}"
    leftovers = list(tmp_path.glob(".art.partial-*"))
    assert leftovers, "the export should stage in a hidden sibling directory"
    for staging in leftovers:  # killed before its manifest: never loadable
        with pytest.raises(ArtifactError, match="is not a pagedgraph artifact"):
            Manifest.load(staging)


@pytest.mark.parametrize("point", KILL_POINTS)
def test_an_export_killed_over_an_artifact_leaves_the_old_one_whole(checkpoint: Path, tmp_path: Path,
                                                                   point: str) -> None:
    """The destination holds the old artifact or the new one, whole (absent only between two renames)."""
    out = tmp_path / "art"
    assert _export_killed_at("none", checkpoint, out) == 0
    before = _contents(out)
    assert _export_killed_at(point, checkpoint, out) == -signal.SIGKILL
    if point in KILL_POINTS[:3]:
        assert _contents(out) == before, f"killed in {point}, the export changed the old artifact"
    if out.exists():
        Manifest.load(out)  # every file there, every checksum right
    else:
        assert point == "rename", f"killed in {point}, the export removed the old artifact"
    assert _export_killed_at("none", checkpoint, out) == 0
    Manifest.load(out)


def test_an_export_stopped_by_sigterm_removes_its_staging_directory(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "pagedgraph.cli", "export", "--model", str(checkpoint),
                             "--out", str(out)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".art.partial-*/graphs/*.onnx")):  # converting (the gear check still ahead)
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 128 + signal.SIGTERM
    assert "export interrupted by SIGTERM: nothing written" in proc.stderr.read()
    assert not out.exists() and not list(tmp_path.glob(".art.partial-*")), sorted(tmp_path.rglob("*"))


def test_loading_and_running_an_artifact_unpickles_nothing(checkpoint: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime reads JSON, ONNX and raw weights only: loading and generating with unpickling disabled works."""
    assert _export_killed_at("none", checkpoint, tmp_path / "art") == 0

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the runtime tried to unpickle artifact data")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (np, "load")):
        monkeypatch.setattr(module, name, refuse)
    out = LLM(tmp_path / "art", num_blocks=16, threads=1).generate([[5, 6, 7]])[0]
    assert out.error is None and out.token_ids
