"""Lever context and staleness: a verdict holds in the context it was measured in.

A campaign's context is every lever's resolved value in each arm, which levers were live there (their kernels ran:
the servers' kernel counters say which; ``marlin_dense`` is inert on a bf16 model), and a digest of each lever's
source files (``paths:`` in its lever file). A verdict is STALE, with the reason, when

- another lever that was live in its context has a default now that differs from its value there (the engine the
  verdict measured is not the engine users run any more), or
- the lever's own source files changed since the campaign (the code the verdict measured is gone; a change to
  comments, docstrings or formatting alone is not one: Python sources are compared as parsed, and in a file the
  lever file lists by its definitions, only the code they reach: campaigns/sources.py), or
- a lever added since the campaign defaults to on (a lever added at its off default is the engine as it was), or
- the campaign ran on code before an engine epoch: a commit declared in conf/epochs.yaml as moving the whole
  engine's performance (a fix outside every lever's own files, e.g. the per-launch lever lookup that cost every
  eager step ~0.2 s). Lever files and sources cannot see such a change; its author declares it, with the reason.

Evidence written before context was recorded (schema 1) gets its context from the lever files at its commit
(git): every lever at that commit's default, except the campaign's own; liveness from its mechanism gate's kernel
counters where they can tell, else live; digests from the files at that commit. Where nothing can be told (the
commit is not in this repository), the answer is STALE: the safe one.
"""
from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import git
import yaml

from campaigns import sources
from campaigns.evidence import Evidence
from campaigns.sources import normalized  # noqa: F401  (how sources compare: tests use it)
from vtengine.levers import PATH_SEP, apply_presets, split_entry

# the kernels schema-1 evidence's mechanism gate kept counters for: a lever whose kernels are all among these and
# absent from the counters did not run; any other kernel is unknown (counted live)
V1_COUNTED_KERNELS = ("decode_attention", "w4a16_gemm", "prefill_attention", "rms_norm")
# the kernels whose launch counters the mechanism gate keeps in its details (gates/mechanism.py): another kernel's
# launches are not in the evidence, so nothing there says it did not run
MECHANISM_KERNELS = ("decode_attention", "decode_splits", "w4a16_gemm", "prefill_attention", "prefill_attention_merge",
                     "rms_norm", "dense_linear")


@dataclass
class Context:
    values: dict[str, dict[str, Any]]           # arm -> lever -> value
    live: dict[str, list[str]]                  # arm -> levers whose kernels ran
    digests: dict[str, str]                     # lever -> digest of its source files ("" = unknown)
    source: str                                 # "recorded" | "git <sha7>" | what could not be told
    notes: list[str] = field(default_factory=list)


@dataclass
class Freshness:
    fresh: bool
    reasons: list[str]
    causes: list[str] = field(default_factory=list)     # the reasons in a few words each (a table cell's worth)

    @property
    def label(self) -> str:
        return "FRESH" if self.fresh else "STALE"

    def short(self) -> str:
        """'STALE (defaults: a, b; new: c; own sources; epoch 5ae2d6a)': which kinds of change, not their story."""
        if self.fresh:
            return self.label
        defaults = [c.removeprefix("default ") for c in self.causes if c.startswith("default ")]
        added = [c.removeprefix("new ") for c in self.causes if c.startswith("new ")]
        rest = [c for c in self.causes if not c.startswith(("default ", "new "))]
        parts = ([f"defaults: {', '.join(defaults)}"] if defaults else []) + (
            [f"new: {', '.join(added)}"] if added else []) + rest
        return f"STALE ({'; '.join(parts)})" if parts else self.label

    def describe(self) -> str:
        return self.label + (": " + "; ".join(self.reasons) if self.reasons else "")


def digest(files: dict[str, bytes | None]) -> str:
    """sha256 over (path, content) pairs in path order; a missing file counts as its absence."""
    h = hashlib.sha256()
    for path in sorted(files):
        data = files[path]
        h.update(path.encode() + b"\0" + (b"<missing>" if data is None else data) + b"\0")
    return h.hexdigest()


