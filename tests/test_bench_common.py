"""vtengine/bench/common.py: one copy-bandwidth measurement, its byte accounting (a stand-in timer, on CPU), and
every benchmark taking its ceiling from it (and its rel_l2 from vtengine.testing) rather than from a copy of its
own."""
import ast
import types
from pathlib import Path

import pytest
import torch

from vtengine import testing
from vtengine.bench import attention, common, decode, w4a16

BENCH_DIR = Path(common.__file__).parent


class FakeTimer:
    """Stands in for do_bench: runs the copy once, keeps what it returned, reports a fixed median."""

    def __init__(self, ms: float):
        self.ms, self.copied = ms, []

    def __call__(self, fn) -> float:
        self.copied.append(fn())
        return self.ms


def test_copy_bandwidth_counts_bytes_read_and_written():
    nbytes = 3 * 2**20
    timer = FakeTimer(0.25)
    gbs = common.copy_bandwidth_gbs(nbytes, device="cpu", timer=timer)
    # the buffer is read once and written once: 2 x nbytes in the median time
    assert gbs == pytest.approx(2 * nbytes / 0.25e-3 / 1e9)
    [dst] = timer.copied                                 # the timed call is one copy of the whole buffer
    assert dst.numel() * dst.element_size() == nbytes and dst.device.type == "cpu"
    assert common.copy_bandwidth_gbs(nbytes, device="cpu", timer=FakeTimer(0.5)) == pytest.approx(gbs / 2)


def test_copy_bandwidth_refuses_what_it_cannot_measure():
    with pytest.raises(ValueError, match="nbytes must be a positive even"):
        common.copy_bandwidth_gbs(3, device="cpu", timer=FakeTimer(1.0))
    with pytest.raises(ValueError, match="device cpu"):             # no L2 to size the buffer from
        common.copy_bandwidth_gbs(device="cpu", timer=FakeTimer(1.0))
    with pytest.raises(RuntimeError, match="timed at 0.0 ms"):
        common.copy_bandwidth_gbs(1024, device="cpu", timer=FakeTimer(0.0))


def test_copy_buffer_is_several_times_the_l2():
    assert common.copy_buffer_bytes(60 * 2**20) == 2**30               # H200: 60 MiB of L2 -> the 1 GiB floor
    assert common.copy_buffer_bytes(256 * 2**20) == 8 * 256 * 2**20     # a larger L2: 8 x
    for l2 in (0, 50 * 10**6, 96 * 2**20 + 1):
        n = common.copy_buffer_bytes(l2)
        assert n >= common.COPY_L2_MULTIPLE * l2 - 1 and n >= common.COPY_MIN_BYTES and n % 2 == 0


def test_copy_bandwidth_default_timer_is_the_do_bench_median(monkeypatch):
    import triton.testing
    calls = []

    def do_bench(fn, **kw):
        calls.append(kw)
        fn()
        return 2.0

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    assert common.copy_bandwidth_gbs(1024, device="cpu") == pytest.approx(2 * 1024 / 2e-3 / 1e9)
    assert calls == [{"warmup": common.COPY_WARMUP_MS, "rep": common.COPY_REP_MS, "return_mode": "median"}]


class Measured(Exception):
    """Raised by the stand-in copy bandwidth: the benchmark got as far as asking common for its ceiling."""


@pytest.fixture
def ceiling_probe(monkeypatch, tmp_path):
    """A CUDA host as far as the benchmarks look before they measure the ceiling; common.copy_bandwidth_gbs records
    its call and stops the run there."""
    calls = []

    def probe(*args, **kwargs):
        calls.append((args, kwargs))
        raise Measured

    props = types.SimpleNamespace(name="stand-in", multi_processor_count=132, L2_cache_size=60 * 2**20)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: props.name)
    monkeypatch.setattr(attention, "sm_count", lambda *a: props.multi_processor_count)
    monkeypatch.setattr(common, "copy_bandwidth_gbs", probe)
    return calls


