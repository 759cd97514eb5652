"""The lever registry: schema, resolution order, off-strings, bad values, and no undeclared VT_* reads."""
import ast
import os
import re
import shutil
from pathlib import Path

import pytest

import campaigns
import vtengine
from vtengine import levers
from helpers import copy_plain_levers
from vtengine.levers import LeverError


def test_the_defaults_are_the_files_and_the_flips_that_landed():
    # gqa_swap, marlin_dense, w4a16_rot, triton_gemv, fast_math, decode_wave_grid, fuse_silu, fuse_norm,
    # w4a16_mid_m, the two async levers and mixed_prefill were flipped on by their FLIP
    # campaigns (merges of row/<lever>-flip); the rest are off in their files
    reg = levers.registry()
    assert sorted(reg) == ["async_device_mirror", "async_scheduling", "chunk_above", "chunk_graphs", "chunked_prefill",
                           "decode_wave_grid", "fast_math", "fuse_norm", "fuse_rope", "fuse_silu",
                           "gqa_swap",
                           "marlin_dense", "mixed_prefill", "mixed_steps", "nsplits_cap", "pdl", "pdl_prefetch",
                           "pdl_stack", "prefill_gqa_pack", "prefill_splits", "split_rule",
                           "triton_gemv", "w4a16_mid_m", "w4a16_rot", "whole_first"]
    r = levers.resolve(environ={})
    # mixed_prefill (flipped on 2026-12-06) is a preset: it sets the step-shape levers it names, their files stay off
    preset = {"chunk_above": 1536, "chunk_graphs": True, "chunked_prefill": 512, "mixed_steps": True,
              "prefill_gqa_pack": True, "whole_first": True}
    assert r.values == {"async_device_mirror": True, "async_scheduling": True, "chunk_above": 1536,
                        "chunk_graphs": True, "chunked_prefill": 512, "decode_wave_grid": True,
                        "fast_math": True, "fuse_norm": True, "fuse_rope": True, "fuse_silu": True,
                        "gqa_swap": True, "marlin_dense": True, "mixed_prefill": True, "mixed_steps": True,
                        "nsplits_cap": "off", "pdl": False,
                        "pdl_prefetch": False, "pdl_stack": False,
                        "prefill_gqa_pack": True, "prefill_splits": "off", "split_rule": "off", "triton_gemv": True,
                        "w4a16_mid_m": True,
                        "w4a16_rot": True, "whole_first": True}
    assert r.values == {n: preset.get(n, lv.default) for n, lv in reg.items()}
    assert {n: s for n, s in r.sources.items() if s != "default"} == {n: "preset mixed_prefill" for n in preset}
    assert all(reg[n].default in ("off", False) for n in preset)
    assert sorted(n for n in reg if r.on(n)) == ["async_device_mirror", "async_scheduling", "chunk_above",
                                                  "chunk_graphs", "chunked_prefill", "decode_wave_grid",
                                                  "fast_math", "fuse_norm", "fuse_rope", "fuse_silu", "gqa_swap",
                                                  "marlin_dense", "mixed_prefill", "mixed_steps", "prefill_gqa_pack",
                                                  "triton_gemv", "w4a16_mid_m", "w4a16_rot", "whole_first"]


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
    before = (d / "pdl.yaml").read_text().splitlines()
    levers.set_default_in_file("pdl", True, lever_dir=d)
    after = (d / "pdl.yaml").read_text().splitlines()
    changed = [(a, b) for a, b in zip(before, after) if a != b]
    assert changed == [("default: false", "default: true")]
    assert levers.registry(d)["pdl"].default is True
    levers.set_default_in_file("gqa_swap", False, lever_dir=d)          # and back: a flip of a flipped default
    assert levers.registry(d)["gqa_swap"].default is False


