"""Tab completion for ``vtcampaign`` (argcomplete): subcommands and flags from the parser, and for ``run`` the Hydra
overrides a user types there: config groups and their options (``campaign=gq`` -> ``campaign=gqa_swap``, also after
a comma in a sweep), the composed config's keys (``grid.resid`` -> ``grid.residency=``) and the values a key takes
(booleans, ``device``, ``grid.residency``, ``resume``'s unfinished campaigns). Campaign ids complete from the records
directory, flip branches from git.

Hydra's own ``--shell-completion`` belongs to an app launched by ``@hydra.main``; a single run composes with the
compose API (``campaigns.config.compose``) under a subcommand, which Hydra's completion cannot parse, so the
completion is argcomplete's with these completers. Enable it once per shell:
``eval "$(register-python-argcomplete vtcampaign)"``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

GROUPS = ("campaign", "model", "grid", "gate", "tracking", "battery")     # conf/<group>/ choices of a run
FLAGS = ("aa", "commit", "summaries")       # booleans offered even where the words do not compose yet


def _choices() -> dict[str, tuple[str, ...]]:
    """Values a key takes beyond true/false, where the config schema names them."""
    from campaigns.config import DEVICES, RESIDENCIES
    return {"device": tuple(DEVICES), "grid.residency": tuple(RESIDENCIES)}


def _composed(words: Iterable[str]):
    """The config a run of ``words`` composes (the campaign they name, else the first one), on a CPU host; None
    when the words do not compose (a half-typed override)."""
    from campaigns.config import compose, options
    groups = [w for w in words if "=" in w and w.split("=", 1)[0] in GROUPS and "," not in w]
    if not any(w.startswith("campaign=") for w in groups):
        names = options("campaign")
        if not names:
            return None
        groups.append(f"campaign={names[0]}")
    try:
        return compose(groups + ["tracking=off"], cuda=False)
    except Exception:       # a completion never raises: it offers nothing
        return None


def _node(cfg, path: str) -> Any:
    node = cfg
    for part in [p for p in path.split(".") if p]:
        try:
            node = node[part]
        except Exception:
            return None
    return node


def _is_mapping(node: Any) -> bool:
    from omegaconf import DictConfig
    return isinstance(node, (dict, DictConfig))


def complete_override(prefix: str, words: Iterable[str] = (), out_dir: Path | str | None = None) -> list[str]:
    """Completions of the override ``prefix`` typed after ``vtcampaign run`` (``words``: the ones before it)."""
    from campaigns.config import options
    words = list(words)
    if "=" in prefix:
        key, _, value = prefix.partition("=")
        done, _, last = value.rpartition(",")            # a sweep's list: complete its last item
        head = f"{key}={done}," if done else f"{key}="
        if key in GROUPS:
            values = options(key)
        elif key == "resume":
            values = ["auto", *_unfinished(out_dir)]
        elif key in _choices():
            values = list(_choices()[key])
        else:
            cfg = _composed(words)
            node = _node(cfg, key) if cfg is not None else None
            values = ["false", "true"] if isinstance(node, bool) or key in FLAGS else []
        return [head + v for v in values if v.startswith(last)]
    if "." in prefix:
        path, _, tail = prefix.rpartition(".")
        cfg = _composed(words)
        node = _node(cfg, path) if cfg is not None else None
        if not _is_mapping(node):
            return []
        return [f"{path}.{k}" + ("." if _is_mapping(node[k]) else "=") for k in node if str(k).startswith(tail)]
    cfg = _composed(words)
    keys = [] if cfg is None else [f"{k}." if _is_mapping(cfg[k]) else f"{k}=" for k in cfg if k not in GROUPS]
    groups = [f"{g}=" for g in GROUPS]
    return sorted({c for c in groups + keys if c.startswith(prefix)})


def _unfinished(out_dir: Path | str | None) -> list[str]:
    from campaigns.evidence import find_evidence, load_evidence
    if out_dir is None or not Path(out_dir).is_dir():
        return []
    ids = []
    for path in find_evidence(out_dir):
        try:
            ev = load_evidence(path)
        except Exception:
            continue
        if ev.status == "in-progress":
            ids.append(ev.campaign_id)
    return sorted(ids)


def campaign_ids(out_dir: Path | str | None, prefix: str = "") -> list[str]:
    """The campaign directories (those holding evidence.json) under ``out_dir`` whose name starts with ``prefix``."""
    if out_dir is None or not Path(out_dir).is_dir():
        return []
    return sorted(p.parent.name for p in Path(out_dir).glob("*/evidence.json") if p.parent.name.startswith(prefix))


def flip_branches(repo: Path | str, prefix: str = "") -> list[str]:
    """The flip branches (row/...) of the repository, and the levers they flip, starting with ``prefix``."""
    import git
    try:
        heads = [h.name for h in git.Repo(repo, search_parent_directories=True).heads]
    except Exception:
        return []
    rows = [h for h in heads if h.startswith("row/")]
    levers = [h[len("row/"):-len("-flip")] for h in rows if h.endswith("-flip")]
    return sorted(c for c in set(rows) | set(levers) if c.startswith(prefix))


def install(parser, default_out_dir: str) -> None:
    """Attach the completers to ``parser``'s subcommands (argcomplete reads ``action.completer``):
    ``overrides`` of run and recheck, ``campaign_id`` of flip, decide, conclude and pr, ``branch`` of merge, and
    ``lever`` of sources. ``default_out_dir``: the records directory, relative to the project root, where no
    --out-dir is given."""
    import argparse

    from campaigns.gitops import project_root

    def out_dir(parsed) -> Path:
        given = getattr(parsed, "out_dir", None)
        return Path(given) if given else project_root() / default_out_dir

    def overrides(prefix, parsed_args, **_):
        return complete_override(prefix, getattr(parsed_args, "overrides", None) or (), out_dir(parsed_args))

    def ids(prefix, parsed_args, **_):
        return campaign_ids(out_dir(parsed_args), prefix)

    def branches(prefix, **_):
        return flip_branches(project_root(), prefix)

    def lever_names(prefix, **_):
        from vtengine import levers
        return sorted(n for n in levers.registry() if n.startswith(prefix))

    completers = {"overrides": overrides, "campaign_id": ids, "branch": branches, "lever": lever_names}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                for a in sub._actions:
                    if a.dest in completers:
                        a.completer = completers[a.dest]
