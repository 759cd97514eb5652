"""Performance levers: one YAML file each under conf/lever/, the only place a default lives.

Resolution order for every lever: explicit engine config > ``VT_*`` environment variable > a preset lever that
sets it > file default: the model quantization's where the file names one (``default_by_quant: {bf16: true}``),
else ``default``. A preset (a bool lever with ``sets: {lever: value}``) names one step of the engine that
needs several levers at once (``mixed_prefill``: 512-token chunks, mixed steps, chunk graphs, packed prefill
attention): when it is on, the levers it sets take its values unless a config or env sets them. A campaign decides
it like any lever, and a flip of it moves them all. The strings "0", "false" and "off" always mean off, whatever
the lever's type. The files come from the packaged conf/ with a project's own conf/lever/ over them
(vtengine/confdirs.py).
"""
from __future__ import annotations

import os
import posixpath
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import yaml

from vtengine import confdirs
from vtengine.config import QUANTS       # the model quantizations a lever's default may differ by

CONF_DIR = confdirs.PACKAGED            # the packaged defaults (a project's conf/ may override; see confdirs)
LEVER_DIR = CONF_DIR / "lever"
LEVER_TYPES = ("bool", "choice", "int_or_auto")
OFF_STRINGS = ("0", "false", "off")
OFF_VALUES = (False, "off", None)        # canonical values that mean off
ON_STRINGS = ("1", "true", "on")


class LeverError(ValueError):
    """A lever file or a lever value is invalid; the message names the lever, the value and what is accepted."""


@dataclass(frozen=True)
class Lever:
    name: str
    env: str
    type: str
    default: Any
    values: list
    affects: list[str]
    summary: str
    paths: list[str] = field(default_factory=list)      # its sources (files, or file::definition): a change stales
    inapplicable: dict[str, str] = field(default_factory=dict)   # gate -> why it cannot apply to this lever
    sets: dict[str, Any] = field(default_factory=dict)           # a preset: these levers take these values when on
    # the default on one quantization where it differs from ``default``: a lever that wins on bf16 and loses on
    # MXFP4 (pdl_stack, H200 2026-12-04) is flipped for the quantization its campaign measured, not for all
    default_by_quant: dict[str, Any] = field(default_factory=dict)
    path: Path | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.type not in LEVER_TYPES:
            raise LeverError(f"lever {self.name!r}: type {self.type!r} is not one of {list(LEVER_TYPES)}")
        if not self.env.startswith("VT_"):
            raise LeverError(f"lever {self.name!r}: env {self.env!r} must start with 'VT_'")
        if not isinstance(self.summary, str) or not self.summary.strip():
            raise LeverError(f"lever {self.name!r}: summary must be a sentence saying what the lever changes, "
                             f"not {self.summary!r}")
        if not isinstance(self.values, list) or not self.values:
            raise LeverError(f"lever {self.name!r}: values must be a non-empty list, not {self.values!r}")
        from vtengine.backends import KERNEL_OPS         # the engine kernels counters and faults know by name
        if not isinstance(self.affects, list) or not all(isinstance(k, str) for k in self.affects):
            raise LeverError(f"lever {self.name!r}: affects must be a list of engine kernel names, not "
                             f"{self.affects!r}; accepted: {sorted(KERNEL_OPS)}")
        unknown = [k for k in self.affects if k not in KERNEL_OPS]
        if unknown:
            raise LeverError(f"lever {self.name!r}: affects names unknown kernel(s) {unknown}; accepted: "
                             f"{sorted(KERNEL_OPS)}")
        object.__setattr__(self, "default", self.parse(self.default, source="default"))
        object.__setattr__(self, "values", [self.parse(v, source="values") for v in self.values])
        if self.default not in self.values:
            raise LeverError(f"lever {self.name!r}: default {self.default!r} is not among its values {self.values}")
        if not isinstance(self.default_by_quant, dict):
            raise LeverError(f"lever {self.name!r}: default_by_quant must map quantizations ({', '.join(QUANTS)}) to "
                             f"values, not {self.default_by_quant!r}")
        bad = sorted(set(self.default_by_quant) - set(QUANTS))
        if bad:
            raise LeverError(f"lever {self.name!r}: default_by_quant names unknown quantization(s) {bad}; accepted: "
                             f"{', '.join(QUANTS)}")
        object.__setattr__(self, "default_by_quant", {
            q: self.parse(v, source=f"default for {q}") for q, v in self.default_by_quant.items()})
        if not isinstance(self.sets, dict):
            raise LeverError(f"lever {self.name!r}: sets must map lever names to the values it gives them, not "
                             f"{self.sets!r}")
        if self.sets and self.type != "bool":
            raise LeverError(f"lever {self.name!r}: a preset (sets: ...) must be of type bool, not {self.type!r}: "
                             "it sets its levers when on")

    def accepted(self) -> str:
        if self.type == "bool":
            return "true/false, 1/0, on/off"
        if self.type == "int_or_auto":
            return "'off' (or 0/false), 'auto', or a positive integer"
        return ", ".join(repr(v) for v in self.values) + " (or 0/false/off)"

    def parse(self, raw: Any, source: str = "value") -> Any:
        """Turn a raw value (YAML scalar, env string, Python object) into the lever's canonical value."""
        bad = LeverError(f"lever {self.name!r} ({self.env}): {source} {raw!r} is not valid; accepted: {self.accepted()}")
        text = str(raw).strip().lower() if not isinstance(raw, bool) else ("true" if raw else "false")
        if self.type == "bool":
            if text in OFF_STRINGS:
                return False
            if text in ON_STRINGS:
                return True
            raise bad
        if text in OFF_STRINGS:
            return "off"
        if self.type == "int_or_auto":
            if text == "auto":
                return "auto"
            try:
                n = int(text)
            except ValueError:
                raise bad from None
            if n < 1:
                raise bad
            return n
        # choice
        for v in self.values if source != "values" else [raw]:
            if text == str(v).strip().lower():
                return v
        raise bad

    def default_for(self, quant: str | None = None) -> Any:
        """The default on ``quant`` (bf16, mxfp4, nvfp4): its own where the file names one, else ``default``."""
        return self.default_by_quant.get(quant, self.default)

    def resolve(self, explicit: Any = None, environ: Mapping[str, str] | None = None,
                quant: str | None = None) -> tuple[Any, str]:
        """Return (value, source) where source is 'config', 'env' or 'default' (``quant``'s where it has one)."""
        environ = os.environ if environ is None else environ
        if explicit is not None:
            return self.parse(explicit, source="config value"), "config"
        if self.env in environ:
            return self.parse(environ[self.env], source=f"value of {self.env}"), "env"
        return self.default_for(quant), "default"

    def is_on(self, value: Any) -> bool:
        return value not in OFF_VALUES


