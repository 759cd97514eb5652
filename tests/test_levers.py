"""The lever registry: schema, resolution order, off-strings, bad values, and no undeclared VT_* reads."""
import re
import shutil
from pathlib import Path

import pytest

from vtengine import levers
from vtengine.levers import LeverError

ROOT = Path(__file__).resolve().parents[1]


def test_the_defaults_are_the_files_and_the_flips_that_landed():
    # gqa_swap and marlin_dense were flipped on by their FLIP campaigns (merges of row/<lever>-flip); the rest are off
    reg = levers.registry()
    assert sorted(reg) == ["fast_math", "gqa_swap", "marlin_dense", "nsplits_cap", "pdl", "triton_gemv"]
    r = levers.resolve(environ={})
    assert r.values == {"fast_math": False, "gqa_swap": True, "marlin_dense": True, "nsplits_cap": "off",
                        "pdl": False, "triton_gemv": False}
    assert r.values == {n: lv.default for n, lv in reg.items()}
    assert set(r.sources.values()) == {"default"}
    assert sorted(n for n in reg if r.on(n)) == ["gqa_swap", "marlin_dense"]


def test_resolution_order_config_over_env_over_default():
    env = {"VT_DECODE_GQA_SWAP": "1", "VT_NSPLITS_CAP": "auto"}
    r = levers.resolve({"gqa_swap": "off"}, environ=env)
    assert r.gqa_swap is False and r.sources["gqa_swap"] == "config"
    assert r.nsplits_cap == "auto" and r.sources["nsplits_cap"] == "env"
    assert r.marlin_dense is True and r.sources["marlin_dense"] == "default"
    assert r.as_env()["VT_NSPLITS_CAP"] == "auto" and r.as_env()["VT_DECODE_GQA_SWAP"] == "off"


@pytest.mark.parametrize("off", ["0", "false", "off", "OFF", " False "])
def test_off_strings_mean_off_for_every_type(off):
    env = {lv.env: off for lv in levers.registry().values()}
    r = levers.resolve(environ=env)
    assert not any(r.on(n) for n in r.values)
    assert r.nsplits_cap == "off"


def test_int_or_auto_values():
    lv = levers.get("nsplits_cap")
    assert lv.parse("8") == 8 and lv.parse(16) == 16 and lv.parse("auto") == "auto"


@pytest.mark.parametrize("name,env,value", [("nsplits_cap", "VT_NSPLITS_CAP", "banana"),
                                             ("nsplits_cap", "VT_NSPLITS_CAP", "-3"),
                                             ("gqa_swap", "VT_DECODE_GQA_SWAP", "maybe")])
def test_bad_value_names_lever_value_and_accepted(name, env, value):
    with pytest.raises(LeverError) as e:
        levers.resolve(environ={env: value})
    msg = str(e.value)
    assert name in msg and repr(value) in msg and "accepted" in msg


def test_unknown_lever_in_config_is_rejected():
    with pytest.raises(LeverError, match="unknown lever"):
        levers.resolve({"warp_drive": True}, environ={})


def test_flip_edits_only_the_default_line(tmp_path):
    d = tmp_path / "lever"
    shutil.copytree(levers.LEVER_DIR, d)
    before = (d / "fast_math.yaml").read_text().splitlines()
    levers.set_default_in_file("fast_math", True, lever_dir=d)
    after = (d / "fast_math.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert changed == [("default: false", "default: true")]
    assert levers.registry(d)["fast_math"].default is True
    levers.set_default_in_file("gqa_swap", False, lever_dir=d)          # and back: a flip of a flipped default
    assert levers.registry(d)["gqa_swap"].default is False


def test_bad_lever_file_schema(tmp_path):
    (tmp_path / "x.yaml").write_text("name: x\nenv: VT_X\ntype: bool\ndefault: false\n")
    with pytest.raises(LeverError, match="missing keys"):
        levers.registry(tmp_path)


def test_no_undeclared_vt_env_reads():
    """Scan the source: every VT_* name the code mentions must be a registered lever's env variable."""
    declared = {lv.env for lv in levers.registry().values()}
    pattern = re.compile(r"""["'](VT_[A-Z0-9_]+)["']""")
    found = {}
    for path in list((ROOT / "vtengine").rglob("*.py")) + list((ROOT / "campaigns").rglob("*.py")):
        for name in pattern.findall(path.read_text()):
            found.setdefault(name, path.relative_to(ROOT))
    undeclared = {n: str(p) for n, p in found.items() if n not in declared}
    assert not undeclared, f"VT_* variables read but not declared in conf/lever/: {undeclared}"


def test_scan_catches_an_undeclared_read(tmp_path):
    """The scan above must be able to fail: a planted read is found by the same pattern."""
    src = 'import os\nx = os.environ.get("VT_SECRET_KNOB")\n'
    assert re.findall(r"""["'](VT_[A-Z0-9_]+)["']""", src) == ["VT_SECRET_KNOB"]
