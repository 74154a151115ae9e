"""Export time, peak RSS and artifact size of checkpoints of growing size at each precision, in one invocation.

Each export (`pagedgraph.exporter.export.export`, the gear check on) runs in a grandchild started by a small child
process that reads its peak RSS with resource.getrusage(RUSAGE_CHILDREN) (a child's peak RSS includes its
parent's at the fork, so this script's own memory never counts), one after the other; before them a grandchild that
only loads the exporter's libraries gives the baseline the ratios are taken to. Per run: wall seconds, peak RSS
and its ratio to the baseline and to the artifact's weights, the artifact's size, and what the export printed about
its gear check; an export refused up front (disk or memory too small, exporter/resources.py) is recorded with its
message. Each artifact is deleted once measured unless --keep.

    python scripts/export_bench.py --checkpoint 1.1b=CKPT_DIR --precision fp32 --precision w8a8 \\
        --out-root SCRATCH --json docs/bench/export_sizes.json

Run it on an idle machine (each run records the load average before and after it, and the CPU flags). --json adds
to the file's runs (replacing those of the same checkpoint name, precision and --config), so several short
invocations fill one table. --config YAML exports with that file's ladder (configs/real-sizes-w8a8.yaml: the
runtime figures' artifacts) instead of the built-in one. A measurement script only: nothing imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.size_bench import _cpu_flags, _cpu_model, _portable  # noqa: E402

PRECISIONS: dict[str, dict[str, str]] = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "w8a8": {"dtype": "float32", "quantization": "w8a8"},
    "w8a16": {"dtype": "float32", "quantization": "w8a16"},
    "w4a16": {"dtype": "float32", "quantization": "w4a16"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
}
# The ladder of the first 1.1B trial (docs/performance.md): decode 1-8, prefill 32-512, max_model_len 1024.
EXPORT = {"max_model_len": 1024, "buckets": {"decode_batch": [1, 2, 4, 8], "prefill_tokens": [32, 64, 128, 256, 512]}}
# The grandchild: the export (or, with out "-", only the exporter's libraries and the tokenizer loaded).
EXPORT_CODE = """
import json, sys
config, out = json.loads(sys.argv[1]), sys.argv[2]
if out == "-":
    import onnxruntime, pagedgraph.exporter.export, tokenizers
    tokenizers.Tokenizer.from_file(config["model"]["source"] + "/tokenizer.json")
else:
    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export
    from pagedgraph.texts import shipped_text
    export(ExportConfig.model_validate(config), out, calibration_text=shipped_text("calibration"))