# A ``paths:`` entry is a repository-relative file, or one definition in a Python file that holds several levers'
# code: "vtengine/backends/triton_backend.py::TritonBackend.rope_out" (only the code it reaches there counts for the
# lever's staleness; campaigns/sources.py says how that is found).
PATH_SEP = "::"
_DEFINITION = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$")


def split_entry(entry: str) -> tuple[str, str | None]:
    """``"a/b.py::C.m"`` -> ``("a/b.py", "C.m")``; a plain file -> ``(file, None)``."""
    path, sep, symbol = entry.partition(PATH_SEP)
    return path, (symbol if sep else None)


def entry_error(entry: str) -> str | None:
    """Why ``entry`` is no valid ``paths:`` entry, or None."""
    path, symbol = split_entry(entry)
    if not path or path.startswith("/") or ".." in Path(path).parts:
        return f"{entry!r} is no repository-relative path"
    if posixpath.normpath(path) != path:    # git's tree names it only so: './a.py' would read as missing there
        return f"{entry!r} is not in normal form; write {posixpath.normpath(path) + entry[len(path):]!r}"
    if symbol is not None:
        if not path.endswith(".py"):
            return f"{entry!r} names a definition in a file that is not Python"
        if not _DEFINITION.match(symbol):
            return (f"{entry!r}: after {PATH_SEP!r} comes a module-level name or Class.member (e.g. "
                    f"{path}{PATH_SEP}decode_attention, {path}{PATH_SEP}TritonBackend.linear)")
    return None


def covers(entries, entry: str) -> bool:
    """Whether ``entries`` include ``entry``'s code: the same entry, or its whole file."""
    return entry in entries or split_entry(entry)[0] in entries


