#!/usr/bin/env bash
# Install (if needed) and run the test suite. GPU tests skip on hosts without CUDA, with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
. .venv/bin/activate
# two workers (CI's 2 cores): the suite's 22 min serial take ~13 (2026-12-04); `-n 0` runs it in one process.
# The 15 slowest tests close every run's log: the suite must stay under CI's 30 minutes (22-26 on 2026-12-05).
# worksteal: a worker that runs out takes tests queued on the other, so a 3-minute test dealt late to one worker
# does not leave the other idle at the end (xdist's default deals the whole queue out in advance).
exec python -m pytest -q -n 2 --dist worksteal --durations=15 "$@"
