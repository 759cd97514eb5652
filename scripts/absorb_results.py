"""Bring one GPU call's results into the checkout and commit them at once, so a session cut off later keeps them.

    python scripts/absorb_results.py RESULTS_TGZ [--no-commit | --no-render] [-m MESSAGE]

RESULTS_TGZ is the tarball `scripts/h200_session.sh` leaves in $OUT (records, bench/results, op bounds, logs).
- records/campaigns/<id>/: copied over the checkout's when it is the same campaign (same `created` time: a resumed
  campaign's evidence grows call by call) and has come no less far (legs, gates, concluded): a call launched before
  the previous one was absorbed carries an older copy back; the runner's pid file is left out. Each call starts
  from the checkout, so two campaigns of one lever at one commit in one session both take the id
  <date>-<lever>-<sha7>: the later one comes in as <id>-2 (then -3...), its evidence's campaign_id rewritten, as
  `new_campaign_id` names a re-run.
- bench/results/: files the checkout lacks are copied; a file whose name the checkout already holds with other
  content (the decode bench names its output by date) is kept beside it as <stem>-<n><suffix>, never overwritten;
  one whose bytes the checkout holds under any name (renamed since the call's copy was made) is left out.
- campaigns/gates/op_bounds.yaml: taken when it differs (bounds measured on the device).
- the logs go to the directory printed at the end, outside the tree.
--no-render takes the files in and stops there (no render, no commit; a few seconds against the render's ~100 s):
for the next call on a fresh machine, so the campaign in flight resumes from the untracked evidence that call
carries (on a warm machine, given back after 30 s idle, call again at once: scripts/device_state.sh keeps the
campaigns there). Absorb the tarballs again afterwards, in order, to render and commit them.
Then `vtcampaign render` and, unless --no-commit, one commit of what changed ("Device results: ...", a subject of at
most 72 characters, every name in the body; amend it with the figures while it is still HEAD: campaign ids and
fingerprints name later commits, so history must not be rewritten past it).
"""
from __future__ import annotations

import argparse
import filecmp
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                    # run as a script: the checkout's own campaigns package
    sys.path.insert(0, str(ROOT))
from campaigns.evidence import dump_json  # noqa: E402


def _place(src: Path, dest: Path) -> Path | None:
    """Where ``src`` goes: ``dest``, else the first free <stem>-<n><suffix>; None when ``dest`` or one of those
    already holds the same bytes (taken in an earlier call)."""
    n, cand = 1, dest
    while cand.exists():
        if filecmp.cmp(src, cand, shallow=False):
            return None
        n += 1
        cand = dest.with_name(f"{dest.stem}-{n}{dest.suffix}")
    return cand


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _digests(folder: Path) -> set[str]:
    """The contents the checkout's ``folder`` holds, by SHA-256, whatever their names."""
    return {_digest(f) for f in folder.glob("*") if f.is_file()} if folder.is_dir() else set()


def _created(evidence: Path) -> str | None:
    try:
        return json.loads(evidence.read_text()).get("created")
    except (OSError, ValueError, AttributeError):
        return None


def _progress(evidence: Path) -> tuple[int, int, int]:
    """How far a campaign's evidence has come: (settled, legs, gate results); settled: 2 concluded, 1 abandoned here
    (`vtcampaign abandon`: a copy a call carried before that must not bring it back to in-progress), 0 neither."""
    try:
        data = json.loads(evidence.read_text())
    except (OSError, ValueError):
        return (0, 0, 0)
    if not isinstance(data, dict):
        return (0, 0, 0)
    size = [len(v) if isinstance(v, (list, dict)) else 0 for v in (data.get("legs"), data.get("gates"))]
    return ({"complete": 2, "abandoned": 1}.get(data.get("status"), 0), *size)


def _campaign_dest(cdir: Path, campaigns: Path) -> Path:
    """The checkout directory of the campaign in ``cdir``: the one of that id or of a re-run id (<id>-<n>) whose
    evidence has the same `created` time, else the first free one of those names."""
    created = _created(cdir / "evidence.json")
    n, cand = 1, campaigns / cdir.name
    while (cand / "evidence.json").exists():
        if created is None or _created(cand / "evidence.json") in (None, created):
            return cand
        n += 1
        cand = campaigns / f"{cdir.name}-{n}"
    return cand