@pytest.mark.parametrize("bench", ["decode", "attention", "attention-explore", "w4a16"])
def test_every_benchmark_takes_its_ceiling_from_common(bench, ceiling_probe, tmp_path):
    run = {"decode": lambda: decode.main(str(tmp_path), ["--models", "tiny:bf16"]),
           "attention": lambda: attention.main(str(tmp_path)),
           "attention-explore": lambda: attention.explore(str(tmp_path)),
           "w4a16": lambda: w4a16.main(str(tmp_path), precompile_workers=0)}[bench]
    with pytest.raises(Measured):
        run()
    assert ceiling_probe == [((), {})]                  # once, the common definition (no size or timer of its own)


def _functions_defined(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}


def test_one_copy_bandwidth_and_one_rel_l2():
    others = [p for p in BENCH_DIR.rglob("*.py") if p != Path(common.__file__)]
    assert len(others) >= 5
    for path in others:
        own = {f for f in _functions_defined(path) if "copy_bandwidth" in f or f == "rel_l2"}
        assert not own, f"{path} defines {own}: use vtengine/bench/common.py and vtengine/testing.py"
    assert attention.rel_l2 is testing.rel_l2 and w4a16.rel_l2 is testing.rel_l2
    assert "copy_bandwidth_gbs" in _functions_defined(Path(common.__file__))


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


def test_every_benchmark_that_writes_results_names_them_by_unique_stem():
    """A second run the same day (a re-check, another machine) must not overwrite the first's files, which notes
    and tests cite (the prefill split test reads a committed sweep): every bench that writes files takes its name
    from common.unique_stem (until 2026-12-06 three of eleven did). decode/report.py writes the stem its cli chose."""
    writers = [p for p in BENCH_DIR.rglob("*.py")
               if {"write_text", "write_result"} & _names_used(p) and p.name != "common.py"]
    assert len(writers) >= 10, writers
    missing = [str(p.relative_to(BENCH_DIR)) for p in writers
               if "unique_stem" not in _names_used(p) and p != BENCH_DIR / "decode" / "report.py"]
    assert missing == []
    assert "unique_stem" in _names_used(BENCH_DIR / "decode" / "cli.py")
    # once a run: the benches rewrite their files after every shape, and a name drawn in the loop (or in a helper
    # the loop calls) would leave one run's figures spread over -2, -3, ... (attention.write did, for a day)
    drawn_in_loop = {str(p.relative_to(BENCH_DIR)): _draws_in_loop(p) for p in writers}
    assert {k: v for k, v in drawn_in_loop.items() if v} == {}


def _calls(node: ast.AST) -> set[str]:
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def _draws_in_loop(path: Path) -> list[str]:
    """Loops (``line``) that call unique_stem, or a function of the module that calls it."""
    tree = ast.parse(path.read_text())
    drawers = {"unique_stem"} | {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                                  and "unique_stem" in _calls(f)}
    return [f"line {n.lineno}: {sorted(_calls(n) & drawers)}" for n in ast.walk(tree)
            if isinstance(n, (ast.For, ast.While)) and _calls(n) & drawers]


def test_unique_stem_skips_a_name_either_file_of_an_earlier_run_holds(tmp_path):
    assert common.unique_stem(tmp_path, "w4a16-bound-NVIDIA_H200-2026-12-04") == "w4a16-bound-NVIDIA_H200-2026-12-04"
    (tmp_path / "w4a16-bound-NVIDIA_H200-2026-12-04.json").write_text("{}")
    assert common.unique_stem(tmp_path, "w4a16-bound-NVIDIA_H200-2026-12-04") == "w4a16-bound-NVIDIA_H200-2026-12-04-2"
    (tmp_path / "w4a16-bound-NVIDIA_H200-2026-12-04-2.md").write_text("# cut short\n")
    assert common.unique_stem(tmp_path, "w4a16-bound-NVIDIA_H200-2026-12-04") == "w4a16-bound-NVIDIA_H200-2026-12-04-3"
    assert common.unique_stem(tmp_path / "absent", "x") == "x"