def _load_file(path: Path) -> Lever:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise LeverError(f"lever file {path.name}: not valid YAML: {e}") from None
    required = ("name", "env", "type", "default", "values", "affects", "summary")
    optional = ("paths", "inapplicable", "sets", "default_by_quant")
    if not isinstance(data, dict):
        raise LeverError(f"lever file {path.name}: expected a mapping with keys {list(required)}")
    missing = [k for k in required if k not in data]
    unknown = sorted(set(data) - set(required) - set(optional))
    if missing or unknown:
        raise LeverError(f"lever file {path.name}: missing keys {missing}, unknown keys {unknown}; "
                         f"the schema is {list(required)} (optional: {list(optional)})")
    if not isinstance(data.get("paths", []), list) or not all(isinstance(p, str) for p in data.get("paths", [])):
        raise LeverError(f"lever file {path.name}: paths must be a list of repository-relative file paths")
    bad = [why for why in map(entry_error, data.get("paths", [])) if why]
    if bad:
        raise LeverError(f"lever file {path.name}: paths: {'; '.join(bad)}")
    if not isinstance(data.get("inapplicable", {}), dict):
        raise LeverError(f"lever file {path.name}: inapplicable must map gate names to the reason")
    if data["name"] != path.stem:
        raise LeverError(f"lever file {path.name}: name {data['name']!r} must equal the file name {path.stem!r}")
    return Lever(**data, path=path)


@lru_cache(maxsize=None)
def _registry(files: tuple[tuple[str, float], ...]) -> dict[str, Lever]:
    levers = {}
    for path, _mtime in files:
        lever = _load_file(Path(path))
        levers[lever.name] = lever
    envs = [lv.env for lv in levers.values()]
    if len(set(envs)) != len(envs):
        raise LeverError(f"two levers share an env variable: {envs}")
    for lever in levers.values():
        _check_preset(lever, levers)
    return levers


def _check_preset(lever: Lever, levers: dict[str, Lever]) -> None:
    """A preset's levers exist, are not presets themselves, accept the values it gives them; and the preset declares
    their kernels and source files as its own (the op gate tests its kernels, staleness watches its files)."""
    if not lever.sets:
        return
    where = f"lever {lever.name!r} (sets)"
    for name, raw in lever.sets.items():
        if name not in levers or name == lever.name:
            raise LeverError(f"{where}: {name!r} is not another lever; known levers: {sorted(levers)}")
        if levers[name].sets:
            raise LeverError(f"{where}: {name!r} is a preset itself; presets do not nest")
        lever.sets[name] = levers[name].parse(raw, source=f"value set by the preset {lever.name!r}")
    kernels = sorted({k for name in lever.sets for k in levers[name].affects})
    if sorted(set(lever.affects)) != kernels:
        raise LeverError(f"{where}: affects must list the kernels of the levers it sets, {kernels}, not "
                         f"{sorted(lever.affects)}")
    missing = sorted({p for name in lever.sets for p in levers[name].paths if not covers(lever.paths, p)})
    if missing:
        raise LeverError(f"{where}: paths must include the source files of the levers it sets; missing {missing}")


def apply_presets(levers: Mapping[str, Lever], values: dict[str, Any], sources: dict[str, str]) -> None:
    """In place: every on preset gives its levers its values where they are at their file default. Two on presets
    that give one lever different values are an error naming both."""
    by: dict[str, str] = {}
    for preset in sorted(levers.values(), key=lambda lv: lv.name):
        if not preset.sets or values.get(preset.name) in OFF_VALUES:
            continue
        for name, value in preset.sets.items():
            if sources.get(name) not in ("default", f"preset {by.get(name)}"):
                continue                    # set by a config or an env: those win over a preset
            if name in by and values[name] != value:
                raise LeverError(f"levers {by[name]!r} and {preset.name!r} are both on and set {name!r} to "
                                 f"{values[name]!r} and {value!r}; set {name} explicitly, or one of them off")
            values[name], sources[name], by[name] = value, f"preset {preset.name}", preset.name


def effective_defaults(levers: Mapping[str, Lever] | None = None, quant: str | None = None) -> dict[str, Any]:
    """Every lever's value in an engine that sets none: the file defaults (``quant``'s where a file names one), with
    the on presets applied (the default a verdict is compared with, and a campaign's baseline)."""
    levers = registry() if levers is None else levers
    values = {name: lv.default_for(quant) for name, lv in levers.items()}
    apply_presets(levers, values, {name: "default" for name in levers})
    return values


def _files(paths) -> tuple[tuple[str, float], ...]:
    return tuple((str(p), p.stat().st_mtime_ns) for p in paths)


def registry(lever_dir: Path | str | None = None) -> dict[str, Lever]:
    """All levers by name: from ``lever_dir`` alone when given, else the packaged lever files with a project's own
    conf/lever/ over them. Never silently empty: no lever file at all is an error naming where it looked."""
    if lever_dir is not None:
        paths = sorted(Path(lever_dir).glob("*.yaml"))
        where = [str(lever_dir)]
    else:
        paths = list(confdirs.group_files("lever").values())
        where = [str(d / "lever") for d in confdirs.search_dirs()]
    if not paths:
        raise LeverError(f"no lever files (*.yaml) in {where}; the packaged conf/ is missing, or --conf-dir / "
                         f"{confdirs.ENV} names a directory without lever/")
    return dict(_registry(_files(paths)))