def absorb(tgz: Path, root: Path = ROOT) -> tuple[list[str], list[str], Path]:
    """(campaign ids taken, bench files taken, the logs' directory)."""
    tmp = Path(tempfile.mkdtemp(prefix="vt-device-"))
    with tarfile.open(tgz) as tar:
        tar.extractall(tmp, filter="data")
    campaigns, bench, behind = [], [], []
    for src in sorted((tmp / "records" / "campaigns").glob("*/evidence.json")):
        cdir = src.parent
        dest = _campaign_dest(cdir, root / "records" / "campaigns")
        renamed = dest.name != cdir.name
        if renamed:                                     # another campaign took this id: a re-run id, set inside too
            data = json.loads(src.read_text())          # (record.md/pr.md carry the old one until the render below)
            data["campaign_id"] = dest.name
            src.write_text(dump_json(data))
        if (dest.exists() and (renamed or not filecmp.dircmp(cdir, dest).diff_files)
                and filecmp.cmp(src, dest / src.name, shallow=False)):
            continue                                    # carried there from this checkout, or taken before, unchanged
        if dest.exists() and not renamed and _progress(src) < _progress(dest / src.name):
            behind.append(dest.name)                    # a call launched before the last one was absorbed carried
            continue                                    # an older copy back: the checkout's is further along
        shutil.copytree(cdir, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("runner.pid", "*.pid"))
        campaigns.append(dest.name)
    held = _digests(root / "bench" / "results")
    for src in sorted((tmp / "bench" / "results").glob("*")):
        if not src.is_file():
            continue
        if _digest(src) in held:         # already here, maybe renamed since (the call carried an older checkout)
            continue
        dest = _place(src, root / "bench" / "results" / src.name)
        if dest is None:
            continue
        shutil.copy2(src, dest)
        bench.append(dest.name)
    bounds = tmp / "campaigns" / "gates" / "op_bounds.yaml"
    if bounds.exists() and not filecmp.cmp(bounds, root / "campaigns" / "gates" / "op_bounds.yaml", shallow=False):
        shutil.copy2(bounds, root / "campaigns" / "gates" / "op_bounds.yaml")
    if behind:
        print(f"kept the checkout's evidence of {behind}: the call brought back less (fewer legs or gates, not "
              "concluded, or not abandoned as here). A call carries the checkout as it was: absorb each call's "
              "results before the next one")
    return campaigns, bench, tmp / "vt-logs"


def pending(root: Path = ROOT) -> list[str]:
    """Campaign ids and bench files the checkout holds uncommitted: what an earlier absorb of the same tarball took
    in before it stopped short of its commit (a failed render), so that the retry still renders and names them."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", "records/campaigns",
                          "bench/results"], cwd=root, check=True, capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = Path(line[3:].strip('"')).parts
        name = parts[2] if parts[0] == "records" and len(parts) > 3 else parts[-1] if parts[0] == "bench" else None
        if name and name not in names:
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tgz", type=Path)
    p.add_argument("--no-commit", action="store_true")
    p.add_argument("--no-render", action="store_true", help="take the files in only (no render, no commit)")
    p.add_argument("-m", "--message", default=None)
    args = p.parse_args(argv)
    if not args.tgz.is_file():
        p.error(f"{args.tgz}: no such file (the call's files_at folder holds results.tgz)")
    campaigns, bench, logs = absorb(args.tgz, ROOT)
    print(f"campaigns: {campaigns or 'none new'}\nbench files: {bench or 'none new'}\nlogs: {logs}")
    if args.no_render:
        print("taken in, not rendered or committed: absorb the tarball again (without --no-render) to do both")
        return 0
    left = [n for n in pending(ROOT) if n not in campaigns + bench]
    if left:
        print(f"uncommitted from an earlier absorb, taken too: {left}")
    if campaigns or any((ROOT / "records" / "campaigns" / n).is_dir() for n in left):
        subprocess.run([sys.executable, "-m", "campaigns.cli", "render"], cwd=ROOT, check=True)
    taken = campaigns + [n for n in left if (ROOT / "records" / "campaigns" / n).is_dir()]
    for name in concludable(taken, ROOT):          # those an earlier --no-render took in, too
        print(f"{name}: every gate and leg is recorded, the verdict is not (the call's time ran out there): "
              f"`vtcampaign conclude {name}` concludes it here")
    if args.no_commit:
        return 0
    subprocess.run(["git", "add", "records", "bench/results", "campaigns/gates/op_bounds.yaml"], cwd=ROOT, check=True)
    if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=ROOT).returncode == 0:
        print("nothing to commit")
        return 0
    names = campaigns + bench + left
    msg = args.message or commit_subject(names)
    body = "Committed as the call returned; figures follow.\n\n" + "\n".join(f"- {n}" for n in names)
    subprocess.run(["git", "commit", "-q", "-m", msg, "-m", body], cwd=ROOT, check=True)
    return 0


def concludable(names: list[str], root: Path = ROOT) -> list[str]:
    """The campaigns of ``names`` that stopped with nothing left to measure, only their conclusion."""
    from campaigns.evidence import load_evidence
    from campaigns.runner import left_to_measure
    out = []
    for name in names:
        ev = load_evidence(root / "records" / "campaigns" / name)
        if ev.status != "complete" and not left_to_measure(ev):
            out.append(name)
    return out


def commit_subject(names: list[str], limit: int = 72) -> str:
    """'Device results: a, b' within ``limit`` characters (git tools cut longer subjects); the names that do not fit
    are counted ('and 2 more') and listed in the body."""
    for shown in range(len(names), 0, -1):
        rest = len(names) - shown
        subject = "Device results: " + ", ".join(names[:shown]) + (f" and {rest} more" if rest else "")
        if len(subject) <= limit:
            return subject
    return f"Device results: {len(names)} file{'' if len(names) == 1 else 's'}"


if __name__ == "__main__":
    sys.exit(main())
