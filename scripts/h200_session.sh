#!/usr/bin/env bash
# One call on the lent GPU machine: `bash scripts/h200_session.sh STEP...` with the `.whl` wheelhouse carried.
# (`python scripts/prune_wheels.py` first: it drops the MLflow wheels a tracking=off call never imports, 17 MB of
# the lender's 64 MiB carry limit.)
# Each step is one argument: [SECONDS@]campaign:<name>[:<space-separated overrides>] | [SECONDS@]decode[:<args>] |
# [SECONDS@]gputests[:<pytest args>] (the `gpu` tests; their JUnit XML comes back in bench/results/) |
# [SECONDS@]py:<module> [args] (python3 -m <module> [args]) |
# [SECONDS@]recheck[:<overrides>] (vtcampaign recheck --frozen --within SECONDS: the plan made here with --dry-run,
# resumable, starting only the campaigns that should end within the step: carry records/campaigns/.recheck.json
# and copy the returned evidence back before the next call) |
# [SECONDS@]serve:<vtengine serve flags>|<vtengine bench serve flags>[|<bench serve flags>...] (one server, one
# closed-loop leg per |-part, each with its own SECONDS). A step past its SECONDS (default 400) gets SIGINT:
# servers stop, evidence is kept. Campaign steps run with resume=auto (unless they name a resume=): carry the
# returned evidence back into records/campaigns/ and repeat the same step in the next call to continue it.
# Everything it produces (evidence, records, bench results, logs) comes back as one tarball in $OUT.
# Back here, `python scripts/absorb_results.py <files_at>/results.tgz` takes it in and commits it at once.
# A campaign step cut off after its last leg (before its verdict): `vtcampaign conclude <id>` here, no device needed.
# `vtcampaign recheck --dry-run` here prints the stale verdicts' campaign steps, timed and packed into calls.
# Absorb each call's tarball before the next call: a call carries the checkout as it is, and a resume=auto step
# whose copy lacks the last call's legs starts its campaign anew (absorb keeps the further-along evidence; with
# --no-render it takes the files in within seconds and leaves the render and commit for later). While
# the machine stays warm (about 30 s idle) the next call needs no absorb first: scripts/device_state.sh keeps each
# call's campaigns on the machine and puts back those the checkout lacks; absorb both tarballs afterwards, in order.
set -uo pipefail
# The lender stops a command at 600 s (CALL_S): a step still running then would lose its tarball, and with it every
# leg it finished. Each step's SECONDS is cut to what is left of the call, less RESERVE_S for a stopped step to end
# (SIGINT, then KILL after KILL_S) and for the tarball; a step with under a minute left is not started.
CALL_S=${CALL_S:-600}; KILL_S=15; RESERVE_S=$(( KILL_S + 10 )); T_START=$(date +%s)
for step in "$@"; do          # a bad step is refused before the machine spends minutes on the ones before it
  case $step in *@*) case ${step%%@*} in ''|*[!0-9]*|0*)      # 0 would be no limit to timeout(1)
    echo "step '$step': '${step%%@*}' before @ is not a number of seconds (e.g. 400@campaign:gqa_swap)"; exit 2 ;;
  esac ;; esac
  case ${step#*@} in campaign:*|decode|decode:*|gputests|gputests:*|py:*|recheck|recheck:*|serve:*) ;;
    *) echo "step '$step': unknown kind; accepted: campaign:, decode[:], gputests[:], py:, recheck[:], serve:"
       exit 2 ;;
  esac
  case ${step#*@} in campaign:*|recheck|recheck:*)   # evidence names its commit: the copy here has no .git to ask
    sha=${CAMPAIGN_SOURCE_SHA:-}
    case $sha in ''|*[!0-9a-f]*) ok=0 ;; *) ok=$(( ${#sha} >= 7 && ${#sha} <= 40 )) ;; esac
    if [ "$ok" != 1 ]; then
      echo "step '$step' records evidence, which names its source commit: CAMPAIGN_SOURCE_SHA is '$sha'," \
           "not a hex commit sha of 7-40 digits (pass the checkout's literal short sha, e.g." \
           "CAMPAIGN_SOURCE_SHA=0dbde52; \$(git rev-parse ...) gives nothing on the device copy)"; exit 2
    fi ;;
  esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The copy arrives without .git: commit it as a fresh repository (dirtiness is measured against the copy) and name
# the source commit for the fingerprint: CAMPAIGN_SOURCE_SHA=<sha> [CAMPAIGN_SOURCE_BRANCH=<branch>] in the env.
# Commit every time: a warm machine keeps the last call's repository under the new copy.
bash scripts/device_state.sh restore      # a warm machine's last call: its campaigns this checkout lacks
git init -q && git config user.name "vt dev" && git config user.email "dev@vtengine.local"
git add -A && git commit -q --allow-empty -m "device copy of ${CAMPAIGN_SOURCE_SHA:-unknown}"
git config core.fileMode false
echo "== $(git log -1 --oneline)  dirty: $(git status --porcelain | grep -v '^??' | wc -l) tracked files"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,memory.used --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
echo "== setup took $(( $(date +%s) - T_START )) s"
LOGS=/tmp/vt-logs; mkdir -p "${OUT:-/tmp/out}" $LOGS   # outside the tree: a log there would make it dirty
for step in "$@"; do
  limit=400; case $step in *@*) limit=${step%%@*}; step=${step#*@} ;; esac
  left=$(( T_START + CALL_S - RESERVE_S - $(date +%s) ))
  if [ $left -lt 60 ]; then echo "== step $step not started: ${left} s left of the ${CALL_S} s call"; continue; fi
  if [ $limit -gt $left ]; then echo "== step $step cut to ${left} s (asked ${limit}): what is left of the call"
                                limit=$left; fi
  kind=${step%%:*}; rest=${step#*:}; [ "$rest" = "$step" ] && rest=""
  t0=$(date +%s)
  case $kind in
    campaign) name=${rest%%:*}; ov=${rest#*:}; [ "$ov" = "$rest" ] && ov=""
              case " $ov" in *" resume="*) ;; *) ov="$ov resume=auto" ;; esac
              timeout -s INT -k $KILL_S $limit python3 -m campaigns.cli run campaign=$name tracking=off $ov 2>&1 | tee -a $LOGS/campaign-$name.log ;;
    decode)   timeout -s INT -k $KILL_S $limit python3 -m vtengine.cli bench decode --out bench/results $rest 2>&1 | tee $LOGS/decode.log ;;
    gputests) gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' _)
              xml=bench/results/gputests-${gpu:-GPU}-$(date -u +%Y-%m-%dT%H%M%S).xml   # the run's record: absorb
              timeout -s INT -k $KILL_S $limit python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
                --junitxml=$xml -o junit_suite_name="gpu tests at ${CAMPAIGN_SOURCE_SHA:-unknown}" ${rest:-tests} \
                2>&1 | tee -a $LOGS/gputests.log | tail -40
              # pytest's 5: nothing selected (a -k that matched no name): a record of zero tests says nothing
              [ "${PIPESTATUS[0]}" = 5 ] && { echo "== gputests: no test selected by '${rest:-tests}'; no record kept"
                                              rm -f $xml; } ;;
    py)       timeout -s INT -k $KILL_S $limit python3 -m $rest 2>&1 | tee -a $LOGS/py-${rest%% *}.log ;;
    recheck)  timeout -s INT -k $KILL_S $limit python3 -m campaigns.cli recheck --frozen --within $limit \
                tracking=off $rest 2>&1 | tee -a $LOGS/recheck.log ;;
    serve)    IFS='|' read -r -a parts <<< "$rest"; port=8123; url=http://127.0.0.1:$port
              python3 -m vtengine.cli serve ${parts[0]} --port $port >> $LOGS/serve-server.log 2>&1 & spid=$!
              python3 -c "import sys, time, urllib.request as u