def test_a_quantizations_own_default_resolves_and_flips_alone(tmp_path):
    """default_by_quant: an engine on that quantization runs its value (config and env still win over it), one on
    another runs ``default``; a flip scoped to a quantization edits only that entry, adds the line after
    ``default:`` when missing, and drops the entry (then the line) once it equals ``default``."""
    d = copy_plain_levers(tmp_path / "lever")
    before = (d / "pdl_stack.yaml").read_text().splitlines()
    levers.set_default_in_file("pdl_stack", True, lever_dir=d, quant="bf16")
    after = (d / "pdl_stack.yaml").read_text().splitlines()
    i = before.index("default: false")
    assert after == before[:i + 1] + ["default_by_quant: {bf16: true}"] + before[i + 1:]
    reg = levers.registry(d)
    lv = reg["pdl_stack"]
    assert lv.default is False and lv.default_by_quant == {"bf16": True}
    assert (lv.default_for("bf16"), lv.default_for("mxfp4"), lv.default_for(None)) == (True, False, False)
    bf16, mx = levers.effective_defaults(reg, "bf16"), levers.effective_defaults(reg, "mxfp4")
    assert (bf16["pdl_stack"], bf16["pdl"], bf16["pdl_prefetch"]) == (True, True, True)      # the preset's levers
    assert (mx["pdl_stack"], mx["pdl"], mx["pdl_prefetch"]) == (False, False, False)
    assert lv.resolve(None, {}, "bf16") == (True, "default") and lv.resolve(False, {}, "bf16") == (False, "config")
    assert lv.resolve(None, {"VT_PDL_STACK": "0"}, "bf16") == (False, "env")
    levers.set_default_in_file("pdl_stack", True, lever_dir=d, quant="nvfp4")
    assert "default_by_quant: {bf16: true, nvfp4: true}" in (d / "pdl_stack.yaml").read_text().splitlines()
    levers.set_default_in_file("pdl_stack", False, lever_dir=d, quant="nvfp4")
    levers.set_default_in_file("pdl_stack", False, lever_dir=d, quant="bf16")
    assert (d / "pdl_stack.yaml").read_text().splitlines() == before
    # a flip of the lever's default drops the entries it comes to equal and keeps the others
    levers.set_default_in_file("pdl_stack", True, lever_dir=d, quant="bf16")
    levers.set_default_in_file("pdl_stack", False, lever_dir=d, quant="nvfp4")      # equals default: no entry
    assert "nvfp4" not in (d / "pdl_stack.yaml").read_text()
    levers.set_default_in_file("pdl_stack", True, lever_dir=d)
    assert "default_by_quant: {bf16: true}" not in (d / "pdl_stack.yaml").read_text().splitlines()
    assert levers.registry(d)["pdl_stack"].default_by_quant == {}
    levers.set_default_in_file("chunked_prefill", 256, lever_dir=d, quant="mxfp4")     # a multi-valued lever
    levers.set_default_in_file("chunked_prefill", 384, lever_dir=d, quant="bf16")
    levers.set_default_in_file("chunked_prefill", 384, lever_dir=d)          # bf16's entry goes, mxfp4's stays
    assert levers.registry(d)["chunked_prefill"].default_by_quant == {"mxfp4": 256}
    with pytest.raises(LeverError, match=r"quantization 'int8' is not known; accepted: bf16, mxfp4, nvfp4"):
        levers.set_default_in_file("pdl_stack", True, lever_dir=d, quant="int8")


def test_a_bad_default_by_quant_names_the_value(tmp_path):
    import yaml
    for by_quant, msg in (({"int8": True}, r"default_by_quant names unknown quantization\(s\) \['int8'\]; accepted"),
                          ({"bf16": "maybe"}, r"default for bf16 'maybe' is not valid; accepted: true/false"),
                          ([True], "default_by_quant must map quantizations")):
        (tmp_path / "x.yaml").write_text(yaml.safe_dump({**GOOD, "type": "bool", "default": False,
                                                          "values": [False, True], "default_by_quant": by_quant}))
        with pytest.raises(LeverError, match=msg):
            levers.registry(tmp_path)


def test_bad_lever_file_schema(tmp_path):
    (tmp_path / "x.yaml").write_text("name: x\nenv: VT_X\ntype: bool\ndefault: false\n")
    with pytest.raises(LeverError, match="missing keys"):
        levers.registry(tmp_path)


GOOD = {"name": "x", "env": "VT_X", "type": "choice", "default": "off", "values": ["off", "a"],
        "affects": ["decode_attention"], "summary": "what it changes"}


@pytest.mark.parametrize("field,value,message", [
    ("affects", "decode_attention", r"affects must be a list of engine kernel names, not 'decode_attention'; "
                                    r"accepted: \['argmax', "),
    ("affects", ["decode_atention"], r"affects names unknown kernel\(s\) \['decode_atention'\]; accepted: "),
    ("summary", 5, "summary must be a sentence saying what the lever changes, not 5"),
    ("default", "b", r"default 'b' is not valid; accepted: 'off', 'a'"),
    ("values", [], "values must be a non-empty list"),
    # git's tree names a file only in normal form: './a.py' would read as missing at every commit (always STALE)
    ("paths", ["./vtengine/kernels/attention.py"], r"paths: '\./vtengine/kernels/attention.py' is not in normal "
                                                   r"form; write 'vtengine/kernels/attention.py'"),
    ("paths", ["vtengine//kernels/gemv.py::gemv"], r"write 'vtengine/kernels/gemv.py::gemv'"),
])
def test_lever_file_fields_are_checked_by_type_and_meaning(tmp_path, field, value, message):
    """Each field is checked for what it must be, with the value and what is accepted named: a string where a
    list of kernels belongs used to load, and counted as no kernel at all."""
    levers.registry(_write(tmp_path / "ok", GOOD))                      # the good file loads
    with pytest.raises(LeverError, match=message):
        levers.registry(_write(tmp_path / "bad", {**GOOD, field: value}))


