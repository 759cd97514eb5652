"""Git for campaigns (gitpython): the tree's state for the fingerprint, and the default-flip commit.

``flip_commit`` never touches the working tree, the index or the checked-out branch: it builds the commit with
git's plumbing (a temporary index seeded from HEAD, the new lever file and the records as blobs, ``commit-tree``)
and points ``row/<lever>-flip`` (``row/<lever>-<quant>-flip`` for one quantization's default) at it. The flip
reaches the default only when that branch is merged; re-running a campaign re-points the branch at a fresh
``HEAD + one commit``, so the branch always holds exactly the flip under review. ``clear_for_merge``, which the
flip paths call next, then puts the working copies of the records the commit carries back as HEAD has them, so the
merge can write them (git refuses to merge over untracked or modified copies, even with the same bytes).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import git


# What a campaign or a bench writes while it runs: a change under these is output, not dirt in the measured tree.
RUN_OUTPUTS = ("records", "bench/results", "mlflow.db", "mlruns", "mlartifacts", "multirun", "outputs")


def under(path: str, roots: Iterable[str]) -> bool:
    """Is ``path`` (repo-relative) one of ``roots`` or inside one."""
    return any(path == r.rstrip("/") or path.startswith(r.rstrip("/") + "/") for r in roots)


# What no measurement reads: the run outputs, the prose (*.md) and the record templates (templates/*.j2: they shape
# how evidence reads, never what a leg measures). Commits that change only these leave the code a campaign measures
# as it was (code_digest), so its grid may resume across them.
TEMPLATES = "templates"


def is_prose(path: str) -> bool:
    lower = path.lower()
    return lower.endswith(".md") or (under(path, (TEMPLATES,)) and lower.endswith(".j2"))


def code_digest(path: Path | str = ".", outputs: Iterable[str] = RUN_OUTPUTS, commit: str = "HEAD") -> str:
    """A digest of the code at ``commit`` (HEAD): sha256 over the (path, blob id) of every file in its tree but the
    run outputs and the prose. Equal digests at two commits mean the same bytes in every file a campaign runs
    (engine, campaigns, conf, scripts, tests), whatever records, results or notes were committed between them.
    Working-tree changes are not in it (the fingerprint's dirty_files are)."""
    repo = open_repo(path)
    try:
        tree = repo.commit(commit).tree
    except (ValueError, git.BadName):
        what = "has no commit yet" if commit == "HEAD" else f"has no commit {commit!r}"
        raise GitOpsError(f"repository {repo.working_tree_dir} {what}") from None
    outputs = tuple(outputs)
    h = hashlib.sha256()
    for item in sorted((b for b in tree.traverse() if b.type == "blob"), key=lambda b: b.path):
        if not under(item.path, outputs) and not is_prose(item.path):
            h.update(f"{item.path}\0{item.hexsha}\n".encode())
    return h.hexdigest()


def code_dirt(files: Iterable[str], outputs: Iterable[str] = RUN_OUTPUTS) -> list[str]:
    """The changed files that are not run outputs: what makes a measured tree dirty."""
    outputs = tuple(outputs)
    return [f for f in files if not under(f, outputs)]


class GitOpsError(RuntimeError):
    """Not a git repository, a file outside it, or a git command that failed; the message says which."""


@dataclass(frozen=True)
class RepoState:
    sha: str
    short_sha: str
    dirty: bool
    branch: str               # "HEAD" when detached
    dirty_files: list[str]
    dirty_digest: str | None = None   # contents_digest of dirty_files (None: a clean tree)


def project_root(cwd: Path | str | None = None) -> Path:
    """The top of the git work tree that holds ``cwd`` (as git finds it), else ``cwd``: a command run from a
    sub-folder reads and writes the project's records/ and mlflow.db, not ones of its own."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    try:
        return Path(git.Repo(cwd, search_parent_directories=True).working_tree_dir)
    except Exception:           # not in a repository: the folder itself
        return cwd


def open_repo(path: Path | str = ".") -> git.Repo:
    try:
        return git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise GitOpsError(f"{Path(path).resolve()} is not inside a git repository; campaigns record the git sha, "
                          "so run from a clone") from None


def repo_state(path: Path | str = ".", ignore: Iterable[str] = ()) -> RepoState:
    """sha, dirtiness (tracked changes and untracked files, minus paths under ``ignore``), branch."""
    repo = open_repo(path)
    try:
        sha = repo.head.commit.hexsha
    except ValueError:
        raise GitOpsError(f"repository {repo.working_tree_dir} has no commit yet") from None
    branch = "HEAD" if repo.head.is_detached else repo.active_branch.name
    changed = {d.a_path for d in repo.index.diff(None)} | {d.a_path for d in repo.index.diff("HEAD")}
    changed |= set(repo.untracked_files)
    dirty_files = sorted(code_dirt(changed, ignore))
    return RepoState(sha=sha, short_sha=sha[:7], dirty=bool(dirty_files), branch=branch, dirty_files=dirty_files,
                     dirty_digest=contents_digest(repo.working_tree_dir, dirty_files) if dirty_files else None)


def contents_digest(root: Path | str, files: Iterable[str]) -> str:
    """sha256 over the working-tree contents of ``files`` (repo-relative), in path order: a symbolic link as its
    target, a deleted file as its absence. Two trees dirty in the same files are the same tree only where this is
    equal (an edit to a file already dirty changes no file list)."""
    root = Path(root)
    h = hashlib.sha256()
    for rel in sorted(files):
        path = root / rel
        inner = hashlib.sha256()
        if path.is_symlink():
            inner.update(b"<link>" + os.readlink(path).encode())
        elif path.is_file():
            with open(path, "rb") as f:         # in chunks: an untracked file may be large
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    inner.update(chunk)
        else:
            inner.update(b"<missing>")
        h.update(rel.encode() + b"\0" + inner.digest())
    return h.hexdigest()


RENDERED = ("record.md", "pr.md", "grid.png", "STATUS.md", "BENCHMARKS.md")     # derived from evidence files


def clear_for_merge(repo_path: Path | str, commit: str) -> list[str]:
    """Make ``git merge <commit>`` (a flip commit on top of HEAD) go through: every run output the commit adds or
    changes is put back as HEAD has it (removed where HEAD has none) when the working copy is the commit's own or
    is rendered from evidence (records, summaries, plots: ``vtcampaign render`` rebuilds them); git refuses to
    merge over untracked or modified copies even when their bytes are the commit's. An evidence file whose bytes
    differ from the commit's, and anything outside the run outputs, is left as it is (the merge then says so).
    Returns the paths put back."""
    repo = open_repo(repo_path)
    root = Path(repo.working_tree_dir)
    head = repo.head.commit
    cleared = []
    for rel in repo.git.diff("--name-only", head.hexsha, commit).splitlines():
        path = root / rel
        if not under(rel, RUN_OUTPUTS) or not path.is_file():
            continue
        try:
            theirs = (repo.commit(commit).tree / rel).data_stream.read()
        except KeyError:            # removed by the commit: not a flip's doing; the user's to settle
            continue
        if path.read_bytes() != theirs and Path(rel).name not in RENDERED:
            continue
        try:
            head.tree / rel
        except KeyError:
            path.unlink()
        else:
            repo.git.checkout(head.hexsha, "--", rel)
        cleared.append(rel)
    return cleared


def _branch_tip(repo: git.Repo, branch: str) -> git.Commit:
    if branch not in repo.heads:
        raise GitOpsError(f"no branch {branch!r}; flip branches here: "
                          f"{sorted(h.name for h in repo.heads if h.name.startswith('row/')) or 'none'}")
    return repo.heads[branch].commit


CAMPAIGN_TRAILER = "Campaign-Id"     # the flip commit's trailer naming the campaign whose FLIP it carries


def trailer_ids(message: str) -> list[str]:
    """The campaign ids a commit message's trailers name (``Campaign-Id: <id>`` lines of its last paragraph)."""
    last = message.strip().split("\n\n")[-1]
    return [line.split(":", 1)[1].strip() for line in last.splitlines() if line.startswith(f"{CAMPAIGN_TRAILER}:")]


def branch_evidence(repo_path: Path | str, branch: str) -> list[tuple[str, bytes]]:
    """The evidence files (path, bytes) of the campaign whose FLIP a flip branch carries: those it adds or changes
    since it left HEAD's history, or, when its evidence was committed before the flip (a device run's results taken
    in first), the evidence the newest of its commits with a ``Campaign-Id:`` trailer names, as HEAD holds it: the
    branch leaves that file alone, so HEAD's copy is the one in force after the merge (re-decided since the flip,
    say), and the tip's where HEAD has none."""
    repo = open_repo(repo_path)
    tip = _branch_tip(repo, branch)
    base = repo.git.merge_base("HEAD", tip.hexsha)
    found = [(rel, (tip.tree / rel).data_stream.read())
             for rel in repo.git.diff("--name-only", "--diff-filter=AM", base, tip.hexsha).splitlines()
             if under(rel, RUN_OUTPUTS) and Path(rel).name == "evidence.json"]
    if found:
        return found
    ids = next((trailer_ids(c.message) for c in repo.iter_commits(f"{base}..{tip.hexsha}") if trailer_ids(c.message)),
               [])
    if not ids:
        return []
    head = repo.head.commit
    names = repo.git.ls_tree("-r", "--name-only", tip.hexsha, "--", *RUN_OUTPUTS).splitlines()
    found = []
    for rel in names:
        if Path(rel).name == "evidence.json" and Path(rel).parent.name in ids:
            try:
                found.append((rel, (head.tree / rel).data_stream.read()))
            except KeyError:
                found.append((rel, (tip.tree / rel).data_stream.read()))
    return found


def merge_flip(repo_path: Path | str, branch: str, render: Callable[[list[str]], Iterable[Path | str]]) -> dict:
    """Merge a flip branch into the checked-out branch (``git merge --no-ff``) with its records' summaries rendered
    again from the merged evidence and lever files.

    Two flips made from one base both carry records/STATUS.md (and BENCHMARKS.md) as it reads after their own flip,
    so the second merge conflicts in them; and even a merge git settles line by line can leave rows that no longer
    hold (a verdict the first flip made stale). So: the working copies of the branch's run outputs are put back as
    HEAD has them (clear_for_merge), git merges without committing, a conflict in a file rendered from evidence
    takes HEAD's side for the moment, ``render(conflicted paths)`` writes the records from the merged tree and returns
    the paths it wrote, the tracked ones among them are staged, and the merge is committed. A conflict anywhere else
    aborts the merge and raises, naming the files (nothing changed); so does an error in ``render``.
    Returns {branch, commit, conflicted, rendered}."""
    repo = open_repo(repo_path)
    root = Path(repo.working_tree_dir)
    tip = _branch_tip(repo, branch).hexsha
    if (Path(repo.git_dir) / "MERGE_HEAD").exists():
        raise GitOpsError("a merge is in progress in this checkout; finish it (git commit) or abort it (git merge "
                          "--abort) first")
    if repo.is_ancestor(tip, "HEAD"):
        raise GitOpsError(f"{branch} ({tip[:7]}) is already merged into {repo.head.commit.hexsha[:7]}")
    clear_for_merge(root, tip)
    conflicted: list[str] = []
    try:
        repo.git.merge("--no-ff", "--no-commit", branch, env=_identity(repo))
    except git.GitCommandError as e:
        conflicted = sorted(set(repo.git.diff("--name-only", "--diff-filter=U").splitlines()))
        if not conflicted:          # refused before it began (local changes in its way): git says what
            raise GitOpsError(f"git merge {branch} refused: {(e.stderr or str(e)).strip()}") from None
        others = [p for p in conflicted if not under(p, RUN_OUTPUTS) or Path(p).name not in RENDERED]
        if others:
            repo.git.merge("--abort")
            raise GitOpsError(f"merging {branch} conflicts in {', '.join(others)}, which no record renders from "
                              f"evidence; the merge was aborted and nothing changed. Merge by hand (git merge --no-ff "
                              f"{branch}), settle them, then `vtcampaign render` and commit") from None
        for rel in conflicted:
            repo.git.checkout("--ours", "--", rel)
    try:
        written = list(render(conflicted))
        tracked = set(repo.git.ls_files().splitlines())
        staged = sorted({_rel(_in(Path(p), root), root) for p in written} & tracked | set(conflicted))
        if staged:
            repo.git.add("--", *staged)
        head_msg = (Path(repo.git_dir) / "MERGE_MSG").read_text(encoding="utf-8")
        subject = next((ln for ln in head_msg.splitlines() if ln.strip() and not ln.startswith("#")),
                       f"Merge branch '{branch}'")
        body = ("Summaries rendered again from the merged evidence and lever files (vtcampaign merge)"
                + (f"; conflicts settled by that rendering: {', '.join(conflicted)}" if conflicted else "") + ".")
        repo.git.commit("-m", subject, "-m", body, env=_identity(repo))
    except BaseException:
        if (Path(repo.git_dir) / "MERGE_HEAD").exists():
            repo.git.merge("--abort")
        raise
    return {"branch": branch, "commit": repo.head.commit.hexsha, "conflicted": conflicted, "rendered": staged}


def flip_branch(lever: str, quant: str | None = None) -> str:
    """The branch of a flip: one per lever, and one per quantization for a flip of that quantization's default
    alone, so that two such flips of one lever (bf16 and NVFP4, say) do not re-point one branch."""
    return f"row/{lever}-{quant}-flip" if quant else f"row/{lever}-flip"


SUBJECT_MAX = 72


def flip_subject(lever: str, new_default: Any, campaign_id: str = "", quant: str | None = None) -> str:
    """A commit subject of at most SUBJECT_MAX characters: "Flip <lever> default to <value>" ("default on <quant>"
    for a flip of one quantization's default), with the campaign id in parentheses when it fits."""
    value = {True: "on", False: "off"}.get(new_default, str(new_default)) if isinstance(new_default, bool) \
        else str(new_default)
    subject = f"Flip {lever} default{f' on {quant}' if quant else ''} to {value}"
    with_id = f"{subject} ({campaign_id})"
    return with_id if campaign_id and len(with_id) <= SUBJECT_MAX else subject[:SUBJECT_MAX]


def flip_commit(repo_path: Path | str, lever: str, new_default: Any, files: Iterable[Path | str], message: str,
                lever_dir: Path | str = "conf/lever", campaign_id: str = "",
                rendered: Callable[[Path], Mapping[Path, str]] | None = None,
                quant: str | None = None) -> dict[str, str]:
    """Commit the lever's new ``default:`` line plus ``files`` (records) on branch ``row/<lever>-flip``. With
    ``quant``, the new default is that quantization's alone (its entry of ``default_by_quant:``).

    ``rendered``: called with a copy of the lever directory that holds the new default, it returns files (path ->
    text) to commit instead of their working-tree copies: the summaries as they read once the branch is merged.

    ``lever_dir`` is the lever directory inside the repository (relative to its root, or absolute). The commit's
    parent is the current HEAD; its subject is ``flip_subject`` (at most 72 characters, as git tools expect), its
    body the PR text, and with ``campaign_id`` a ``Campaign-Id:`` trailer (what ``branch_evidence`` reads when the
    evidence was committed before the flip). Returns {branch, commit, base, previous} (previous: the branch's old
    tip, '' if it is new). The working tree, index and current branch are left untouched.
    """
    from vtengine.levers import set_default_in_file

    repo = open_repo(repo_path)
    root = Path(repo.working_tree_dir).resolve()
    lever_dir = Path(lever_dir)
    lever_dir = (lever_dir if lever_dir.is_absolute() else root / lever_dir).resolve()
    lever_file = lever_dir / f"{lever}.yaml"
    if not lever_file.is_file():
        raise GitOpsError(f"lever file {lever_file} does not exist; levers: "
                          f"{sorted(p.stem for p in lever_dir.glob('*.yaml'))}")
    if not lever_file.resolve().is_relative_to(root):
        raise GitOpsError(f"lever file {lever_file} is not in the repository {root}: it is a read-only default (an "
                          f"installed package's conf/?); copy it into your project's conf/lever/ (or name a conf "
                          f"directory with --conf-dir) and flip it there")
    base = repo.head.commit.hexsha
    branch = flip_branch(lever, quant)

    # The new lever file: edit a copy of the lever directory, never the working tree.
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "lever"
        shutil.copytree(lever_dir, copy)
        set_default_in_file(lever, new_default, lever_dir=copy, quant=quant)
        new_lever_text = (copy / f"{lever}.yaml").read_bytes()
        merged = {_rel(_in(Path(p), root), root): text.encode()
                  for p, text in (rendered(copy) if rendered else {}).items()}

    blobs: dict[str, bytes] = {_rel(lever_file, root): new_lever_text}
    for f in files:
        p = _in(Path(f), root)
        if not p.is_file():
            raise GitOpsError(f"record file {p} does not exist")
        blobs[_rel(p, root)] = p.read_bytes()
    blobs.update(merged)

    fd, index_path = tempfile.mkstemp(prefix="vtcampaign-index-")
    os.close(fd)
    env = {"GIT_INDEX_FILE": index_path}
    env.update(_identity(repo))
    try:
        repo.git.read_tree(base, env=env)
        for rel, data in sorted(blobs.items()):
            with tempfile.NamedTemporaryFile(delete=False) as tf:
                tf.write(data)
            try:
                blob = repo.git.hash_object("-w", "--path", rel, tf.name)
            finally:
                os.unlink(tf.name)
            repo.git.update_index("--add", "--cacheinfo", f"100644,{blob},{rel}", env=env)
        tree = repo.git.write_tree(env=env)
        with tempfile.NamedTemporaryFile("w", delete=False, encoding="utf-8") as mf:
            body = message if message.endswith("\n") else message + "\n"
            trailer = f"\n{CAMPAIGN_TRAILER}: {campaign_id}\n" if campaign_id else ""
            mf.write(f"{flip_subject(lever, new_default, campaign_id, quant)}\n\n{body}{trailer}")
        try:
            commit = repo.git.commit_tree(tree, "-p", base, "-F", mf.name, env=env)
        finally:
            os.unlink(mf.name)
        previous = repo.heads[branch].commit.hexsha if branch in repo.heads else ""
        repo.git.update_ref(f"refs/heads/{branch}", commit, "-m", f"vtcampaign: flip {lever} -> {new_default}")
    except git.GitCommandError as e:
        raise GitOpsError(f"git failed while committing the {lever} flip: {e.stderr.strip() or e}") from None
    finally:
        os.unlink(index_path)
    return {"branch": branch, "commit": commit, "base": base, "previous": previous}


def _in(path: Path, root: Path) -> Path:
    return (path if path.is_absolute() else root / path).resolve()


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root).as_posix()
    except ValueError:
        raise GitOpsError(f"{path} is outside the repository {root}; only files inside it can be committed") from None


def _identity(repo: git.Repo) -> dict[str, str]:
    """Author/committer from git config; a neutral 'vtcampaign' identity only where none is configured."""
    reader = repo.config_reader()
    name = reader.get_value("user", "name", default="") or os.environ.get("GIT_AUTHOR_NAME", "")
    email = reader.get_value("user", "email", default="") or os.environ.get("GIT_AUTHOR_EMAIL", "")
    env = {}
    if not name:
        env["GIT_AUTHOR_NAME"] = env["GIT_COMMITTER_NAME"] = "vtcampaign"
    if not email:
        env["GIT_AUTHOR_EMAIL"] = env["GIT_COMMITTER_EMAIL"] = "vtcampaign@localhost"
    return env
