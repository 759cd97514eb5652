#!/usr/bin/env bash
# Install (if needed) and run the main job: a campaign. On a CPU host this is the small non-binding rehearsal on
# the `tiny` model (real servers on loopback, real MLflow sqlite store); on a CUDA host, the binding campaign.
# Extra arguments are Hydra overrides, e.g. `bash scripts/rehearse.sh campaign=marlin_dense`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
if [ $# -eq 0 ]; then set -- campaign=gqa_swap; fi
exec vtcampaign run "$@"
