"""Host memory of a MINDIR ladder, two weight forms in ONE invocation: the export's (weights are graph inputs,
bound once from one memory map to every gear) against the same graphs with the weights turned into Parameters
(the Ascend form before, which MindSpore copies into every loaded GraphCell). Each form runs in a child process
of its own, through runtime/executor_mindspore.py, loading and running the gears one after another; the RSS after
each gear and the ratio are printed:

    flock /tmp/pg-cpu.lock python scripts/mindir_weights_rss.py --artifact ART --gears 6 --json docs/bench/X.json

ART needs CPU MINDIR graphs (`pagedgraph export --format onnx,mindir --target cpu`). Each gear runs one step on
a one-token feed; the pool is the smallest the gears need.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.artifact.mindir import WEIGHTS, MindirIndex, numpy_dtype
from pagedgraph.exporter.mindspore.builder import weight_attribute
from pagedgraph.graphs import contract as c
from pagedgraph.graphs.contract import Gear

FORMS = ("inputs", "parameters")  # the first is the export's, the second the baseline


def _status() -> dict[str, int]:
    """This process's resident memory now, in bytes: all of it, anonymous (private copies) and file-backed."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def _gears(manifest: Manifest, count: int) -> list[tuple[str, Gear]]:
    """`count` gears, taken in turn from each family, smallest first."""
    queues = [[(family, g) for g in sorted(spec.gears)] for family, spec in manifest.families.items()]
    picked: list[tuple[str, Gear]] = []
    while len(picked) < count and any(queues):
        for queue in queues:
            if queue and len(picked) < count:
                picked.append(queue.pop(0))
    return picked


def _parameter_form(graph: bytes, index: MindirIndex, location: str) -> bytes:
    """`graph` with every weight input turned into a Parameter whose data lies in `location` (external data,
    as the Ascend graphs were written before)."""
    from mindspore.train.mind_ir_pb2 import ModelProto

    proto = ModelProto()
    proto.ParseFromString(graph)
    names = {weight_attribute(name): name for name in index.weights}
    kept = []
    for value in proto.graph.input:
        name = names.get(value.name.split(":")[-1])
        if name is None:
            kept.append(value)
            continue
        entry = index.weights[name]
        parameter = proto.graph.parameter.add()
        parameter.name, parameter.data_type = value.name, value.tensor[0].data_type
        parameter.dims.extend(entry.shape)
        parameter.external_data.location = location
        parameter.external_data.offset = entry.offset
        parameter.external_data.length = int(np.prod(entry.shape)) * numpy_dtype(entry.dtype or index.dtype).itemsize
    del proto.graph.input[:]
    proto.graph.input.extend(kept)
    return proto.SerializeToString()


def _executor(form: str) -> type:
    from pagedgraph.runtime.executor_mindspore import MindSporeExecutor

    if form == "inputs":
        return MindSporeExecutor

    class ParameterFormExecutor(MindSporeExecutor):
        """Binds each gear as the executor does, then turns the bound copy's weight inputs into Parameters read
        from a link to the weights file beside it (MindSpore reads external data only from the graph's own
        folder), and calls the gears without weight arguments."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.weights_file = self.artifact / WEIGHTS
            self.index = dataclasses.replace(self.index, weight_inputs={self.index.dtype: ()})

        def _bind(self, graph: str) -> Path:
            bound = super()._bind(graph)
            link = bound.parent / self.weights_file.name
            if not link.exists():
                os.link(self.weights_file, link)  # same file system as the scratch folder, else copy
            bound.write_bytes(_parameter_form(bound.read_bytes(), self.index, link.name))
            return bound

    return ParameterFormExecutor


def _child(artifact: Path, form: str, gears: int, threads: int) -> dict[str, Any]:
    """Load and run the gears one by one through the executor; RSS before the first and after each."""
    from pagedgraph.runtime.kv_pools import KVPools

    manifest = Manifest.load(artifact, verify=False)
    picked = _gears(manifest, gears)
    executor = _executor(form)(artifact, manifest, KVPools(manifest, max(g.blocks for _, g in picked) + 1), threads)
    series = [{"gear": None, **_status()}]
    for family, gear in picked:
        feed = {name: np.zeros(shape, c.INPUT_DTYPES[name]) for name, shape in gear.input_shapes().items()}
        feed[c.CU_SEQLENS_Q][1:] = 1  # one real token, the rest padding into the null block
        feed[c.CONTEXT_LENS][0] = 1
        logits = executor.run(gear, feed)
        if not np.isfinite(logits[0]).all():
            raise RuntimeError(f"{family} gear {gear}: bad logits")
        series.append({"gear": f"{family} T{gear.tokens} B{gear.seqs} M{gear.blocks}", **_status()})
    return {"series": series}


def _machine() -> dict[str, Any]:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu": model, "cores": os.cpu_count(), "flags": sorted(f for f in flags if f.startswith(("avx512", "amx"))),
            "load_avg_1m_at_start": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, type=Path)
    parser.add_argument("--gears", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", choices=FORMS, help=argparse.SUPPRESS)  # one form's figures, JSON on stdout
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.artifact, args.child, args.gears, args.threads)))
        return 0
    index = MindirIndex.load(args.artifact)
    if index.target != "cpu":
        parser.error(f"--artifact {args.artifact}: its MINDIR is for {index.target!r}; export one with "
                     "`--format onnx,mindir --target cpu` to load it here")
    manifest = Manifest.load(args.artifact, verify=False)
    results: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": _machine(),
                               "model": {k: getattr(manifest.model, k) for k in ("num_layers", "hidden_size")},
                               "mindir_dtype": index.dtype, "weights_bytes": (args.artifact / WEIGHTS).stat().st_size,
                               "forms": {}}
    for form in FORMS:
        command = [sys.executable, __file__, "--child", form, "--artifact", str(args.artifact), "--gears",
                   str(args.gears), "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"the {form} form failed (exit {done.returncode})")
        results["forms"][form] = json.loads(done.stdout.strip().splitlines()[-1])
    results["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    _report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def _report(results: dict[str, Any]) -> None:
    mib = 2 ** 20
    series = {form: results["forms"][form]["series"] for form in FORMS}
    print(f"weights {results['weights_bytes'] / mib:.0f} MiB; {results['machine']}")
    print(f"{'after':28}" + "".join(f"{form + ' RSS/anon MiB':>26}" for form in FORMS))
    for rows in zip(*series.values()):
        print(f"{rows[0]['gear'] or 'executor created':28}"
              + "".join(f"{r['VmRSS'] / mib:>17.0f} /{r['RssAnon'] / mib:>7.0f}" for r in rows))
    growth = {form: s[-1]["VmRSS"] - s[0]["VmRSS"] for form, s in series.items()}
    gears = len(series["inputs"]) - 1
    print(f"{gears} gears: RSS {series['parameters'][-1]['VmRSS'] / series['inputs'][-1]['VmRSS']:.2f}x "
          f"(parameters / inputs); growth over the gears {growth['parameters'] / mib:.0f} vs "
          f"{growth['inputs'] / mib:.0f} MiB, {growth['parameters'] / max(growth['inputs'], 1):.2f}x; per gear "
          f"{growth['parameters'] / gears / mib:.0f} vs {growth['inputs'] / gears / mib:.0f} MiB")


if __name__ == "__main__":
    raise SystemExit(main())
