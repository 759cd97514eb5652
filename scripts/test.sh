#!/usr/bin/env bash
# Install (if needed) and run the test suite. GPU tests skip on hosts without CUDA, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
exec python -m pytest -q "$@"
