"""Export never destroys data: it writes only to a new path, an empty directory or an artifact, and every
"not an artifact" error suggests a command that is safe to run as written (run here, on a real checkpoint)."""
from __future__ import annotations

import hashlib
import io
import re
import shlex
from pathlib import Path

import pytest

from pagedgraph.artifact.manifest import MANIFEST, ArtifactError, Manifest
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import ExportTargetError, export
from pagedgraph.cli import main
from tests.paths import REPO

pytestmark = pytest.mark.unit
TINY_EXPORT = {"max_model_len": 64, "verify_gears": False,
               "buckets": {"decode_batch": [2], "prefill_tokens": [32], "prefill_max_seqs": 2}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from tests.tiny_models import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


def _config(source: Path) -> ExportConfig:
    return ExportConfig.model_validate({"model": {"source": str(source)}, "export": TINY_EXPORT})


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_non_empty_non_artifact_directory_is_refused_and_left_untouched(checkpoint: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "scratch"
    (scratch / "sub").mkdir(parents=True)
    (scratch / "notes.txt").write_text("keep me")
    (scratch / "sub" / "data.csv").write_text("1,2")
    before = _snapshot(scratch)
    for force in (False, True):
        with pytest.raises(ExportTargetError, match=r"not empty and not a pagedgraph artifact \(it holds notes.txt, "
                                                    r"sub/\).*with or without --force"):
            export(_config(checkpoint), scratch, log=io.StringIO(), force=force)
        assert _snapshot(scratch) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scratch"], "no staging directory left behind"
    # The checkpoint folder itself, the case the old hint led users into:
    ckpt_before = _snapshot(checkpoint)
    with pytest.raises(ExportTargetError, match="config.json"):
        export(_config(checkpoint), checkpoint, log=io.StringIO())
    assert _snapshot(checkpoint) == ckpt_before


def test_new_paths_empty_directories_and_artifacts_are_written(checkpoint: Path, tmp_path: Path) -> None:
    export(_config(checkpoint), tmp_path / "new" / "art", log=io.StringIO())
    (tmp_path / "empty").mkdir()
    export(_config(checkpoint), tmp_path / "empty", log=io.StringIO())
    Manifest.load(tmp_path / "empty")
    export(_config(checkpoint), tmp_path / "empty", log=io.StringIO())  # same checkpoint: replaced without --force
    Manifest.load(tmp_path / "empty")


def test_replacing_an_artifact_of_another_checkpoint_needs_force(checkpoint: Path, tmp_path: Path) -> None:
    import shutil

    other = tmp_path / "other-llama"
    shutil.copytree(checkpoint, other)
    export(_config(checkpoint), tmp_path / "art", log=io.StringIO())
    before = _snapshot(tmp_path / "art")
    with pytest.raises(ExportTargetError, match=f"exported from {checkpoint}.*add --force"):
        export(_config(other), tmp_path / "art", log=io.StringIO())
    assert _snapshot(tmp_path / "art") == before
    export(_config(other), tmp_path / "art", log=io.StringIO(), force=True)
    assert Manifest.load(tmp_path / "art").export_config["model"]["source"] == str(other)


def test_a_file_as_out_is_refused(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").write_text("x")
    assert main(["export", "--model", str(checkpoint), "--out", str(tmp_path / "out")]) == 2
    assert "is a file" in capsys.readouterr().err and (tmp_path / "out").read_text() == "x"


def _suggested(message: str) -> list[str]:
    commands = re.findall(r"`(pagedgraph [^`]+)`", message)
    assert len(commands) == 1, message
    return shlex.split(commands[0])


@pytest.mark.parametrize("case", ["missing", "checkpoint", "configs", "scratch", "empty", "gguf"])
def test_every_not_an_artifact_hint_is_safe_to_run(checkpoint: Path, tmp_path: Path, case: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the suggested command (a placeholder replaced by a real checkpoint): it must export an artifact and
    change nothing that was there, and generate must then accept the --out it names."""
    import shutil

    monkeypatch.chdir(tmp_path)
    given = {"missing": tmp_path / "nothing-here", "checkpoint": tmp_path / "ckpt",
             "configs": Path("configs"), "scratch": tmp_path / "scratch", "empty": tmp_path / "empty",
             "gguf": tmp_path / "model.gguf"}[case]
    if case == "checkpoint":
        shutil.copytree(checkpoint, given)
    elif case == "configs":
        shutil.copytree(REPO / "configs", given)
    elif case == "scratch":
        given.mkdir()
        (given / "notes.txt").write_text("keep me")
    elif case == "empty":
        given.mkdir()
    elif case == "gguf":
        given.write_bytes(b"GGUF not really")
    before = _snapshot(given) if given.is_dir() else (given.read_bytes() if given.exists() else None)
    with pytest.raises(ArtifactError) as err:
        Manifest.load(given)
    message = str(err.value)
    assert ("does not exist" in message) == (case == "missing"), message
    argv = _suggested(message)
    assert argv[:2] == ["pagedgraph", "export"]
    model = argv.index("--model") + 1
    if argv[model].startswith("<"):
        argv[model] = str(checkpoint)
    elif case == "gguf":
        argv[model] = str(checkpoint)  # not a real GGUF here: what matters is where --out points
    out = Path(argv[argv.index("--out") + 1])
    assert main(argv[1:] + ["--config", str(_tiny_yaml(tmp_path))]) == 0
    Manifest.load(out)
    if case not in ("missing", "empty"):
        assert out != given
        now = _snapshot(given) if given.is_dir() else given.read_bytes()
        assert now == before, "the suggested command changed what was there"
        assert not (given / MANIFEST).exists()


def _tiny_yaml(tmp_path: Path) -> Path:
    import yaml

    path = tmp_path / "tiny-export.yaml"
    path.write_text(yaml.safe_dump({"export": TINY_EXPORT}))
    return path