"""
MEASURE_CODE = """
import json, resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run([sys.executable, "-c", *sys.argv[1:]]).returncode
print(json.dumps({"returncode": code, "wall_s": time.perf_counter() - start,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _measured(config: dict[str, Any], out: str) -> tuple[dict[str, Any], str]:
    """The grandchild's returncode, wall seconds and peak RSS, and what it printed (stderr)."""
    run = subprocess.run([sys.executable, "-c", MEASURE_CODE, EXPORT_CODE, json.dumps(config), out], cwd=REPO,
                         capture_output=True, text=True)
    return json.loads(run.stdout.splitlines()[-1]), run.stderr


def _code() -> str:
    """The commit measured (with "+" when the tree has changes)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout
    return head.strip() + ("+" if dirty.strip() else "")


def _lines(stderr: str) -> list[str]:
    """The export's own lines (progress bars' carriage-return updates dropped)."""
    return [line for line in (part.split("\r")[-1].strip() for part in stderr.splitlines())
            if line and "%|" not in line]


def _run(name: str, checkpoint: Path, precision: str, out_root: Path, keep: bool, yaml_config: Path | None
         ) -> dict[str, Any]:
    base = yaml.safe_load(yaml_config.read_text()) if yaml_config else {"export": EXPORT}
    config = {"model": {**base.get("model", {}), **PRECISIONS[precision], "source": str(checkpoint)},
              "export": base.get("export", {})}
    out = out_root / f"{name}-{precision}"
    shutil.rmtree(out, ignore_errors=True)
    load_start = os.getloadavg()[0]
    result, stderr = _measured(config, str(out))
    lines = _lines(stderr)
    record = {"checkpoint": name, "precision": precision, "config": yaml_config.name if yaml_config else "EXPORT",
              "code": _code(), "date_utc": datetime.now(
        timezone.utc).isoformat(timespec="seconds"), "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0],
        "checkpoint_bytes": sum(p.stat().st_size for p in checkpoint.glob("*.safetensors")), **result}
    if result["returncode"]:
        record["error"] = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "")
        return record
    weights = out / "graphs" / "weights.bin"
    record |= {"artifact_bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file()),
               "weights_bytes": weights.stat().st_size,
               "verify": [line for line in lines if line.startswith(("verifying", "did not verify", "[verify"))],
               "notes": [line for line in lines if line.startswith("note:")]}
    if not keep:
        shutil.rmtree(out)
    return record


def _table(runs: list[dict[str, Any]], baseline: int) -> str:
    rows = ["| checkpoint | precision | export s | peak RSS MiB | vs libraries only | peak / weights | artifact GB | "
            "load avg |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        if r["returncode"]:
            rows.append(f"| {r['checkpoint']} | {r['precision']} | refused: {r.get('error', '')} | | | | | "
                        f"{r['load_avg_1m_start']:.1f} |")
            continue
        peak = r["peak_rss_bytes"]
        rows.append(f"| {r['checkpoint']} | {r['precision']} | {r['wall_s']:.0f} | {peak / 2**20:,.0f} | "
                    f"{peak / baseline:.2f}x | {peak / r['weights_bytes']:.2f} | "
                    f"{r['artifact_bytes'] / 1e9:.2f} | {r['load_avg_1m_start']:.1f} -> {r['load_avg_1m_end']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="an HF checkpoint directory (scripts/make_checkpoint.py), smallest first; repeat")
    parser.add_argument("--precision", action="append", choices=sorted(PRECISIONS), default=[])
    parser.add_argument("--out-root", type=Path, required=True, help="where the artifacts are written (and deleted)")
    parser.add_argument("--keep", action="store_true", help="keep the artifacts")
    parser.add_argument("--config", type=Path, help="an export YAML whose export section (and model keys other than "
                        "dtype and quantization) replace the built-in ladder, EXPORT")
    parser.add_argument("--json", type=Path, help="add the runs to this file")
    args = parser.parse_args()
    if not args.checkpoint or not args.precision:
        parser.error("give --checkpoint and --precision at least once each")
    checkpoints = [(name, Path(path)) for name, _, path in (c.partition("=") for c in args.checkpoint)]
    started = {"cpu": _cpu_model(), "cpu_flags": _cpu_flags(), "cores": os.cpu_count(),
               "command": " ".join(_portable([a.partition("=")[2] if "=" in a and os.path.exists(a.partition("=")[2])
                                              else a for a in sys.argv]))}
    print(f"load average {os.getloadavg()}, CPU {started['cpu']} {started['cpu_flags']}", flush=True)
    base, _ = _measured({"model": {"source": str(checkpoints[0][1])}}, "-")
    runs = []
    for name, checkpoint in checkpoints:
        for precision in args.precision:
            runs.append(_run(name, checkpoint, precision, args.out_root, args.keep, args.config))
            r = runs[-1]
            print(f"{name} {precision}: " + (f"refused: {r.get('error')}" if r["returncode"] else
                  f"{r['wall_s']:.0f} s, peak {r['peak_rss_bytes'] / 2**20:,.0f} MiB, artifact "
                  f"{r['artifact_bytes'] / 1e9:.2f} GB") + f" (load average {os.getloadavg()[0]:.2f})", flush=True)
    for r in runs:
        r["baseline_peak_rss_bytes"] = base["peak_rss_bytes"]
    print(_table(runs, base["peak_rss_bytes"]))
    if args.json:
        previous = json.loads(args.json.read_text()) if args.json.is_file() else {"runs": []}
        done = {(r["checkpoint"], r["precision"], r["config"]) for r in runs}
        kept = [r for r in previous["runs"] if (r["checkpoint"], r["precision"], r.get("config", "EXPORT")) not in done]
        # "export" is the built-in ladder, the one of the runs whose config is "EXPORT"; a --config run names its
        # YAML instead, so the key is left out where no run used the built-in ladder.
        builtin = {"export": EXPORT} if any(r.get("config", "EXPORT") == "EXPORT" for r in kept + runs) else {}
        results = {**started, **builtin, "runs": kept + runs}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