def changed_sources(repo_root: Path | str, sha: str, entries: list[str]) -> list[str] | None:
    """The ``paths:`` entries whose code differs in the working tree from commit ``sha`` (as ``sources.counted``
    compares it: parsed, and in a file listed by its definitions only what they reach); None where the commit is not
    in the repository (nothing can be compared)."""
    from campaigns.gitops import GitOpsError, open_repo
    root = Path(repo_root)
    try:
        repo = open_repo(root)
    except GitOpsError:
        return None
    if not _commit_known(repo, sha):
        return None
    return sources.changed(entries, lambda p: _git_file(repo, sha, p), _as_stored(repo, root))


def sources_diff(repo_root: Path | str, sha: str, entries: list[str]) -> str:
    """``sources.diff`` of the entries' counted code between commit ``sha`` and the working tree ("" where the
    commit is unknown: see ``changed_sources``)."""
    from campaigns.gitops import open_repo
    root = Path(repo_root)
    repo = open_repo(root)
    if not _commit_known(repo, sha):
        return ""
    return sources.diff(entries, lambda p: _git_file(repo, sha, p), _as_stored(repo, root), sha[:7],
                        "working tree")


def _tree_file(root: Path, path: str) -> bytes | None:
    return (root / path).read_bytes() if (root / path).is_file() else None


def _as_stored(repo, root: Path):
    """A reader of working-tree files to compare with a commit's (``_git_file``, which follows a link to the file it
    names, as this reads through one): a file whose bytes git's filters change (CRLF turned LF by core.autocrlf or a
    .gitattributes eol) reads as HEAD has it where HEAD has it and git finds it unmodified (else a CRLF checkout of
    a .cu file read as changed at every commit)."""
    def read(path: str) -> bytes | None:
        data = _tree_file(root, path)
        if data is not None and b"\r" in data:
            head = _git_file(repo, "HEAD", path)
            if head is not None and _unmodified(repo, path):
                return head
        return data
    return read


def _unmodified(repo, path: str) -> bool:
    """Whether git finds the working-tree ``path`` as HEAD has it (after its filters)."""
    status, _, _ = repo.git.execute(["git", "diff", "--quiet", "HEAD", "--", path], with_exceptions=False,
                                    with_extended_output=True)
    return status == 0


# Source files whose code runs for these weight quantizations alone: the W4A16 kernels run on quantized weights
# only (tests/test_context.py runs a bf16 engine and checks no code of theirs runs, and that no other module
# imports them but the backend that routes quantized weights there). A verdict measured on another quantization
# does not go STALE when they change: a W4A16 tile change used to stale the bf16 verdicts of every lever that
# lists w4a16.py for its W4A16 form (fuse_silu, fuse_norm, pdl, pdl_prefetch, pdl_stack).
QUANT_SOURCES = {"vtengine/kernels/w4a16.py": ("mxfp4", "nvfp4")}


def live_paths(lever, quant: str | None) -> list[str]:
    """The lever's source files whose code can run on ``quant`` (all of them where the quantization is unknown)."""
    return [p for p in lever.paths
            if quant is None or quant in QUANT_SOURCES.get(split_entry(p)[0], (quant,))]


def missing_sources(lever, root: Path | str) -> list[str]:
    """The ``paths:`` entries of a lever file that are no file under ``root``, or name a definition the file does not
    hold: a typo there would hash as an absent file (or compare the whole file) for ever, and the lever's verdicts
    could never go STALE from their own sources (or for every change to the file)."""
    root = Path(root)
    out = []
    for f, symbols in sources.by_file(lever.paths).items():
        if not (root / f).is_file():
            out += [p for p in lever.paths if split_entry(p)[0] == f]
        elif symbols:
            out += [f"{f}{PATH_SEP}{s}" for s in sources.undefined(_tree_file(root, f), symbols)]
    return out


def tree_digests(levers: dict, root: Path | str) -> dict[str, str]:
    """Each lever's source digest from the working tree under ``root``: over its files' bytes (a quick test; where it
    differs from the campaign's, ``changed_sources`` says whether the code that counts changed)."""
    root = Path(root)
    return {name: digest({p: _tree_file(root, p) for p in sources.files_of(lever.paths)})
            for name, lever in sorted(levers.items())}


