"""What code counts for a lever's staleness (campaigns/sources.py): a file listed by its definitions counts only the
code they reach, on the safe side; every other change to the file leaves the lever's verdicts FRESH."""
from __future__ import annotations

import git
import pytest

from campaigns import context as lever_context
from campaigns import sources
from helpers import TPUT_WIN, make_evidence
from vtengine import levers

BACKEND = '''\
from pkg.kernels import fused, gemv
from pkg.kernels.attention import prefill_attention as _prefill

SMS = 2
UNUSED = 7


def helper(x):
    return x + SMS


class Backend:
    def __init__(self, levers):
        self.levers = levers
        self.rope_ok = True

    def _gemv_levers(self):
        return dict(pdl=self.levers["pdl"])

    def configure(self, scale):
        self.scale = scale

    def rope_out(self, x):
        if not self.rope_ok:
            return None
        return fused.RopeOut(helper(x) * self.scale, **self._gemv_levers())

    def prefill(self, q):
        return _prefill(q, splits=self.levers["splits"])
'''

FUSED = '''\
from pkg.kernels.common import ROUND


def _qkv_head(x):
    return x * 2


class RopeOut:
    def __init__(self, x, pdl):
        self.x = _qkv_head(x) + ROUND


def rms_norm(x):
    return x / 3
'''

GEMV = '''\
from pkg.kernels.fused import _qkv_head


def linear(x, rope=None):
    return _qkv_head(x) if rope is not None else x
'''

ENTRIES = ["pkg/backend.py::Backend.rope_out", "pkg/kernels/fused.py::RopeOut", "pkg/kernels/gemv.py"]


def tree(**over):
    files = {"pkg/backend.py": BACKEND, "pkg/kernels/fused.py": FUSED, "pkg/kernels/gemv.py": GEMV}
    files.update({k.replace("__", "/").replace("_py", ".py"): v for k, v in over.items()})
    return lambda p: files[p].encode() if files.get(p) is not None else None


def changed(**over):
    return sources.changed(ENTRIES, tree(), tree(**over))


