"""The git side of a campaign on a real temporary repository: the tree's state, and the flip commit on
row/<lever>-flip (only the default line changes, the records ride along, the message is the PR text, and the
user's checkout is left exactly as it was)."""
from __future__ import annotations

from pathlib import Path

import git
import pytest

from campaigns.gitops import GitOpsError, flip_commit, repo_state
from helpers import copy_plain_levers
from vtengine.levers import LEVER_DIR

PR_TEXT = "row/gqa_swap: default off → on — total tok/s ×1.099 at c1 (WIN)\n\n## Correctness\n\n- op: PASS\n"


@pytest.fixture
def repo(tmp_path) -> git.Repo:
    r = git.Repo.init(tmp_path, initial_branch="main")
    with r.config_writer() as cw:
        cw.set_value("user", "name", "Test")
        cw.set_value("user", "email", "test@example.com")
    copy_plain_levers(tmp_path / "conf" / "lever")
    (tmp_path / "README.md").write_text("project\n")
    r.index.add(["README.md"] + [f"conf/lever/{p.name}" for p in sorted(LEVER_DIR.glob("*.yaml"))])
    r.index.commit("base")
    return r


def _records(root: Path) -> list[Path]:
    cdir = root / "records" / "campaigns" / "2026-11-30-gqa_swap-abc1234"
    cdir.mkdir(parents=True)
    files = []
    for name, text in (("evidence.json", '{"x": 1}\n'), ("record.md", "## row/gqa_swap\n"), ("pr.md", PR_TEXT)):
        (cdir / name).write_text(text)
        files.append(cdir / name)
    (root / "records" / "STATUS.md").write_text("# Lever status\n")
    return files + [root / "records" / "STATUS.md"]


def test_repo_state_sees_sha_branch_and_dirt(repo):
    root = Path(repo.working_tree_dir)
    st = repo_state(root)
    assert st.sha == repo.head.commit.hexsha and st.short_sha == st.sha[:7] and st.branch == "main" and not st.dirty
    (root / "README.md").write_text("changed\n")
    (root / "records").mkdir()
    (root / "records" / "new.md").write_text("x\n")
    st = repo_state(root)
    assert st.dirty and st.dirty_files == ["README.md", "records/new.md"]
    assert repo_state(root, ignore=("records",)).dirty_files == ["README.md"]
    (root / "mlflow.db").write_text("x\n")          # an ignored path may be a file, not only a folder
    (root / "records.md").write_text("x\n")         # ... and a prefix of a name is not the path
    assert repo_state(root, ignore=("records", "mlflow.db")).dirty_files == ["README.md", "records.md"]
    with pytest.raises(GitOpsError, match="not inside a git repository"):
        repo_state(root.parent / "elsewhere-not-a-repo")


def test_flip_commit_changes_only_the_default_line(repo):
    root = Path(repo.working_tree_dir)
    files = _records(root)
    base = repo.head.commit.hexsha
    lever_before = (root / "conf/lever/gqa_swap.yaml").read_text()
    current = "default: true" in lever_before.splitlines()      # the flip goes the other way, whatever main holds

    out = flip_commit(root, "gqa_swap", not current, files, PR_TEXT)

    assert out["branch"] == "row/gqa_swap-flip" and out["base"] == base and out["previous"] == ""
    commit = repo.commit(out["commit"])
    assert repo.heads["row/gqa_swap-flip"].commit == commit
    subject = f"Flip gqa_swap default to {'off' if current else 'on'}"
    assert commit.message == f"{subject}\n\n{PR_TEXT}" and [p.hexsha for p in commit.parents] == [base]
    changed = sorted(d.b_path for d in repo.commit(base).diff(commit))
    assert changed == ["conf/lever/gqa_swap.yaml", "records/STATUS.md",
                       "records/campaigns/2026-11-30-gqa_swap-abc1234/evidence.json",
                       "records/campaigns/2026-11-30-gqa_swap-abc1234/pr.md",
                       "records/campaigns/2026-11-30-gqa_swap-abc1234/record.md"]
    diff = repo.git.diff(base, commit.hexsha, "--unified=0", "--", "conf/lever/gqa_swap.yaml")
    body = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    old, new = ("true", "false") if current else ("false", "true")
    assert body == [f"-default: {old}", f"+default: {new}"]
    # The user's checkout is untouched: same branch and HEAD, lever file unchanged, records still on disk.
    assert repo.active_branch.name == "main" and repo.head.commit.hexsha == base
    assert (root / "conf/lever/gqa_swap.yaml").read_text() == lever_before
    assert all(f.is_file() for f in files) and not repo.index.diff(None)