def test_a_bool_default_must_be_among_its_values(tmp_path):
    bad = {**GOOD, "type": "bool", "default": True, "values": [False]}
    with pytest.raises(LeverError, match=r"lever 'x': default True is not among its values \[False\]"):
        levers.registry(_write(tmp_path, bad))


def _write(d, data):
    import yaml
    d.mkdir(parents=True, exist_ok=True)
    (d / "x.yaml").write_text(yaml.safe_dump(data))
    return d


VT_NAME = re.compile(r"VT_[A-Z0-9_]+")
PACKAGE_DIRS = [Path(vtengine.__file__).parent, Path(campaigns.__file__).parent]      # the imported packages
PLANTED = "VT_NOT_A_LEVER"
PLANT_PREFIX = "_planted_scan_probe_"      # + the process id: one module per xdist worker


def undeclared_vt_reads(package_dirs=PACKAGE_DIRS) -> list[tuple[str, int, str]]:
    """(path from the packages' parent, line, name) of every VT_* name in the packages' code that no lever declares.

    Every string literal that is a whole VT_* name counts, whatever reads it (``os.environ["VT_X"]``,
    ``os.environ.get("VT_X")``, ``os.getenv("VT_X")``, a name kept in a variable first); comments and prose in
    docstrings do not."""
    declared = {lv.env for lv in levers.registry().values()}
    found = []
    for package in package_dirs:
        for path in sorted(package.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str) and VT_NAME.fullmatch(node.value)
                        and node.value not in declared):
                    found.append((path.relative_to(package.parent).as_posix(), node.lineno, node.value))
    return sorted(found)


@pytest.fixture
def plant_in_package():
    """Write a module into the real vtengine/ package for one test; it is removed however the test ends. Named per
    process: under xdist two workers may plant at once, and neither may see or delete the other's module."""
    planted = PACKAGE_DIRS[0] / f"{PLANT_PREFIX}{os.getpid()}.py"
    assert not planted.exists(), f"{planted} is left over from an earlier run; delete it"

    def plant(source: str) -> str:
        planted.write_text(source)
        return planted.relative_to(PACKAGE_DIRS[0].parent).as_posix()

    try:
        yield plant
    finally:
        planted.unlink(missing_ok=True)