end = time.time() + $limit
while time.time() < end:
    try: u.urlopen('$url/health', timeout=2); sys.exit(0)
    except Exception: time.sleep(1)
sys.exit(1)" || { echo "server did not start"; tail -20 $LOGS/serve-server.log; }
              for leg in "${parts[@]:1}"; do      # each leg its SECONDS, within what is left of the call
                leg_s=$(( T_START + CALL_S - RESERVE_S - 10 - $(date +%s) )); [ $leg_s -gt $limit ] && leg_s=$limit
                [ $leg_s -lt 30 ] && { echo "== leg not started: ${leg_s} s left: $leg"; continue; }
                timeout -s INT -k $KILL_S $leg_s python3 -m vtengine.cli bench serve --base-url $url $leg 2>&1 | tee -a $LOGS/serve.log
              done
              # a background job starts with SIGINT ignored: a server still loading would never stop on it
              kill -INT $spid; for _ in $(seq $KILL_S); do kill -0 $spid 2>/dev/null || break; sleep 1; done
              kill -0 $spid 2>/dev/null && { kill -TERM $spid; sleep 2; kill -KILL $spid 2>/dev/null; }; wait $spid ;;
    *) echo "unknown step $step" ;;
  esac
  echo "== step $step took $(( $(date +%s) - t0 )) s"
  bash scripts/device_state.sh save      # kept on the machine for its next call while it stays warm
  tar czf "${OUT:-/tmp/out}/results.tgz" records bench/results campaigns/gates/op_bounds.yaml -C /tmp vt-logs 2>/dev/null
done
