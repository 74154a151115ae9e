"""`pagedgraph atc-plan`: the ATC command per bucket family, and refusal of ladders Ascend cannot take."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedgraph.exporter.atc import atc_commands
from pagedgraph.exporter.buckets import BucketError
from pagedgraph.cli import main
from tests.mindspore_support import export_artifact
from tests.random_checkpoint import write_random_llama

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    checkpoint = write_random_llama(tmp_path_factory.mktemp("random_llama"))
    return export_artifact(str(checkpoint), tmp_path_factory.mktemp("atc") / "art", ["onnx"], decode=[2, 4],
                           prefill=[16], max_seqs=2, max_model_len=64)


def test_one_command_per_family_with_every_gear(artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["atc-plan", "--artifact", str(artifact), "--num-blocks", "10"]) == 0
    printed = capsys.readouterr().out
    decode = atc_commands(artifact, num_blocks=10, soc_version="Ascend910B1")["decode"]
    assert f"# decode\n{decode}" in printed and "# prefill\n" in printed
    assert decode.startswith(f"atc --framework=5 --model={artifact}/graphs/model.onnx ")
    # Inputs in graph order; bucket dims are -1, pools get the fixed pool size (10 blocks x 16 slots).
    assert ('--input_shape="positions:-1;slot_mapping:-1;block_tables:-1,-1;context_lens:-1;cu_seqlens_q:-1;'
            'input_ids:-1;k_cache_0:160,32;v_cache_0:160,32;k_cache_1:160,32;v_cache_1:160,32;logits_indices:-1"'
            in decode)
    # Per gear, the value of each -1 in order (T, T, B, M, B, B+1, T, B): gears (2, 2, 4) and (4, 4, 4).
    assert decode.endswith('--dynamic_dims="2,2,2,4,2,3,2,2;4,4,4,4,4,5,4,4"')


def _edited_copy(artifact: Path, tmp_path: Path, **changes: object) -> Path:
    copy = Path(shutil.copytree(artifact, tmp_path / "copy"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest.update(changes)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def test_refuses_more_than_100_gears(artifact: Path, tmp_path: Path) -> None:
    families = json.loads((artifact / "manifest.json").read_text())["families"]
    families["decode"]["gears"] = [[b, b, 4] for b in range(1, 102)]
    with pytest.raises(BucketError, match="the decode family has 101 gears; ATC --dynamic_dims allows at most 100"):
        atc_commands(_edited_copy(artifact, tmp_path, families=families), 10, "Ascend910B1")


def test_refuses_block_sizes_ascend_cannot_page(artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = _edited_copy(artifact, tmp_path, block_size=24)
    assert main(["atc-plan", "--artifact", str(broken)]) == 2
    assert "export.block_size = 24: must be a multiple of 16" in capsys.readouterr().err