def reload() -> None:
    _registry.cache_clear()


def get(name: str) -> Lever:
    levers = registry()
    if name not in levers:
        raise LeverError(f"unknown lever {name!r}; known levers: {sorted(levers)}")
    return levers[name]


@dataclass(frozen=True)
class ResolvedLevers:
    """The value of every lever for one engine instance, with where each value came from."""
    values: dict[str, Any]
    sources: dict[str, str]

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "values")
        if name in values:
            return values[name]
        raise AttributeError(name)

    def on(self, name: str) -> bool:
        """Whether lever ``name`` is on for this engine: a dict lookup. Backends call it per kernel launch, so it
        must not touch the lever files (registry() globs and stats them: ~220 us a call, which made eager steps
        pay ~0.2 s of lookups, 2026-12-01)."""
        values = object.__getattribute__(self, "values")
        if name not in values:
            raise LeverError(f"unknown lever {name!r}; known levers: {sorted(values)}")
        return values[name] not in OFF_VALUES

    def as_env(self) -> dict[str, str]:
        """The environment that reproduces these values in another process (a server per arm)."""
        out = {}
        for name, value in self.values.items():
            v = "off" if value is False else ("on" if value is True else str(value))
            out[get(name).env] = v
        return out


def resolve(explicit: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            quant: str | None = None) -> ResolvedLevers:
    """Every lever's value for an engine: ``explicit`` (its config), else ``environ``'s VT_*, else an on preset's,
    else the file default for the model's ``quant`` (bf16, mxfp4, nvfp4; None: the plain ``default``)."""
    explicit = dict(explicit or {})
    levers = registry()
    unknown = sorted(set(explicit) - set(levers))
    if unknown:
        raise LeverError(f"unknown lever(s) {unknown}; known levers: {sorted(levers)}")
    values, sources = {}, {}
    for name, lever in levers.items():
        values[name], sources[name] = lever.resolve(explicit.get(name), environ, quant)
    apply_presets(levers, values, sources)
    return ResolvedLevers(values, sources)


def lever_file(name: str) -> Path:
    """The file the lever ``name`` is read from (a project's own, else the packaged default)."""
    lever = get(name)
    return lever.path


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else str(value)


def set_default_in_file(name: str, value: Any, lever_dir: Path | str | None = None, quant: str | None = None) -> Path:
    """Rewrite only the ``default:`` line of a lever file (the flip): in ``lever_dir``, else the file the lever is
    read from. With ``quant``, only that quantization's entry of the ``default_by_quant:`` line (added after
    ``default:`` when missing, dropped when it comes to equal ``default``). Without, ``default:`` and the entries
    of ``default_by_quant:`` that come to equal it (they no longer say anything); the others stay, a campaign on
    that quantization decided them. Returns the file path."""
    if lever_dir is None:
        lever_dir = lever_file(name).parent
    lever = registry(lever_dir)[name]
    canonical = lever.parse(value, source="new default")
    if quant is not None and quant not in QUANTS:
        raise LeverError(f"lever {name!r}: quantization {quant!r} is not known; accepted: {', '.join(QUANTS)}")
    path = Path(lever_dir) / f"{name}.yaml"
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, ln in enumerate(lines) if ln.startswith("default:")]
    if len(hits) != 1:
        raise LeverError(f"lever file {path}: expected exactly one 'default:' line, found {len(hits)}")
    by_quant = dict(lever.default_by_quant)
    if quant is None:
        lines[hits[0]] = f"default: {_yaml_scalar(canonical)}\n"
        by_quant = {q: v for q, v in by_quant.items() if v != canonical}
    else:
        if canonical == lever.default:
            by_quant.pop(quant, None)
        else:
            by_quant[quant] = canonical
    own = [i for i, ln in enumerate(lines) if ln.startswith("default_by_quant:")]
    text = ("default_by_quant: {" + ", ".join(f"{q}: {_yaml_scalar(v)}" for q, v in sorted(by_quant.items()))
            + "}\n") if by_quant else None
    if own:
        lines[own[0]:own[0] + 1] = [text] if text else []
    elif text:
        lines.insert(hits[0] + 1, text)
    path.write_text("".join(lines))
    _registry.cache_clear()
    return path
