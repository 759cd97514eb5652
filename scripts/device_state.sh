#!/usr/bin/env bash
# The campaign evidence a device call leaves on a warm machine, kept for its next call: `device_state.sh save` after
# each step copies every campaign directory the step added or changed (against the call's device commit) into
# .device-state/ (git-ignored, so the lender keeps it on a warm machine between calls and the copy never replaces it);
# `device_state.sh restore` at the start of a call puts back each saved campaign this checkout lacks (no
# evidence.json). A grid cut by one command's time limit then resumes in the next call without first copying the
# evidence back here (which can take longer than the machine stays warm). A campaign the checkout already has is left
# as it is: absorb the further-along evidence before a call if it has both.
set -uo pipefail
STATE=.device-state/campaigns
case ${1:-} in
  save)
    git status --porcelain --untracked-files=all -- records/campaigns | cut -c4- | cut -d/ -f3 | sort -u |
      while read -r id; do
        [ -n "$id" ] && [ -d "records/campaigns/$id" ] || continue
        mkdir -p "$STATE" && rm -rf "${STATE:?}/$id" && cp -r "records/campaigns/$id" "$STATE/$id"
      done ;;
  restore)
    [ -d "$STATE" ] || exit 0
    for d in "$STATE"/*/; do
      [ -d "$d" ] || continue
      id=$(basename "$d")
      # by its evidence, not its directory: the lender keeps a call's ignored files (runner.pid) on a warm machine,
      # so a campaign the copy lacks can still have a directory there (2026-12-06: two resumes started anew)
      if [ ! -e "records/campaigns/$id/evidence.json" ]; then
        mkdir -p "records/campaigns/$id" && cp -r "$d/." "records/campaigns/$id/" &&
          echo "restored $id from this machine's last call"
      fi
    done ;;
  *) echo "usage: device_state.sh save|restore (got '${1:-}')"; exit 2 ;;
esac