def _git_file(repo, sha: str, path: str, hops: int = 8) -> bytes | None:
    """The file's bytes at commit ``sha`` (exactly: no newline stripped), or None where it did not exist. A symbolic
    link reads as the file it names in that commit (as a checkout reads through it: comparing the link's own blob,
    its target's path, with the working tree's contents read every linked source as changed, and comparing the two
    paths alone missed an edit of the target); one that leaves the repository reads as its own blob."""
    try:
        blob = repo.commit(sha).tree[path]
    except KeyError:
        return None
    data = blob.data_stream.read()
    if blob.mode == SYMLINK_MODE and hops > 0:
        target = posixpath.normpath(posixpath.join(posixpath.dirname(path), data.decode(errors="replace")))
        if not (target.startswith("../") or target == ".." or posixpath.isabs(target)):
            return _git_file(repo, sha, target, hops - 1)
    return data


SYMLINK_MODE = 0o120000


def _commit_known(repo, sha: str) -> bool:
    import git
    try:
        repo.git.cat_file("-e", f"{sha}^{{commit}}")     # repo.commit() takes any 40-hex string on trust
        return True
    except (git.BadName, ValueError, git.GitCommandError):
        return False


SAME_CODE_SEARCH = 150         # landed commits, nearest in time to the campaign's start, searched for its code
                               # (about +-12 h at this project's pace; ~17 ms a commit, once a process)


def campaign_commit(ev: Evidence, repo_root: Path | str) -> str:
    """The commit to read the campaign's code at: its own, where this repository has it; else a commit here with
    the same code (``gitops.code_digest`` equal to the one the fingerprint recorded), the nearest in time to the
    campaign's start among the SAME_CODE_SEARCH nearest. A campaign's commit goes missing when a commit it ran on
    was rewritten before it landed (a reworded subject): the code it measured landed under another sha. Otherwise
    (no digest recorded, nothing matches, no repository) its own sha, which the callers report as unknown. A found
    commit is remembered for the process (any commit of that digest has the same code); a miss is not (a fetch or
    merge may bring the commit)."""
    fp = ev.fingerprint
    key = (str(Path(repo_root).resolve()), fp.git_sha, fp.code_digest, ev.created)
    if key not in _SAME_CODE:
        found = _same_code_commit(*key)
        if found is None:
            return fp.git_sha
        _SAME_CODE[key] = found
    return _SAME_CODE[key]


_SAME_CODE: dict[tuple, str] = {}


def _same_code_commit(root: str, sha: str, digest_then: str | None, created: str) -> str | None:
    from campaigns.gitops import GitOpsError, code_digest, open_repo
    try:
        repo = open_repo(root)
    except GitOpsError:
        return None
    if _commit_known(repo, sha):
        return sha
    if not digest_then:
        return None
    try:
        when = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()
        commits = list(repo.iter_commits("HEAD"))
    except (ValueError, git.GitCommandError):
        return None
    for c in sorted(commits, key=lambda c: abs(c.committed_date - when))[:SAME_CODE_SEARCH]:
        if code_digest(root, commit=c.hexsha) == digest_then:
            return c.hexsha
    return None


def summary_at(repo_root: Path | str, sha: str, lever: str) -> str | None:
    """The ``summary:`` of ``conf/lever/<lever>.yaml`` at commit ``sha``, whitespace folded; None where the commit is
    not in this repository or the file (or its summary) did not exist there."""
    from campaigns.gitops import GitOpsError, open_repo
    try:
        repo = open_repo(repo_root)
    except GitOpsError:
        return None
    if not _commit_known(repo, sha):
        return None
    raw = _git_file(repo, sha, f"conf/lever/{lever}.yaml")
    try:
        data = yaml.safe_load(raw) if raw is not None else None
    except yaml.YAMLError:
        return None
    text = data.get("summary") if isinstance(data, dict) else None
    return " ".join(text.split()) if isinstance(text, str) and text.strip() else None


