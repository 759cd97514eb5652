"""Evidence survives save_evidence / load_evidence with every field, at every nesting level, off its default.

The evidence is built from the dataclasses' own fields and type hints, so a field added later is covered without
touching this file: a writer that drops or mangles it shows up as a difference, not as a default read back.
"""
import dataclasses
import types
import typing
from typing import Any, Union

import pytest

from campaigns import evidence as evidence_module
from campaigns.evidence import (KINDS, SCHEMA_VERSION, STATUSES, VERDICTS, Arm, ArmSummary, AxisStat, Decision,
                                Evidence, Fingerprint, GateResult, LegResult, evidence_head, load_evidence,
                                save_evidence)

# load_evidence accepts only these values in these fields: the builder takes the first that is not the default;
# every other field takes whatever the builder makes
ACCEPTED = {(Evidence, "status"): STATUSES, (Decision, "verdict"): VERDICTS, (Evidence, "kind"): KINDS}
KEEPS_ITS_DEFAULT = {(Evidence, "schema_version")}      # save_evidence writes the current version, and only it


class Builder:
    """Values for a type: unique strings, unique nonzero ints, non-integer floats (exact in binary, so JSON
    gives them back bit for bit), two items per list and dict, one of X for Optional[X], the flipped default for a
    bool, and a nested JSON value for Any."""

    def __init__(self):
        self.count = 0
        self.classes: set[type] = set()

    def unique(self) -> int:
        self.count += 1
        return self.count

    def dataclass(self, cls: type, where: str) -> Any:
        self.classes.add(cls)
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            if (cls, f.name) in KEEPS_ITS_DEFAULT:
                kwargs[f.name] = default_of(f)
            elif (cls, f.name) in ACCEPTED:
                kwargs[f.name] = next(v for v in ACCEPTED[(cls, f.name)] if v != default_of(f))
            elif hints[f.name] is bool:
                kwargs[f.name] = not default_of(f) if isinstance(default_of(f), bool) else True
            else:
                kwargs[f.name] = self.value(hints[f.name], f"{where}.{f.name}")
        return cls(**kwargs)

    def value(self, tp: Any, where: str) -> Any:
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, where)
        if tp is Any:
            n = self.unique()
            return {f"any{n}": [n, n + 0.5, f"any-{n}", True, None, {"nested": [n * 2]}]}
        if origin in (Union, types.UnionType):
            return self.value(next(a for a in args if a is not type(None)), where)
        if origin is list:
            return [self.value(args[0], f"{where}[{i}]") for i in range(2)]
        if origin is dict:
            return {self.value(args[0], f"{where}.key"): self.value(args[1], f"{where}[{i}]") for i in range(2)}
        if tp is bool:
            return True
        if tp is int:
            return 100 + self.unique()
        if tp is float:
            return self.unique() + 0.25
        if tp is str:
            return f"{where}#{self.unique()}"
        raise TypeError(f"{where}: the builder makes no value of type {tp!r}; teach Builder.value this type")


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def is_empty(value: Any) -> bool:
    return (value is None or (isinstance(value, (str, list, dict)) and not value)
            or (type(value) in (int, float) and value == 0))


def fields_at_default(obj: Any, where: str = "evidence") -> list[str]:
    """Paths of the dataclass fields under obj that hold their default or an empty value."""
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in fields_at_default(v, f"{where}[{i}]")]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in fields_at_default(v, f"{where}.{k}")]
    if not dataclasses.is_dataclass(obj):
        return []
    found = []
    for f in dataclasses.fields(obj):
        value, path = getattr(obj, f.name), f"{where}.{f.name}"
        if (type(obj), f.name) not in KEEPS_ITS_DEFAULT and (is_empty(value) or value == default_of(f)):
            found.append(path)
        found += fields_at_default(value, path)
    return found


def differences(expected: Any, got: Any, where: str = "evidence") -> list[str]:
    """Paths where got differs from expected in value or in type (an int read back as 3.0 is a difference)."""
    if type(expected) is not type(got):
        return [where]
    if dataclasses.is_dataclass(expected):
        return [p for f in dataclasses.fields(expected)
                for p in differences(getattr(expected, f.name), getattr(got, f.name), f"{where}.{f.name}")]
    if isinstance(expected, list):
        if len(expected) != len(got):
            return [where]
        return [p for i, (e, g) in enumerate(zip(expected, got)) for p in differences(e, g, f"{where}[{i}]")]
    if isinstance(expected, dict):
        if expected.keys() != got.keys():
            return [where]
        return [p for k in expected for p in differences(expected[k], got[k], f"{where}.{k}")]
    return [] if expected == got else [where]