def edit(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


def test_unchanged_code_is_unchanged():
    assert changed() == []
    assert changed(pkg__backend_py=BACKEND.replace("    def", "    # a comment\n    def")) == []


def test_what_counts_is_remembered_by_the_bytes_and_never_served_stale(monkeypatch):
    """`vtcampaign status` asks the same sources of many verdicts: the parsed trees and the counted code are
    remembered by the files' bytes, so a second reading of the same bytes parses nothing, and other bytes (a code
    change) are read afresh."""
    first = sources.counted(ENTRIES, tree())
    monkeypatch.setattr(sources.ast, "parse", lambda *a, **k: pytest.fail("parsed the same bytes again"))
    assert sources.counted(ENTRIES, tree()) == first and sources.changed(ENTRIES, tree(), tree()) == []
    monkeypatch.undo()
    moved = sources.counted(ENTRIES, tree(pkg__backend_py=edit(BACKEND, "SMS = 2", "SMS = 4")))
    assert moved["pkg/backend.py"] != first["pkg/backend.py"] and moved["pkg/kernels/gemv.py"] == first[
        "pkg/kernels/gemv.py"]
    assert sources.counted(ENTRIES, tree()) == first


@pytest.mark.parametrize("where,old,new", [
    ("backend", "return x + SMS", "return x - SMS"),                         # a module function it calls
    ("backend", "SMS = 2", "SMS = 4"),                                      # a constant that function reads
    ("backend", "self.rope_ok = True", "self.rope_ok = False"),             # an attribute set in __init__
    ("backend", "self.scale = scale", "self.scale = 2 * scale"),            # ... or in another method
    ("backend", 'pdl=self.levers["pdl"]', 'pdl=False'),                     # a method it calls through self
    ("backend", "from pkg.kernels import fused, gemv", "from pkg.other import fused, gemv"),   # an import it uses
    ("backend", "    def rope_out(self, x):", "    def rope_out(self, x, y=0):"),
])
def test_what_the_definition_reaches_counts(where, old, new):
    assert changed(pkg__backend_py=edit(BACKEND, old, new)) == ["pkg/backend.py::Backend.rope_out"]


@pytest.mark.parametrize("old,new", [
    ("UNUSED = 7", "UNUSED = 8"),                                            # a constant nothing of it reads
    ('splits=self.levers["splits"]', "splits=4"),                           # another lever's method
    ("    def prefill(self, q):", "    def prefill(self, q, extra=None):"),
    ("from pkg.kernels import fused, gemv", "from pkg.kernels import fused, gemv, sm_count"),    # a name it never uses
])
def test_another_definitions_change_does_not_count(old, new):
    assert changed(pkg__backend_py=edit(BACKEND, old, new)) == []


def test_a_method_that_assigns_an_attribute_with_a_class_level_default_counts():
    """``mode = "slow"`` at class level and ``self.mode = ...`` in another method: the value the definition reads
    is the method's once it ran, so that method counts as well as the class attribute."""
    backend = edit(BACKEND, "class Backend:\n", "class Backend:\n    scale = 1.0\n\n")
    base = tree(pkg__backend_py=backend)
    moved = tree(pkg__backend_py=edit(backend, "self.scale = scale", "self.scale = 2 * scale"))
    assert sources.changed(ENTRIES, base, moved) == ["pkg/backend.py::Backend.rope_out"]
    moved = tree(pkg__backend_py=edit(backend, "    scale = 1.0", "    scale = 3.0"))
    assert sources.changed(ENTRIES, base, moved) == ["pkg/backend.py::Backend.rope_out"]


def test_a_helper_another_listed_file_imports_counts():
    """gemv.py (listed whole) imports fused._qkv_head: it counts for the lever although RopeOut is the only
    definition listed in fused.py; rms_norm, which no listed code reaches, does not."""
    assert sources.counted(ENTRIES, tree())["pkg/kernels/fused.py"].startswith(b"reachable RopeOut,_qkv_head\0")
    assert changed(pkg__kernels__fused_py=edit(FUSED, "x * 2", "x * 3")) == ["pkg/kernels/fused.py::RopeOut"]
    assert changed(pkg__kernels__fused_py=edit(FUSED, "x / 3", "x / 4")) == []
    # the backend's counted code uses fused.RopeOut through the module: the same name, already listed
    assert changed(pkg__kernels__fused_py=edit(FUSED, "+ ROUND", "- ROUND")) == ["pkg/kernels/fused.py::RopeOut"]


def test_the_module_object_passed_on_counts_the_whole_file():
    passed = edit(BACKEND, "return fused.RopeOut(helper(x) * self.scale, **self._gemv_levers())",
                  "return getattr(fused, 'RopeOut')(helper(x))")
    assert sources.counted(ENTRIES, tree(pkg__backend_py=passed))["pkg/kernels/fused.py"] == \
        sources.normalized("pkg/kernels/fused.py", FUSED.encode())
    assert sources.changed(ENTRIES, tree(pkg__backend_py=passed), tree(
        pkg__backend_py=passed, pkg__kernels__fused_py=edit(FUSED, "x / 3", "x / 4"))) == \
        ["pkg/kernels/fused.py::RopeOut"]


def test_a_definition_gone_or_renamed_compares_the_whole_file():
    renamed = edit(BACKEND, "def rope_out(", "def rope_out_v2(")
    assert changed(pkg__backend_py=renamed) == ["pkg/backend.py::Backend.rope_out"]
    assert sources.counted(ENTRIES, tree(pkg__backend_py=renamed))["pkg/backend.py"] == \
        sources.normalized("pkg/backend.py", renamed.encode())
    assert changed(pkg__backend_py="def broken(:\n") == ["pkg/backend.py::Backend.rope_out"]
    assert changed(pkg__backend_py=None) == ["pkg/backend.py::Backend.rope_out"]


def test_a_block_binding_the_name_and_the_class_itself_count_whole():
    src = ("import sys\nif sys.platform == 'x':\n    def _exp(x):\n        return x\nelse:\n    def _exp(x):\n"
           "        return -x\n\n\ndef kernel(x):\n    return _exp(x)\n\n\ndef other():\n    return 1\n")
    entries = ["k.py::kernel"]
    assert sources.changed(entries, lambda p: src.encode(), lambda p: src.replace("-x", "+x").encode()) == entries
    assert sources.changed(entries, lambda p: src.encode(), lambda p: src.replace("1\n", "2\n").encode()) == []
    cls = ("class C:\n    def a(self):\n        return C()\n\n    def b(self):\n        return 1\n")
    entries = ["c.py::C.a"]
    assert sources.changed(entries, lambda p: cls.encode(), lambda p: cls.replace("1\n", "2\n").encode()) == entries


def test_entries_are_checked_where_the_lever_file_loads(tmp_path):
    base = {"name": "x", "env": "VT_X", "type": "bool", "default": False, "values": [False, True], "affects": [],
            "summary": "s"}
    import yaml
    for entry, why in [("conf/x.yaml::A", "not Python"), ("a.py::1bad", "module-level name or Class.member"),
                       ("/abs/a.py", "repository-relative"), ("../a.py", "repository-relative")]:
        (tmp_path / "x.yaml").write_text(yaml.safe_dump({**base, "paths": [entry]}))
        with pytest.raises(levers.LeverError, match=why):
            levers.registry(tmp_path)
        levers.reload()
    assert levers.covers(["a.py"], "a.py::f") and levers.covers(["a.py::f"], "a.py::f")
    assert not levers.covers(["a.py::g"], "a.py::f")


def test_a_declared_definition_missing_from_the_tree_is_reported(tmp_path):
    (tmp_path / "pkg" / "kernels").mkdir(parents=True)
    (tmp_path / "pkg" / "backend.py").write_text(BACKEND)
    lever = levers.Lever(name="x", env="VT_X", type="bool", default=False, values=[False, True], affects=[],
                         summary="s", paths=["pkg/backend.py::Backend.rope_out", "pkg/backend.py::Backend.gone",
                                             "pkg/kernels/none.py"])
    assert lever_context.missing_sources(lever, tmp_path) == ["pkg/backend.py::Backend.gone", "pkg/kernels/none.py"]


def test_fuse_rope_stays_fresh_when_another_levers_backend_method_changes(tmp_path):
    """The project's own lever files on a temporary repository whose backend holds the methods they name:
    prefill_splits' wiring in TritonBackend.prefill_attention leaves fuse_rope's verdict FRESH (it staled it when
    the whole file counted); a change to rope_out stales it, naming that definition."""
    from helpers import lever_repo
    root = lever_repo(tmp_path)
    backend = root / "vtengine" / "backends" / "triton_backend.py"
    methods = "".join(f"    def {m}(self, x):\n        return self.go(x, {m!r})\n\n" for m in (
        "rope_out", "linear", "norm_linear", "qkv_epilogue", "prefill_attention", "fuses_norm", "linear_add",
        "gate_up_silu", "silu_mul", "_w4a16_levers", "_gemv_levers"))
    backend.write_text("class TritonBackend:\n    def go(self, x, name):\n        return x\n\n" + methods)
    fused = root / "vtengine" / "kernels" / "fused.py"
    fused.write_text("class RopeOut:\n    pass\n\n\ndef qkv_epilogue(x):\n    return x\n\n\ndef argmax(x):\n"
                     "    return x\n")
    repo = git.Repo(root)
    repo.git.add(A=True)
    sha = repo.index.commit("backend", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t")).hexsha
    levers.reload()
    reg = levers.registry(root / "conf" / "lever")
    assert lever_context.missing_sources(reg["fuse_rope"], root) == []
    ev = make_evidence(TPUT_WIN, lever="fuse_rope")
    for arm in ev.arms:
        ev.context[arm.name] = {**{n: lv.default for n, lv in reg.items()}, "fuse_rope": arm.value}
        ev.live_levers[arm.name] = ["fuse_rope"]
    ev.lever_digests = lever_context.tree_digests(reg, root)
    ev.fingerprint.git_sha, ev.fingerprint.git_short_sha = sha, sha[:7]

    def fresh():
        return lever_context.freshness(ev, root, reg, lever_context.tree_digests(reg, root))

    backend.write_text(backend.read_text().replace("'prefill_attention')", "'prefill_attention', 4)"))
    fused.write_text(fused.read_text().replace("def argmax(x):\n    return x", "def argmax(x):\n    return -x"))
    assert fresh().fresh, fresh().reasons
    backend.write_text(backend.read_text().replace("'rope_out')", "'rope_out', 2)"))
    assert fresh().reasons == ["fuse_rope's source files (vtengine/backends/triton_backend.py::TritonBackend.rope_out) "
                               f"changed since {sha[:7]}"]
    backend.write_text(backend.read_text().replace("return x\n", "return -x\n", 1))    # go(): every method calls it
    assert fresh().reasons[0].startswith("fuse_rope's source files (vtengine/backends/triton_backend.py::TritonBackend."
                                         "rope_out, vtengine/backends/triton_backend.py::TritonBackend.linear, ")


def test_what_shapes_every_instance_counts():
    """A declared method that reads no attribute still counts its class's constructor and any method that sets
    attributes by computed name: the Triton backend's __init__ reroutes ops with setattr(self, op, ...)."""
    src = ("class B:\n    def __init__(self, ops):\n        for op in ops:\n            setattr(self, op, None)\n\n"
           "    def route(self, x):\n        return x\n\n    def late(self, name):\n        setattr(self, name, 1)\n\n"
           "    def other(self):\n        return 2\n")
    entries = ["b.py::B.route"]
    for old, new in (("setattr(self, op, None)", "setattr(self, op, 0)"), ("setattr(self, name, 1)", "pass")):
        assert sources.changed(entries, lambda p: src.encode(), lambda p: src.replace(old, new).encode()) == entries
    assert sources.changed(entries, lambda p: src.encode(), lambda p: src.replace("2\n", "3\n").encode()) == []
    assert sources.reached(entries, lambda p: src.encode()) == {"b.py": ["B.__init__", "B.route", "B.late"]}


def test_what_the_language_calls_implicitly_counts():
    """A declared method may call its class's dunders with no ``self.<name>`` in sight: ``self(x)``, ``self[i]``,
    ``len(self)``, ``x in self``; every dunder member counts (``__slots__`` too), a plain unused method does not."""
    src = ("class B:\n    __slots__ = ('w',)\n\n    def __call__(self, x):\n        return x * 2\n\n"
           "    def __getitem__(self, i):\n        return i + 1\n\n    def __len__(self):\n        return 4\n\n"
           "    def route(self, x):\n        return self(x) + self[x] + len(self)\n\n    def other(self):\n"
           "        return 2\n")
    entries = ["b.py::B.route"]
    for old, new in (("x * 2", "x * 3"), ("i + 1", "i - 1"), ("return 4", "return 5"), ("('w',)", "('w', 'v')")):
        assert sources.changed(entries, lambda p: src.encode(), lambda p: src.replace(old, new).encode()) == entries
    other = src.replace("return 2\n", "return 3\n")
    assert other != src and sources.changed(entries, lambda p: src.encode(), lambda p: other.encode()) == []
    assert sources.reached(entries, lambda p: src.encode()) == {
        "b.py": ["B.__slots__", "B.__call__", "B.__getitem__", "B.__len__", "B.route"]}


def test_reached_names_what_counts_and_whole_files():
    got = sources.reached(ENTRIES, tree())
    assert got["pkg/kernels/gemv.py"] is None
    assert {"Backend.rope_out", "Backend.__init__", "Backend._gemv_levers", "helper", "SMS"} <= set(
        got["pkg/backend.py"])
    assert not {"UNUSED", "Backend.prefill"} & set(got["pkg/backend.py"])
    assert got["pkg/kernels/fused.py"] == ["_qkv_head", "RopeOut.__init__"]


def test_the_diff_shows_only_the_code_that_counts():
    after = edit(edit(BACKEND, "return x + SMS", "return x - SMS"), "UNUSED = 7", "UNUSED = 8")
    text = sources.diff(ENTRIES, tree(), tree(pkg__backend_py=after), "abc1234", "working tree")
    assert text.startswith("--- pkg/backend.py (abc1234)\n+++ pkg/backend.py (working tree)\n")
    assert "-    return x + SMS\n+    return x - SMS\n" in text
    assert "UNUSED" not in text and "fused.py" not in text
    assert sources.diff(ENTRIES, tree(), tree()) == ""


def test_the_sources_command_shows_a_levers_code(capsys):
    from campaigns.cli import main
    assert main(["sources", "gqa_swap"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("vtengine/kernels/attention.py: "))
    assert line.startswith("vtengine/kernels/attention.py: decode_attention and what they reach: ")
    assert "_decode_kernel" in line and "_merge_splits" in line and "_prefill_kernel" not in line
    assert main(["sources", "gqa_swap", "--since", "0" * 40]) == 2
    assert "is not in the repository" in capsys.readouterr().err
    assert main(["sources", "no_such_lever"]) == 2
    capsys.readouterr()
    assert main(["sources", "gqa_swap", "--diff"]) == 2
    out, err = capsys.readouterr()
    assert "--diff needs --since <commit>" in err and out == ""