def default_at(repo_root: Path | str, sha: str, lever, quant: str | None, levers_now: dict | None = None) -> Any:
    """``lever``'s effective default on ``quant`` at commit ``sha``: its file's default there (default_by_quant where
    the file had one), or the value an on preset set it to (mixed_prefill's chunked_prefill=512), each lever file
    read at that commit and parsed by today's levers (``levers_now``, the registry by default); None where the
    commit, the file or a value that parses today is not there."""
    from vtengine import levers as lever_registry
    levers_now = levers_now if levers_now is not None else lever_registry.registry()
    then = _defaults_at(str(Path(repo_root).resolve()), sha, quant, tuple(sorted(levers_now)), levers_now)
    value = None if then is None else then.get(lever.name)
    return None if isinstance(value, Unparsable) else value


_DEFAULTS_AT: dict[tuple, dict[str, Any] | None] = {}


def _defaults_at(root: str, sha: str, quant: str | None, names: tuple, levers_now: dict) -> dict[str, Any] | None:
    """Every lever's effective default at commit ``sha`` (presets applied), remembered per (root, commit, quant,
    levers): a render asks it of every campaign, most of them at a few commits. A commit the repository lacks is
    not remembered (a fetch may bring it), nor, being None, anything for it."""
    key = (root, sha, quant, names)
    if key in _DEFAULTS_AT:
        return _DEFAULTS_AT[key]
    from campaigns.gitops import GitOpsError, open_repo
    try:
        repo = open_repo(root)
        known = _commit_known(repo, sha)
    except GitOpsError:
        known = False
    out = None
    if known:
        then = _levers_then(repo, sha, levers_now, quant, [])
        out = {name: lt.default for name, lt in then.items()}
        try:
            apply_presets(then, out, {name: "default" for name in out})
        except ValueError:
            pass
    if out is not None:
        _DEFAULTS_AT[key] = out
    return out


def kernels_ran(snapshot_or_counts: dict[str, Any]) -> set[str]:
    """Kernel names with at least one launch, from a counters snapshot {kernel: {route: {launches...}}} or a flat
    {kernel: launches} map."""
    out = set()
    for kernel, v in snapshot_or_counts.items():
        if isinstance(v, dict):
            n = sum(int(r.get("launches", 0)) for r in v.values() if isinstance(r, dict))
        else:
            n = int(v)
        if n > 0:
            out.add(kernel)
    return out


def live_levers(levers: dict, ran: set[str]) -> list[str]:
    """Levers at least one of whose kernels ran, and every engine-loop lever (no kernels of its own, ``affects:
    []``: async scheduling, chunked prefill... shape every step whatever their value, so they are always live)."""
    return sorted(name for name, lv in levers.items() if not lv.affects or set(lv.affects) & ran)


def context_of(ev: Evidence, repo_root: Path | str, levers_now: dict) -> Context:
    """The campaign's context: recorded (schema 2), else reconstructed from git at its commit. Recorded liveness
    gains the engine-loop levers the arm had a value for (evidence written before they counted as live listed them
    inert, so a flip of async scheduling staled nothing)."""
    if ev.context:
        loop = {name for name, lv in levers_now.items() if not lv.affects}
        live = {arm: sorted(set(names) | (loop & set(ev.context.get(arm, {}))))
                for arm, names in ev.live_levers.items()}
        return Context(values=ev.context, live=live, digests=ev.lever_digests, source="recorded")
    return _reconstructed(ev, repo_root, levers_now)