@pytest.fixture
def built():
    builder = Builder()
    return builder.dataclass(Evidence, "evidence"), builder


def test_the_builder_sets_every_field_off_its_default(built):
    ev, builder = built
    assert fields_at_default(ev) == []
    assert {Evidence, Fingerprint, Arm, GateResult, LegResult, ArmSummary, AxisStat, Decision} <= builder.classes
    defined = {v for v in vars(evidence_module).values()
               if dataclasses.is_dataclass(v) and v.__module__ == evidence_module.__name__}
    assert defined - builder.classes == set(), "dataclasses of campaigns/evidence.py that Evidence never holds"
    assert ev.schema_version == SCHEMA_VERSION and ev.status != "in-progress"
    # unique leaves: a writer that swaps two fields of one type cannot go unnoticed
    assert ev.legs[0].concurrency != ev.legs[0].rep and ev.stats[0].summary != {}
    first, second = ev.stats[0].summary.values()
    assert first.median != second.median and first.mean != first.median


def test_every_field_survives_save_and_load(built, tmp_path):
    ev, _ = built
    path = save_evidence(ev, tmp_path)
    loaded = load_evidence(path)
    assert differences(ev, loaded) == []
    assert loaded == ev


def test_the_head_is_what_load_evidence_reads_and_follows_a_rewrite(built, tmp_path):
    """evidence_head filters a search before load_evidence builds the matches: it must state the loaded fields,
    and read a rewritten file anew (a campaign's evidence is rewritten as it goes: in-progress, then complete)."""
    ev, _ = built
    path = save_evidence(ev, tmp_path)
    loaded = load_evidence(path)
    assert evidence_head(path) == (loaded.status, loaded.lever, loaded.fingerprint.config_hash)
    other = next(s for s in STATUSES if s != ev.status)
    save_evidence(dataclasses.replace(ev, status=other, lever=ev.lever + "-2"), tmp_path)
    assert evidence_head(path) == (other, ev.lever + "-2", ev.fingerprint.config_hash)
    path.write_text("[]")           # not an object: no head, so a search loads it and load_evidence says why
    assert evidence_head(path) is None
    assert evidence_head(tmp_path / "absent" / "evidence.json") is None


def drop_leg_reasons(d):
    for leg in d["legs"]:
        del leg["reasons"]


def drop_dirty_files(d):
    del d["fingerprint"]["dirty_files"]


def drop_flip(d):
    del d["flip"]


@pytest.mark.parametrize("drop,lost", [
    (drop_leg_reasons, ["evidence.legs[0].reasons", "evidence.legs[1].reasons"]),
    (drop_dirty_files, ["evidence.fingerprint.dirty_files"]),
    (drop_flip, ["evidence.flip"]),
])
def test_a_field_the_writer_drops_is_caught(built, tmp_path, monkeypatch, drop, lost):
    """The round trip check can fail: a writer that leaves out a defaulted field loads back with the default."""
    ev, _ = built
    to_dict = evidence_module.Evidence.to_dict

    def dropping_to_dict(self):
        d = to_dict(self)
        drop(d)
        return d

    monkeypatch.setattr(evidence_module.Evidence, "to_dict", dropping_to_dict)
    loaded = load_evidence(save_evidence(ev, tmp_path))
    assert differences(ev, loaded) == lost
    assert loaded != ev


def test_an_atomic_write_gets_the_mode_open_would_give(tmp_path, monkeypatch):
    """write_atomic renames a temporary file into place: the file must not keep mkstemp's 0600 (records others on
    the host could not read), but get what open() gives a new file under the process umask."""
    import os
    import stat

    from campaigns import evidence
    umask = os.umask(0o022)
    os.umask(umask)
    assert evidence._UMASK == umask
    assert stat.S_IMODE(evidence.write_atomic(tmp_path / "a.json", "{}").stat().st_mode) == 0o666 & ~umask
    monkeypatch.setattr(evidence, "_UMASK", 0o027)
    assert stat.S_IMODE(evidence.write_atomic(tmp_path / "b.json", "{}").stat().st_mode) == 0o640