def _not_planted_elsewhere(found: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The scan's findings less the modules another xdist worker's test planted for the moment."""
    own = f"{PLANT_PREFIX}{os.getpid()}.py"
    return [f for f in found if PLANT_PREFIX not in f[0] or f[0].endswith(own)]


def test_no_undeclared_vt_env_reads():
    """Scan the source: every VT_* name the code mentions must be a registered lever's env variable."""
    assert _not_planted_elsewhere(undeclared_vt_reads()) == [], "VT_* variables read but not declared in conf/lever/"


@pytest.mark.parametrize("read", [f'os.environ["{PLANTED}"]', f'os.environ.get("{PLANTED}", "0")',
                                  f"os.getenv('{PLANTED}')"])
def test_the_scan_finds_an_undeclared_read_planted_in_the_package(plant_in_package, read):
    assert _not_planted_elsewhere(undeclared_vt_reads()) == []
    # a declared lever's read beside the planted one: the scan reports the undeclared name only
    declared = sorted(lv.env for lv in levers.registry().values())[0]
    planted = plant_in_package(f'import os\n\nLEVER = os.environ.get("{declared}")\nKNOB = {read}\n')
    assert _not_planted_elsewhere(undeclared_vt_reads()) == [(planted, 4, PLANTED)]


def test_on_is_a_lookup_that_never_reads_the_lever_files(monkeypatch):
    """ResolvedLevers.on runs per kernel launch (about 22 calls per layer in an eager step). It used to look the
    lever up in registry(), which globs and stats every lever file: ~220 us a call, ~0.2 s per eager Qwen3-8B step
    (the prefill-step floor measured on the H200, 2026-12-01). A whole generation must now read no lever file."""
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    llm = LLM(model="tiny", backend="triton", levers={"async_scheduling": False}, cuda_graphs=False)
    reads = []
    real = levers._files
    monkeypatch.setattr(levers, "_files", lambda paths: reads.append(1) or real(paths))
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
    assert reads == [], f"{len(reads)} lever-file scans during one generation"
    r = levers.resolve(environ={})
    assert r.on("gqa_swap") is True and r.on("pdl") is False
    with pytest.raises(LeverError, match="unknown lever 'nope'"):
        r.on("nope")


PRESET_LEVERS = {
    "a": {"name": "a", "env": "VT_A", "type": "choice", "default": "off", "values": ["off", 4, 8], "affects": [],
          "paths": ["a.py"], "summary": "chunk size"},
    "b": {"name": "b", "env": "VT_B", "type": "bool", "default": False, "values": [False, True],
          "affects": ["prefill_attention"], "paths": ["b.py"], "summary": "packed grid"},
    "p": {"name": "p", "env": "VT_P", "type": "bool", "default": False, "values": [False, True],
          "sets": {"a": 4, "b": True}, "affects": ["prefill_attention"], "paths": ["a.py", "b.py"],
          "summary": "a and b together"},
}


def _write_all(d, files):
    import yaml
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (d / f"{name}.yaml").write_text(yaml.safe_dump(data))
    return d


def test_a_preset_sets_its_levers_below_config_and_env(tmp_path, monkeypatch):
    """A preset on gives its levers its values where nothing else sets them (config > env > preset > file), says
    so in the sources, and effective_defaults() reports them once the preset's default is on."""
    d = _write_all(tmp_path, PRESET_LEVERS)
    monkeypatch.setattr(levers, "registry", lambda lever_dir=None, _r=levers.registry: _r(d))
    r = levers.resolve(environ={})
    assert (r.values["a"], r.values["b"], r.sources["a"]) == ("off", False, "default")
    r = levers.resolve({"p": True}, environ={})
    assert (r.values["a"], r.values["b"]) == (4, True) and r.sources["a"] == r.sources["b"] == "preset p"
    r = levers.resolve({"p": True, "a": 8}, environ={"VT_B": "0"})
    assert (r.values["a"], r.sources["a"], r.values["b"], r.sources["b"]) == (8, "config", False, "env")
    assert r.as_env() == {"VT_A": "8", "VT_B": "off", "VT_P": "on"}
    reg = levers.registry()
    assert levers.effective_defaults(reg) == {"a": "off", "b": False, "p": False}
    levers.set_default_in_file("p", True, lever_dir=d)
    assert levers.effective_defaults(levers.registry()) == {"a": 4, "b": True, "p": True}


@pytest.mark.parametrize("edit,message", [
    ({"p": {"type": "choice", "values": ["off", "on"], "default": "off"}}, "a preset .* must be of type bool"),
    ({"p": {"sets": {"c": 1}}}, r"lever 'p' \(sets\): 'c' is not another lever"),
    ({"p": {"sets": {"a": 5}}}, r"lever 'a' \(VT_A\): value set by the preset 'p' 5 is not valid"),
    ({"p": {"affects": []}}, r"affects must list the kernels of the levers it sets, \['prefill_attention'\]"),
    ({"p": {"paths": ["a.py"]}}, r"paths must include the source files of the levers it sets; missing \['b.py'\]"),
    ({"q": {**PRESET_LEVERS["p"], "name": "q", "env": "VT_Q", "sets": {"p": True}, "paths": ["a.py", "b.py"]}},
     "'p' is a preset itself; presets do not nest"),
])
def test_a_preset_file_is_checked_against_the_levers_it_sets(tmp_path, edit, message):
    files = {name: {**data, **edit.get(name, {})} for name, data in PRESET_LEVERS.items()}
    files.update({name: data for name, data in edit.items() if name not in files})
    with pytest.raises(LeverError, match=message):
        levers.registry(_write_all(tmp_path, files))


def test_two_presets_on_that_disagree_are_an_error_naming_both(tmp_path, monkeypatch):
    q = {**PRESET_LEVERS["p"], "name": "q", "env": "VT_Q", "sets": {"a": 8}, "affects": []}
    d = _write_all(tmp_path, {**PRESET_LEVERS, "q": q})
    monkeypatch.setattr(levers, "registry", lambda lever_dir=None, _r=levers.registry: _r(d))
    assert levers.resolve({"q": True}, environ={}).values["a"] == 8
    with pytest.raises(LeverError, match=r"levers 'p' and 'q' are both on and set 'a' to 4 and 8"):
        levers.resolve({"p": True, "q": True}, environ={})
    assert levers.resolve({"p": True, "q": True, "a": 4}, environ={}).values["a"] == 4     # explicit settles it