def _reconstructed(ev: Evidence, repo_root: Path | str, levers_now: dict) -> Context:
    from campaigns.gitops import GitOpsError, open_repo
    sha = campaign_commit(ev, repo_root)
    notes = []
    try:
        repo = open_repo(repo_root)
        known = _commit_known(repo, sha)
    except GitOpsError:
        repo, known = None, False
    then: dict[str, _LeverThen] = {}
    digests: dict[str, str] = {}
    quant = quant_of(ev)
    if known:
        then = _levers_then(repo, sha, levers_now, quant, notes)
        notes += [f"lever {name} had no file at {sha[:7]}" for name in levers_now if name not in then]
        digests = {name: digest({p: _git_file(repo, sha, p) for p in sources.files_of(levers_now[name].paths)})
                   for name in then}
        source = f"git {sha[:7]}"
    else:
        notes.append(f"commit {sha[:7]} is not in this repository: lever defaults and source files unknown")
        source = "unknown"
    env = ev.fingerprint.arms_env
    values = {}
    for arm in ev.arms:
        # as the engine resolved them then: the commit's default for the campaign's quantization, the arm's VT_*
        # over it, the lever under test at the arm's value, then the commit's on presets where nothing else set one
        vals = {name: lt.default for name, lt in then.items()}
        src = {name: "default" for name in then}
        for name, lever in levers_now.items():
            if lever.env in env.get(arm.name, {}):
                try:
                    vals[name], src[name] = lever.parse(env[arm.name][lever.env], "env"), "env"
                except ValueError:
                    pass
        vals[ev.lever], src[ev.lever] = arm.value, "arm"
        try:
            apply_presets({n: lt for n, lt in then.items() if n in vals}, vals, src)
        except ValueError as e:
            notes.append(f"the presets at {sha[:7]} do not resolve for arm {arm.name}: {e}")
        values[arm.name] = vals
    # liveness from the mechanism gate's counters, where they can tell
    live = {}
    for arm in ev.arms:
        mech = ev.gate("mechanism", arm.name)
        counted = mech.details.get("counters") if mech is not None else None
        if not isinstance(counted, dict):
            live[arm.name] = sorted(levers_now)
            continue
        ran = kernels_ran(counted)
        live[arm.name] = sorted(name for name, lv in levers_now.items()
                                if not set(lv.affects) <= set(V1_COUNTED_KERNELS) or set(lv.affects) & ran)
    return Context(values=values, live=live, digests=digests, source=source, notes=notes)


@dataclass(frozen=True)
class _LeverThen:
    """What a lever file said at a campaign's commit, as much as resolving an arm's values needs."""
    name: str
    default: Any
    sets: dict[str, Any]


class Unparsable(str):
    """A lever value at a campaign's commit that no longer parses (a value since removed): it equals no value of
    today's, so it reads as drift, never as the lever being new."""


def _levers_then(repo, sha: str, levers_now: dict, quant: str | None, notes: list[str]) -> dict[str, _LeverThen]:
    """Each of today's levers as its file said at ``sha`` (``_lever_then``); a lever with no file there is absent."""
    then = {}
    for name, lever in levers_now.items():
        raw = _git_file(repo, sha, f"conf/lever/{name}.yaml")
        if raw is not None:
            then[name] = _lever_then(lever, raw, sha, levers_now, quant, notes)
    return then


def _lever_then(lever, raw: bytes | str, sha: str, levers_now: dict, quant: str | None,
                notes: list[str]) -> _LeverThen:
    """The lever's file at ``sha``: its default for ``quant`` (default_by_quant where the file had one) and, for a
    preset, the values it set. A file or value that no longer parses is noted and kept as Unparsable."""
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        notes.append(f"lever {lever.name}'s file at {sha[:7]} is not valid YAML ({e})")
        data = None
    if not isinstance(data, dict):
        notes.append(f"lever {lever.name}'s file at {sha[:7]} is no mapping: its default is unknown")
        return _LeverThen(lever.name, Unparsable("<unknown>"), {})
    by_quant = data.get("default_by_quant") or {}
    raw_default = by_quant[quant] if isinstance(by_quant, dict) and quant in by_quant else data.get("default")
    try:
        default = lever.parse(raw_default, "default at the campaign's commit")
    except ValueError:
        notes.append(f"lever {lever.name}'s default {raw_default!r} at {sha[:7]} does not parse today")
        default = Unparsable(f"{raw_default} (no longer a value)")
    sets = {}
    for name, value in (data.get("sets") or {}).items() if isinstance(data.get("sets"), dict) else ():
        if name in levers_now:
            try:
                sets[name] = levers_now[name].parse(value, f"value {lever.name} set at the campaign's commit")
            except ValueError:
                sets[name] = Unparsable(f"{value} (no longer a value)")
    return _LeverThen(lever.name, default, sets)


EPOCHS_FILE = Path("conf") / "epochs.yaml"


@dataclass(frozen=True)
class Epoch:
    commit: str
    date: str
    why: str