def test_a_flip_of_one_quantization_adds_its_own_default_line(repo):
    """pdl_stack wins on bf16 and loses on MXFP4 (H200, 2026-12-04): its flip sets the bf16 default alone, one new
    line after ``default:``, and the subject says which quantization."""
    root = Path(repo.working_tree_dir)
    base = repo.head.commit.hexsha
    out = flip_commit(root, "pdl_stack", True, _records(root), PR_TEXT, campaign_id="2026-12-04-pdl_stack-abc1234",
                      quant="bf16")
    commit = repo.commit(out["commit"])
    assert commit.message.splitlines()[0] == "Flip pdl_stack default on bf16 to on (2026-12-04-pdl_stack-abc1234)"
    diff = repo.git.diff(base, commit.hexsha, "--unified=0", "--", "conf/lever/pdl_stack.yaml")
    body = [ln for ln in diff.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert body == ["+default_by_quant: {bf16: true}"]
    assert "default_by_quant" not in (root / "conf/lever/pdl_stack.yaml").read_text()     # the checkout untouched
    # its own branch: a flip of another quantization's default, or of the lever's, does not re-point it
    assert out["branch"] == "row/pdl_stack-bf16-flip"
    other = flip_commit(root, "pdl_stack", True, _records_again(root), PR_TEXT, quant="nvfp4")
    assert other["branch"] == "row/pdl_stack-nvfp4-flip" and other["previous"] == ""
    assert repo.heads["row/pdl_stack-bf16-flip"].commit.hexsha == out["commit"]


def test_flip_subjects_stay_within_72_characters():
    from campaigns.gitops import flip_subject
    assert flip_subject("gqa_swap", True, "2026-12-01-gqa_swap-5bdf31a") == \
        "Flip gqa_swap default to on (2026-12-01-gqa_swap-5bdf31a)"
    long = flip_subject("async_device_mirror", True, "2026-12-01-async_device_mirror-d14227b")
    assert long == "Flip async_device_mirror default to on"           # the id would pass 72: left to the body
    assert len(flip_subject("x" * 100, "auto", "id")) == 72


def test_flip_commit_updates_the_branch_to_one_commit_on_the_new_base(repo):
    root = Path(repo.working_tree_dir)
    files = _records(root)
    first = flip_commit(root, "nsplits_cap", "auto", files, "row/nsplits_cap: default off → auto — x\n")
    (root / "README.md").write_text("moved on\n")
    repo.index.add(["README.md"])
    new_base = repo.index.commit("later work").hexsha
    second = flip_commit(root, "nsplits_cap", "auto", files, "row/nsplits_cap: default off → auto — y\n")
    assert second["previous"] == first["commit"] and second["base"] == new_base
    tip = repo.heads["row/nsplits_cap-flip"].commit
    assert tip.hexsha == second["commit"] and tip.parents[0].hexsha == new_base
    assert 'default: "auto"' in tip.tree["conf/lever/nsplits_cap.yaml"].data_stream.read().decode()


def test_flip_commit_refuses_bad_inputs(repo, tmp_path_factory):
    root = Path(repo.working_tree_dir)
    outside = tmp_path_factory.mktemp("outside") / "x.md"
    outside.write_text("x\n")
    with pytest.raises(GitOpsError, match="outside the repository"):
        flip_commit(root, "gqa_swap", True, [outside], PR_TEXT)
    with pytest.raises(GitOpsError, match=r"lever file .*nope.yaml does not exist"):
        flip_commit(root, "nope", True, [], PR_TEXT)
    with pytest.raises(GitOpsError, match="record file .* does not exist"):
        flip_commit(root, "gqa_swap", True, [root / "records" / "missing.md"], PR_TEXT)
    assert "row/gqa_swap-flip" not in repo.heads


def test_flip_commit_takes_the_summaries_as_they_read_once_merged(repo, tmp_path):
    """``rendered`` gets a lever directory holding the new default and returns files to commit in place of their
    working-tree copies (STATUS as it reads after the merge); the working tree keeps its own."""
    root = Path(repo.working_tree_dir)
    files = _records(root)
    current = "default: true" in (root / "conf/lever/gqa_swap.yaml").read_text().splitlines()
    seen = []

    def rendered(lever_dir: Path) -> dict[Path, str]:
        seen.append((lever_dir / "gqa_swap.yaml").read_text())
        return {root / "records" / "STATUS.md": "# Lever status\n| gqa_swap | after the flip |\n"}

    out = flip_commit(root, "gqa_swap", not current, files, PR_TEXT, rendered=rendered)
    assert len(seen) == 1 and f"default: {str(not current).lower()}" in seen[0].splitlines()
    committed = repo.commit(out["commit"]).tree["records/STATUS.md"].data_stream.read().decode()
    assert committed == "# Lever status\n| gqa_swap | after the flip |\n"
    assert (root / "records" / "STATUS.md").read_text() == "# Lever status\n"


def test_after_clear_for_merge_the_flip_branch_merges_into_the_working_tree(repo):
    """A run with commit=true leaves its records in the working tree (a new campaign directory, STATUS rendered
    with the old default) and the same records on the flip branch; git refuses to merge over untracked or modified
    copies even with the commit's bytes. clear_for_merge puts those run outputs back as HEAD has them, the merge
    then goes through and brings the records and the new default; a changed evidence file and a file outside the
    run outputs are the user's and stay."""
    from campaigns.gitops import clear_for_merge
    root = Path(repo.working_tree_dir)
    (root / "records").mkdir()
    (root / "records" / "STATUS.md").write_text("# Lever status (before)\n")
    repo.index.add(["records/STATUS.md"])
    repo.index.commit("records")
    files = _records(root)
    current = "default: true" in (root / "conf/lever/gqa_swap.yaml").read_text().splitlines()
    flipped = "# Lever status\n| gqa_swap | after the flip |\n"
    out = flip_commit(root, "gqa_swap", not current, files, PR_TEXT,
                      rendered=lambda d: {root / "records" / "STATUS.md": flipped})
    with pytest.raises(git.GitCommandError):
        repo.git.merge("--no-ff", "--no-edit", out["branch"])
    cleared = clear_for_merge(root, out["commit"])
    assert sorted(cleared) == sorted(str(f.relative_to(root)) for f in files)
    assert (root / "records" / "STATUS.md").read_text() == "# Lever status (before)\n"
    assert not (root / "records" / "campaigns").exists() or not any((root / "records" / "campaigns").rglob("*.*"))
    repo.git.merge("--no-ff", "--no-edit", out["branch"])
    assert (root / "records" / "STATUS.md").read_text() == flipped
    assert (files[0]).read_text() == '{"x": 1}\n'
    assert f"default: {str(not current).lower()}" in (root / "conf/lever/gqa_swap.yaml").read_text().splitlines()
    # an evidence file the user changed since the flip was committed is not theirs to lose: it stays
    files = [f for f in _records_again(root)]
    out = flip_commit(root, "gqa_swap", current, files, PR_TEXT)
    files[0].write_text('{"x": 2}\n')
    assert "records/campaigns/2026-12-01-gqa_swap-def5678/evidence.json" not in clear_for_merge(root, out["commit"])
    assert files[0].read_text() == '{"x": 2}\n'


def _records_again(root: Path) -> list[Path]:
    cdir = root / "records" / "campaigns" / "2026-12-01-gqa_swap-def5678"
    cdir.mkdir(parents=True)
    (cdir / "evidence.json").write_text('{"x": 1}\n')
    (cdir / "record.md").write_text("## row/gqa_swap again\n")
    return [cdir / "evidence.json", cdir / "record.md"]


def _flip_records(root: Path, lever: str) -> list[Path]:
    cdir = root / "records" / "campaigns" / f"2026-12-05-{lever}-abc1234"
    cdir.mkdir(parents=True)
    (cdir / "evidence.json").write_text(f'{{"lever": "{lever}"}}\n')
    (cdir / "record.md").write_text(f"## row/{lever}\n")
    return [cdir / "evidence.json", cdir / "record.md"]


def _status(lever_dir: Path) -> str:
    """A stand-in for STATUS.md: one row per lever with its default in ``lever_dir``."""
    from vtengine.levers import registry
    reg = registry(lever_dir)
    return "# Lever status\n" + "".join(f"| {n} | {reg[n].default} |\n" for n in ("gqa_swap", "pdl", "fast_math"))


def test_merge_flip_renders_the_summaries_two_flips_of_one_base_conflict_on(repo):
    """Two flips made from one base each carry STATUS.md as it reads after their own flip: plain git merges the
    first and conflicts on the second. merge_flip merges both, the second's STATUS rendered from the merged lever
    files (both new defaults), each as a merge commit; a conflict outside the rendered files, or an error in the
    rendering, aborts the merge and changes nothing."""
    from campaigns.gitops import GitOpsError, clear_for_merge, merge_flip
    from vtengine.levers import registry
    root = Path(repo.working_tree_dir)
    lever_dir = root / "conf" / "lever"
    status = root / "records" / "STATUS.md"
    status.parent.mkdir()
    status.write_text(_status(lever_dir))
    repo.index.add(["records/STATUS.md"])
    repo.index.commit("records")
    before = {n: registry(lever_dir)[n].default for n in ("gqa_swap", "pdl", "fast_math")}
    tips = {}
    for lever in ("gqa_swap", "pdl"):
        tips[lever] = flip_commit(root, lever, not before[lever], _flip_records(root, lever), PR_TEXT,
                                  rendered=lambda d: {status: _status(d)})
    calls = []

    def render(conflicted):
        calls.append(conflicted)
        status.write_text(_status(lever_dir))
        return [status]

    first = merge_flip(root, tips["gqa_swap"]["branch"], render)
    assert first["conflicted"] == [] and len(repo.head.commit.parents) == 2
    assert repo.head.commit.parents[1].hexsha == tips["gqa_swap"]["commit"]
    # plain git: the second flip's STATUS row sits next to the first's, so the merge conflicts there
    clear_for_merge(root, tips["pdl"]["commit"])
    with pytest.raises(git.GitCommandError):
        repo.git.merge("--no-ff", "--no-commit", tips["pdl"]["branch"])
    assert "records/STATUS.md" in repo.git.diff("--name-only", "--diff-filter=U")
    repo.git.merge("--abort")
    second = merge_flip(root, tips["pdl"]["branch"], render)
    assert second["conflicted"] == ["records/STATUS.md"] and calls[-1] == ["records/STATUS.md"]
    after = registry(lever_dir)
    assert after["gqa_swap"].default == (not before["gqa_swap"]) and after["pdl"].default == (not before["pdl"])
    assert status.read_text() == _status(lever_dir)
    assert f"| pdl | {not before['pdl']} |" in status.read_text()
    assert f"| gqa_swap | {not before['gqa_swap']} |" in status.read_text()
    assert not repo.is_dirty() and not (Path(repo.git_dir) / "MERGE_HEAD").exists()
    assert "conflicts settled by that rendering: records/STATUS.md" in repo.head.commit.message
    with pytest.raises(GitOpsError, match="is already merged"):
        merge_flip(root, tips["pdl"]["branch"], render)
    with pytest.raises(GitOpsError, match=r"no branch 'row/nope-flip'; flip branches here: \['row/gqa_swap-flip', "):
        merge_flip(root, "row/nope-flip", render)
    # a conflict in a file no record renders (the lever file itself, edited on both sides) aborts the merge
    fm = flip_commit(root, "fast_math", not before["fast_math"], _flip_records(root, "fast_math"), PR_TEXT,
                     rendered=lambda d: {status: _status(d)})
    text = (lever_dir / "fast_math.yaml").read_text()
    (lever_dir / "fast_math.yaml").write_text(text.replace(f"default: {str(before['fast_math']).lower()}",
                                                           f"default: {str(before['fast_math']).lower()}  # kept"))
    repo.index.add(["conf/lever/fast_math.yaml"])
    head = repo.index.commit("pin fast_math").hexsha
    with pytest.raises(GitOpsError, match=r"conflicts in conf/lever/fast_math.yaml, which no record renders from "
                                          r"evidence; the merge was aborted and nothing changed"):
        merge_flip(root, fm["branch"], render)
    assert repo.head.commit.hexsha == head and not (Path(repo.git_dir) / "MERGE_HEAD").exists()
    assert not repo.is_dirty()
    # an error while rendering aborts it too
    repo.git.reset("--hard", "HEAD~1")

    def broken(conflicted):
        raise RuntimeError("render failed")
    head = repo.head.commit.hexsha
    with pytest.raises(RuntimeError, match="render failed"):
        merge_flip(root, fm["branch"], broken)
    assert repo.head.commit.hexsha == head and not (Path(repo.git_dir) / "MERGE_HEAD").exists()
