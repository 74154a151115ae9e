"""`pagedgraph atc-plan`: the ATC command lines that turn an artifact's ONNX graph into OM models on Ascend.

ATC compiles one ONNX graph whose bucket dims are -1 into one static subgraph per gear
(`--input_shape` with -1, `--dynamic_dims` with the gear list). The pools' slot dimension is
not a gear dimension: it is fixed per OM model from the deployment's pool size.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from ..artifact.manifest import Manifest
from .buckets import MAX_GEARS_PER_FAMILY, BucketError, check_ascend_limits
from ..graphs.contract import Gear


def _dim_values(gear: Gear) -> dict[str, int]:
    """Symbolic bucket dims of the ONNX graph (graphs.contract.INPUT_DIMS) -> this gear's sizes."""
    return {"T": gear.tokens, "B": gear.seqs, "M": gear.blocks, "B_plus_1": gear.seqs + 1}


def atc_commands(artifact: Path, num_blocks: int, soc_version: str) -> dict[str, str]:
    """One `atc` command per bucket family; raises BucketError if the export breaks an Ascend limit."""
    manifest = Manifest.load(artifact, verify=False)
    check_ascend_limits(manifest.model, manifest.block_size)
    commands = {}
    for family, spec in manifest.families.items():
        if not spec.graph.endswith(".onnx"):
            raise BucketError(f"the {family} family has no ONNX graph ({spec.graph}); re-export with --format onnx")
        if len(spec.gears) > MAX_GEARS_PER_FAMILY:
            raise BucketError(f"the {family} family has {len(spec.gears)} gears; ATC --dynamic_dims allows at most "
                              f"{MAX_GEARS_PER_FAMILY}: re-export with shorter ladders")
        graph = onnx.load_model(str(Path(artifact) / spec.graph), load_external_data=False).graph
        shapes, dynamic = [], []
        for value in graph.input:
            dims = []
            for d in value.type.tensor_type.shape.dim:
                if d.dim_param == "num_slots":
                    dims.append(str(num_blocks * manifest.block_size))
                elif d.dim_param:
                    dims.append("-1")
                    dynamic.append(d.dim_param)
                else:
                    dims.append(str(d.dim_value))
            shapes.append(f"{value.name}:{','.join(dims)}")
        gears = ";".join(",".join(str(_dim_values(g)[name]) for name in dynamic) for g in spec.gears)
        commands[family] = (f"atc --framework=5 --model={Path(artifact) / spec.graph} "
                            f"--output={Path(artifact) / 'om' / family} --soc_version={soc_version} "
                            f'--input_format=ND --input_shape="{";".join(shapes)}" --dynamic_dims="{gears}"')
    return commands