def load_epochs(repo_root: Path | str) -> list[Epoch]:
    """The engine epochs declared under ``repo_root`` (conf/epochs.yaml: a list of {commit, date, why}); none when
    the file is absent. A malformed file is an error naming the entry and what is accepted."""
    import yaml
    path = Path(repo_root) / EPOCHS_FILE
    if not path.is_file():
        return []
    data = yaml.safe_load(path.read_text()) or []
    if not isinstance(data, list):
        raise ValueError(f"{EPOCHS_FILE}: expected a list of {{commit, date, why}} entries, got {type(data).__name__}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or set(item) != {"commit", "date", "why"} or not str(item["why"]).strip():
            raise ValueError(f"{EPOCHS_FILE} entry {i}: {item!r}; each entry needs exactly commit, date and a "
                             "non-empty why")
        out.append(Epoch(str(item["commit"]), str(item["date"]), " ".join(str(item["why"]).split())))
    return out


def _epoch_reasons(ev: Evidence, repo_root: Path) -> list[str]:
    """STALE reasons from the engine epochs: the campaign's commit does not contain an epoch's commit."""
    epochs = load_epochs(repo_root)
    if not epochs:
        return []
    from campaigns.gitops import GitOpsError, open_repo
    try:
        repo = open_repo(repo_root)
    except GitOpsError:
        return [f"{len(epochs)} engine epoch(s) declared, but {repo_root} is not a git repository to check them"]
    sha = campaign_commit(ev, repo_root)
    if not _commit_known(repo, sha):
        return [f"its commit {sha} is not in this repository: whether it predates the engine epochs is unknown"]
    reasons = []
    for e in epochs:
        if not _commit_known(repo, e.commit):
            reasons.append(f"engine epoch {e.commit} ({e.why}) is not a commit of this repository")
        elif not repo.is_ancestor(e.commit, sha):
            reasons.append(f"measured before the engine epoch {e.commit} ({e.date}): {e.why}")
    return reasons


def freshness(ev: Evidence, repo_root: Path | str, levers_now: dict | None = None,
              digests_now: dict[str, str] | None = None) -> Freshness:
    """FRESH or STALE (with the reasons) for ``ev``'s verdict against the lever files and sources under
    ``repo_root`` now."""
    from vtengine import levers as lever_registry
    root = Path(repo_root)
    levers_now = lever_registry.registry() if levers_now is None else levers_now
    digests_now = tree_digests(levers_now, root) if digests_now is None else digests_now
    ctx = context_of(ev, root, levers_now)
    reasons, causes = [], []
    live_anywhere = {name for names in ctx.live.values() for name in names}
    pins = pinned_levers(ev, levers_now)
    defaults = lever_registry.effective_defaults(levers_now, quant_of(ev))   # the on presets' values, its quant's
    # a preset under test sets its levers in the arms where it is on: there they are the lever itself, not context
    # (on or off: off, they are at what the engine gives them with the preset off, even after the preset's own flip)
    own_lever = levers_now.get(ev.lever) if ev.kind == "lever" else None
    own_sets = dict(own_lever.sets) if own_lever is not None else {}

    def expected(name: str, arm_values: dict) -> Any:
        if name not in own_sets:
            return defaults[name]
        values = {n: lv.default_for(quant_of(ev)) for n, lv in levers_now.items()}
        sources = {n: "default" for n in levers_now}
        values[ev.lever], sources[ev.lever] = arm_values.get(ev.lever), "arm"
        lever_registry.apply_presets(levers_now, values, sources)
        return values[name]

    plain: dict[str, tuple[int, str]] = {}     # lever -> (its reason's index, the values the campaign ran)
    for name, lever in sorted(levers_now.items()):
        if name == ev.lever and ev.kind == "lever":
            continue
        if name in pins and all(vals.get(name) == pins[name] for vals in ctx.values.values()):
            continue        # pinned: part of what the verdict claims ("pdl_prefetch with pdl=true"), not its context
        was = {arm: vals.get(name) for arm, vals in ctx.values.items() if name in vals}
        if not was:
            # A lever added since the campaign, still at its off default, is the code path the campaign ran (levers
            # arrive default-off, their off value the engine as it was); a changed source file of the verdict's
            # own lever is caught below. At an on default it is a new engine the verdict never measured.
            if lever.is_on(defaults[name]) and (name in live_anywhere or ctx.source == "unknown"
                                                 or _new_lever_live(lever, ev, ctx, levers_now)):
                reasons.append(f"{name}: added since the campaign, with its default {_text(defaults[name])}, which "
                               "the campaign never ran")
                causes.append(f"new {name}")
            continue
        drift = {arm: (v, expected(name, ctx.values[arm])) for arm, v in was.items()}
        drift = {arm: pair for arm, pair in drift.items() if pair[0] != pair[1]}
        if drift and name in live_anywhere:
            how = f"{name}'s kernels ran there" if lever.affects else f"{name} shapes every step"
            changed = ", ".join(sorted({_text(v) for v, _ in drift.values()}))
            if all(want == defaults[name] for _, want in drift.values()):
                plain[name] = (len(reasons), changed)
                reasons.append(f"{name}'s default is now {_text(defaults[name])}; the campaign ran with {changed} "
                               f"and {how}")
            else:                   # a preset's own arm where it is off: its levers' value without the preset
                reasons.append("; ".join(
                    f"the {arm} arm ran {name} at {_text(v)}, where the engine with {ev.lever} at "
                    f"{_text(ctx.values[arm].get(ev.lever))} gives {_text(want)}" for arm, (v, want) in drift.items())
                    + f", and {how}")
            causes.append(f"default {name}")
    _by_preset(plain, reasons, causes, levers_now, quant_of(ev), defaults)
    own = levers_now.get(ev.lever)
    if own is not None:
        then, now = ctx.digests.get(ev.lever, ""), digests_now.get(ev.lever, "")
        if not then:
            reasons.append(f"{ev.lever}'s source files at the campaign are not known")
            causes.append("own sources unknown")
        elif then != now:
            at = campaign_commit(ev, root)
            moved = changed_sources(root, at, live_paths(own, quant_of(ev)))
            if moved is None:
                reasons.append(f"{ev.lever}'s source files cannot be compared: commit {ev.fingerprint.git_short_sha} "
                               "is not in this repository")
                causes.append("own sources")
            elif moved:
                landed = "" if at == ev.fingerprint.git_sha else f" (its code landed as {at[:7]})"
                reasons.append(f"{ev.lever}'s source files ({', '.join(moved)}) changed since "
                               f"{ev.fingerprint.git_short_sha}{landed}")
                causes.append("own sources")
    if ctx.source == "unknown" and not reasons:
        reasons.append("its context cannot be reconstructed")
        causes.append("context unknown")
    epochs = _epoch_reasons(ev, root)
    reasons += epochs
    causes += [_epoch_cause(r) for r in epochs]
    return Freshness(fresh=not reasons, reasons=reasons, causes=causes)


def _new_lever_live(lever, ev: Evidence, ctx: Context, levers_now: dict) -> bool:
    """Whether a lever added since the campaign would have been live in it. The campaign's liveness was counted
    against the levers of its day, so it cannot name this one: it is live where it has no kernels (an engine-loop
    lever shapes every step), where one of its kernels ran there (the mechanism gate's counters; without them, any
    kernel of a lever counted live), or where nothing says which kernels ran (STALE is the safe answer). A new preset
    whose levers the campaign knew is judged through them (their values' drift), not again as new."""
    if lever.sets and all(name in vals for name in lever.sets for vals in ctx.values.values()):
        return False
    if not lever.affects:
        return True
    ran: set[str] = set()
    counted = False
    for arm in ev.arms:
        mech = ev.gate("mechanism", arm.name)
        snapshot = mech.details.get("counters") if mech is not None else None
        if isinstance(snapshot, dict) and snapshot:
            counted = True
            ran |= kernels_ran(snapshot)
    if counted:             # a kernel the counters never keep (argmax, silu_mul ...) may have run: live
        return bool(set(lever.affects) & ran) or not set(lever.affects) <= set(MECHANISM_KERNELS)
    # no counters: the kernels of the levers counted live (more than ran, never fewer)
    live_kernels = {k for names in ctx.live.values() for n in names if n in levers_now for k in levers_now[n].affects}
    return bool(set(lever.affects) & live_kernels) or not any(ctx.live.values())


def _by_preset(plain: dict[str, tuple[int, str]], reasons: list[str], causes: list[str], levers_now: dict,
               quant: str | None, defaults: dict) -> None:
    """In place: the levers whose new default an on preset gives them are one reason, the preset's ("pdl_stack's
    default is now on (it sets pdl=on, pdl_prefetch=on)"), not one per lever: the flip a reader must look up is the
    preset's."""
    from vtengine import levers as lever_registry
    values = {n: lv.default_for(quant) for n, lv in levers_now.items()}
    sources = {n: "default" for n in levers_now}
    lever_registry.apply_presets(levers_now, values, sources)
    groups: dict[str, list[str]] = {}
    for name in plain:
        if sources.get(name, "").startswith("preset "):
            groups.setdefault(sources[name].removeprefix("preset "), []).append(name)
    drop: set[int] = set()
    for preset, names in sorted(groups.items()):
        members = sorted(names) + ([preset] if preset in plain else [])
        at = min(plain[n][0] for n in members)
        ran = ", ".join(f"{n} {plain[n][1]}" for n in members)
        reasons[at] = (f"{preset}'s default is now {_text(defaults[preset])} (it sets "
                       f"{', '.join(f'{n}={_text(levers_now[preset].sets[n])}' for n in sorted(names))}); the "
                       f"campaign ran with {ran}, and they were live there")
        causes[at] = f"default {preset}"
        drop |= {plain[n][0] for n in members} - {at}
    reasons[:] = [r for i, r in enumerate(reasons) if i not in drop]
    causes[:] = [c for i, c in enumerate(causes) if i not in drop]


def pinned_levers(ev: Evidence, levers_now: dict | None = None) -> dict[str, Any]:
    """The levers the campaign pinned for both arms (``campaign.with_levers``), parsed: its verdict is a statement
    about the engine with them at these values. An A/A campaign's pins are its context, like any other lever's."""
    if ev.kind == "aa":
        return {}
    from campaigns.config import settings
    from vtengine import levers as lever_registry
    levers_now = lever_registry.registry() if levers_now is None else levers_now
    pins = dict(settings(ev).campaign.with_levers or {})
    out = {}
    for name, v in pins.items():
        if name in levers_now:
            try:
                out[name] = levers_now[name].parse(v, f"{ev.campaign_id}'s campaign.with_levers pin")
            except ValueError:      # a value since removed: a pin no engine of today runs, never a crashed render
                out[name] = Unparsable(f"{v} (no longer a value)")
    return out


def off_default_pins(ev: Evidence, levers_now: dict | None = None) -> dict[str, Any]:
    """The pinned levers (``pinned_levers``) whose values differ from today's defaults on the campaign's
    quantization: while any is, its FLIP is about an engine users do not run by default."""
    from vtengine import levers as lever_registry
    levers_now = lever_registry.registry() if levers_now is None else levers_now
    now = lever_registry.effective_defaults(levers_now, quant_of(ev))
    return {n: v for n, v in pinned_levers(ev, levers_now).items() if n in now and v != now[n]}


def quant_of(ev: Evidence) -> str | None:
    """The quantization the campaign's model ran (bf16, mxfp4, nvfp4): the defaults its verdict is compared with are
    that quantization's (a lever file's ``default_by_quant``). None where the evidence does not say."""
    from campaigns.config import settings
    from vtengine.config import QUANTS
    quant = (settings(ev).model or {}).get("quant")
    return quant if quant in QUANTS else None


def _epoch_cause(reason: str) -> str:
    """'epoch <sha>' for an epoch reason that names one, else 'epochs unknown'."""
    words = reason.split()
    return f"epoch {words[words.index('epoch') + 1]}" if "epoch" in words[:-1] else "epochs unknown"


def _text(v: Any) -> str:
    return {True: "on", False: "off"}.get(v, str(v)) if isinstance(v, bool) else str(v)
