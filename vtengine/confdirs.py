"""Where configuration is read from: the packaged defaults, and a project's own conf/ over them.

The repository's conf/ ships in the distribution as read-only package data (``vtengine/conf`` in a wheel; the
repository's conf/ itself in a source checkout or an editable install). A project's own conf/ overrides it file by
file, and may add files (a new lever, a campaign, a preset): the directory named by ``--conf-dir`` (both CLIs) or
the environment variable VTENGINE_CONF_DIR, else ./conf when the working directory has one. So an installed
package run from anywhere still knows its levers, presets and campaigns, and a project changes them without
touching site-packages; a default flip edits the lever file where it was found, and only inside a git repository
(campaigns/gitops.py refuses a file outside it, such as an installed package's).

One place for the fact; vtengine.levers, vtengine.models.presets and campaigns.config all resolve through here.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

ENV = "VTENGINE_CONF_DIR"
GROUPS = ("lever", "model", "campaign", "grid", "gate", "tracking", "battery")
_PACKAGE = Path(__file__).resolve().parent
# A wheel carries conf/ as vtengine/conf; a source checkout (or an editable install) has it beside the package.
PACKAGED = _PACKAGE / "conf" if (_PACKAGE / "conf").is_dir() else _PACKAGE.parent / "conf"
# Where the engine's sources sit (lever `paths:` are relative to it): the checkout, or site-packages.
SOURCE_ROOT = _PACKAGE.parent

_chosen: Path | None = None


class ConfDirError(ValueError):
    """A conf directory that does not exist or holds no configuration; the message names it."""


def set_project_conf(path: Path | str | None) -> None:
    """``--conf-dir``: the project's own conf directory for this process (None: back to env / ./conf)."""
    global _chosen
    if path is None:
        _chosen = None
        return
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise ConfDirError(f"--conf-dir {str(path)!r} is not a directory")
    _chosen = p


def take_conf_dir_flag(argv: list[str]) -> list[str]:
    """Strip a leading ``--conf-dir PATH`` / ``--conf-dir=PATH`` from a CLI's arguments and apply it, for this
    process and (through the environment) the servers and jobs it starts. Returns the remaining arguments."""
    argv = list(argv)
    if argv and argv[0].startswith("--conf-dir"):
        flag = argv.pop(0)
        value = flag.split("=", 1)[1] if "=" in flag else (argv.pop(0) if argv else "")
        if not value:
            raise ConfDirError("--conf-dir needs a directory")
        set_project_conf(value)
        os.environ[ENV] = str(_chosen)
    return argv


def project_conf() -> Path | None:
    """The project's own conf directory: --conf-dir, else $VTENGINE_CONF_DIR, else ./conf if it exists."""
    if _chosen is not None:
        return _chosen
    env = os.environ.get(ENV, "").strip()
    if env:
        p = Path(env).expanduser().resolve()
        if not p.is_dir():
            raise ConfDirError(f"{ENV}={env!r} is not a directory")
        return p
    here = Path.cwd() / "conf"
    return here.resolve() if here.is_dir() and any((here / g).is_dir() for g in GROUPS) else None


def search_dirs() -> list[Path]:
    """The conf directories, highest priority first (the project's, then the packaged defaults)."""
    out = []
    for d in (project_conf(), PACKAGED):
        if d is not None and d.resolve() not in out:
            out.append(d.resolve())
    return out


def group_files(group: str, suffix: str = ".yaml") -> dict[str, Path]:
    """name -> file of one config group, a project's file winning over the packaged one of the same name."""
    files: dict[str, Path] = {}
    for d in reversed(search_dirs()):
        for p in sorted((d / group).glob(f"*{suffix}")):
            files[p.stem] = p
    return dict(sorted(files.items()))


def find(group: str, name: str) -> Path | None:
    return group_files(group).get(name)


def file(rel: str) -> Path:
    """One file by its path inside conf/ (e.g. battery/default.yaml), the project's first."""
    for d in search_dirs():
        if (d / rel).is_file():
            return d / rel
    raise ConfDirError(f"conf file {rel!r} not found in {[str(d) for d in search_dirs()]}")


def merged() -> Path:
    """A directory holding the packaged conf with the project's files laid over it (what Hydra composes from).
    Rebuilt when any source file changes; one per distinct content, under the system temp directory."""
    dirs = search_dirs()
    if len(dirs) == 1:
        return dirs[0]
    files: dict[str, Path] = {}
    for d in reversed(dirs):
        for p in sorted(d.rglob("*.yaml")):
            files[p.relative_to(d).as_posix()] = p
    h = hashlib.sha256()
    for rel, p in sorted(files.items()):
        h.update(rel.encode() + b"\0" + p.read_bytes() + b"\0")
    out = Path(tempfile.gettempdir()) / f"vtengine-conf-{h.hexdigest()[:16]}"
    if not (out / "config.yaml").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=".vtengine-conf-", dir=tempfile.gettempdir()))
        for rel, p in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, tmp / rel)
        try:
            os.replace(tmp, out)
        except OSError:             # another process built the same overlay first
            shutil.rmtree(tmp, ignore_errors=True)
    return out
