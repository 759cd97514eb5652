"""Tab completion of `vtcampaign` (argcomplete): the Hydra overrides of a run, campaign ids, flip branches, and the
whole path through the installed command as a shell calls it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import git
import pytest

from campaigns.completion import campaign_ids, complete_override, flip_branches

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_complete_groups_options_keys_and_values(tmp_path):
    assert complete_override("camp") == ["campaign="]
    assert complete_override("campaign=gq") == ["campaign=gqa_swap"]
    assert complete_override("campaign=gqa_swap,pd") == ["campaign=gqa_swap,pdl", "campaign=gqa_swap,pdl_prefetch",
                                                         "campaign=gqa_swap,pdl_stack"]     # a sweep's list
    assert complete_override("model=qwen3-8") == ["model=qwen3-8b"]
    assert complete_override("grid.resid", ["campaign=gqa_swap"]) == ["grid.residency="]
    assert sorted(complete_override("grid.residency=")) == ["grid.residency=alternate", "grid.residency=auto",
                                                            "grid.residency=together"]
    assert complete_override("aa=") == ["aa=false", "aa=true"]
    assert complete_override("device=c") == ["device=cuda", "device=cpu"]
    assert "grid.reps=" in complete_override("grid.", ["campaign=pdl"])
    assert complete_override("grid.reps=") == []                 # a number: nothing to offer
    assert complete_override("nosuchkey.x") == [] and complete_override("zzz") == []
    top = complete_override("")
    assert {"campaign=", "grid=", "model=", "aa=", "resume="} <= set(top) and "campaign." not in top
    # resume= offers auto and the campaigns that have not finished
    out = tmp_path / "campaigns"
    from campaigns.evidence import save_evidence
    from helpers import TPUT_WIN, make_evidence
    done = make_evidence(TPUT_WIN, campaign_id="2026-12-05-gqa_swap-aaa1111")
    open_ = make_evidence(TPUT_WIN, campaign_id="2026-12-05-gqa_swap-bbb2222")
    open_.status = "in-progress"
    for ev in (done, open_):
        save_evidence(ev, out / ev.campaign_id)
    assert complete_override("resume=", out_dir=out) == ["resume=auto", "resume=2026-12-05-gqa_swap-bbb2222"]
    assert campaign_ids(out, "2026-12-05-gqa_swap-a") == ["2026-12-05-gqa_swap-aaa1111"]
    assert campaign_ids(tmp_path / "none") == []


def test_flip_branches_and_their_levers_complete(tmp_path):
    r = git.Repo.init(tmp_path, initial_branch="main")
    (tmp_path / "f").write_text("x\n")
    r.index.add(["f"])
    r.index.commit("base", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    for b in ("row/pdl-flip", "row/pdl_stack-bf16-flip", "topic"):
        r.create_head(b)
    assert flip_branches(tmp_path) == ["pdl", "pdl_stack-bf16", "row/pdl-flip", "row/pdl_stack-bf16-flip"]
    assert flip_branches(tmp_path, "row/pdl_") == ["row/pdl_stack-bf16-flip"]
    assert flip_branches(tmp_path / "not-a-repo") == []


def _complete(line: str, cwd: Path = ROOT) -> list[str]:
    """What bash gets back for ``line`` from the installed command under argcomplete (its protocol: the line and
    cursor in the environment, the answers on file descriptor 8, separated by a vertical tab)."""
    env = {**os.environ, "_ARGCOMPLETE": "1", "COMP_LINE": line, "COMP_POINT": str(len(line)),
           "_ARGCOMPLETE_SHELL": "bash", "COMP_TYPE": "9"}
    r = subprocess.run(["bash", "-c", f'"{sys.executable}" -m campaigns.cli 8>&1 9>/dev/null'], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return sorted(w.strip() for w in r.stdout.split("\v") if w.strip())


@pytest.mark.parametrize("line, expected", [
    ("vtcampaign re", ["recheck", "render"]),
    ("vtcampaign run campaign=fuse_n", ["campaign=fuse_norm"]),
    ("vtcampaign run campaign=gqa_swap grid.resid", ["grid.residency="]),
    ("vtcampaign sources pdl_s", ["pdl_stack"]),
])
def test_the_command_completes_through_argcomplete(line, expected):
    assert _complete(line) == expected
