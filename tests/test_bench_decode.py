"""`vtengine bench decode` on CPU: HF timing (tiny preset, eager), the step-by-step engine profile (CPU ops stand
in for kernels), the markdown view, result file names. The timings are never checked against thresholds; what is
checked is that every figure is what its definition makes of the measurements it comes from (ms/step from the
per-rep times, kernel times summing to the total, ratios the quotient of their figures, markdown = JSON)."""
import json
import statistics
from pathlib import Path

import pytest
import torch

from vtengine.bench import common, decode
from vtengine.bench.decode import cli as decode_cli
from vtengine.bench.decode import engine_timing, hf_baseline, kernel_profile, report
from vtengine.bench.decode.results import DecodeResult, KernelProfile, KernelRow


def md_tables(md: str, header: str) -> list[list[dict[str, str]]]:
    """Every markdown table whose header line starts with ``header``: its rows as {column: cell}."""
    lines, tables = md.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith(header):
            cols = [c.strip() for c in line.strip()[1:-1].split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(cols, (c.strip() for c in row.strip()[1:-1].split("|")))))
            tables.append(rows)
    return tables


def shown(cell: str, value: float, decimals: int) -> bool:
    """The cell shows ``value`` to its decimals (the markdown rounds what the JSON holds)."""
    return float(cell.rstrip("%×")) == pytest.approx(value, abs=0.51 * 10 ** -decimals)


def hf_figures(h: dict) -> dict:
    """HF's figures recomputed from its per-rep generate times, as the module docstring defines them."""
    t, n = h["generate_s"], h["gen_len"]
    return {"ms_per_step": 1e3 * statistics.median((b - a) / (n - 2) for a, b in zip(t["2"], t[str(n)])),
            "ms_per_step_from_1tok": 1e3 * statistics.median((b - a) / (n - 1) for a, b in zip(t["1"], t[str(n)])),
            "prefill_ms": 1e3 * statistics.median(t["1"])}


def check_profile(p: dict, steps: int) -> None:
    """A CPU profile's figures add up: kernel times sum to the total, shares are kernel time over the measured step,
    the gap is the rest, launches are whole over the recorded steps."""
    other = p.get("kernels_other", {"names": 0, "us_per_step": 0.0})
    assert p["steps"] == steps and p["num_kernel_names"] == len(p["kernels"]) + other["names"]
    assert p["kernel_us_per_step"] == pytest.approx(sum(k["us_per_step"] for k in p["kernels"]) + other["us_per_step"])
    assert p["gap_us_per_step"] == pytest.approx(p["step_us_measured"] - p["kernel_us_per_step"])
    # self times of ops inside the steps cannot exceed the steps' wall time
    assert 0 < p["kernel_us_per_step"] <= p["step_us_measured"] * 1.01
    for k in p["kernels"]:
        assert k["us_per_step"] > 0 and k["share_of_step"] == pytest.approx(k["us_per_step"] / p["step_us_measured"])
        assert k["launches_per_step"] >= 1 / steps
        assert k["launches_per_step"] * steps == pytest.approx(round(k["launches_per_step"] * steps))
    assert p["kernels"] == sorted(p["kernels"], key=lambda k: -k["us_per_step"])


def check_profile_markdown(md: str, table: list[dict[str, str]], p: dict) -> None:
    """The markdown's summary line and kernel table show the profile's JSON figures."""
    gap_pct = 100 * p["gap_us_per_step"] / p["step_us_measured"]
    assert (f"sum of kernel time {p['kernel_us_per_step']:.1f} us/step vs measured step time "
            f"{p['step_us_measured']:.1f} us/step") in md
    assert f"gap {p['gap_us_per_step']:.1f} us/step ({gap_pct:.1f}%)" in md
    top = p["kernels"][:report.MD_TOP_KERNELS]
    assert [row["kernel"] for row in table[:len(top)]] == [f"`{k['kernel']}`" for k in top]
    for row, k in zip(table, top):
        assert shown(row["us/step"], k["us_per_step"], 1) and shown(row["launches/step"], k["launches_per_step"], 2)
        assert shown(row["% of step"], 100 * k["share_of_step"], 1)
    shown_us = sum(float(row["us/step"]) for row in table)       # the top rows and the "others" row
    assert shown_us == pytest.approx(p["kernel_us_per_step"], abs=0.05 * len(table) + 1e-9)
    if p["num_kernel_names"] > report.MD_TOP_KERNELS:
        assert table[-1]["kernel"] == f"({p['num_kernel_names'] - report.MD_TOP_KERNELS} others)"
        assert len(table) == report.MD_TOP_KERNELS + 1


@pytest.fixture(scope="module")
def tiny_llm():
    return engine_timing.build_llm("tiny", "bf16", max_num_seqs=4, levers={}, device="cpu", backend="torch",
                            num_kv_blocks=64, max_model_len=256)


def test_hf_decode_eager_on_cpu_times_every_rep():
    import transformers
    h = hf_baseline.hf_decode_ms("tiny", batch=2, prompt_len=16, gen_len=8, device="cpu", compile=False,
                                 reps=3).to_dict()
    assert "error" not in h, h.get("error")
    assert [len(h["generate_s"][k]) for k in ("1", "2", "8")] == [3, 3, 3]
    assert all(t > 0 for times in h["generate_s"].values() for t in times)
    figures = hf_figures(h)
    assert {k: h[k] for k in figures} == pytest.approx(figures) and h["ms_per_step"] > 0
    assert (h["batch"], h["prompt_len"], h["gen_len"], h["reps"]) == (2, 16, 8, 3)
    assert h["compile"].startswith("none") and h["transformers"] == transformers.__version__
    assert h["dtype"] == "float32"


def test_hf_decode_records_errors_instead_of_raising():
    h = hf_baseline.hf_decode_ms("no-such-preset", batch=1, prompt_len=8, gen_len=8, device="cpu",
                                 compile=False).to_dict()
    assert "no-such-preset" in h["error"] and "ms_per_step" not in h
    h = hf_baseline.hf_decode_ms("tiny", batch=1, prompt_len=8, gen_len=2, device="cpu", compile=False).to_dict()
    assert "gen_len must be >= 3" in h["error"]


@pytest.mark.slow
def test_hf_decode_compiles_once_through_generate(request):
    """The GPU path (generate's auto-compile, static cache) on CPU: exactly one dynamo graph, positive time."""
    if "slow" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("slow (an inductor compile, ~40 s on 2 cores): run with -m slow")
    h = hf_baseline.hf_decode_ms("tiny", batch=2, prompt_len=16, gen_len=8, device="cpu", compile=True,
                                 reps=2).to_dict()
    assert "error" not in h, h.get("error")
    assert h["compile"].startswith("generate auto-compile") and "fullgraph=True" in h["compile"]
    assert h["dynamo_graphs_compiled"] == 1
    assert h["ms_per_step"] > 0


def test_engine_decode_ms_on_cpu(tiny_llm, monkeypatch):
    eng = tiny_llm.engine
    snapshots = []                 # what engine_decode_ms read of the engine's counters: after warm-up, at the end
    stats = eng.stats

    def recorded_stats():
        snapshots.append(stats())
        return snapshots[-1]

    monkeypatch.setattr(eng, "stats", recorded_stats)
    r = engine_timing.engine_decode_ms(tiny_llm, batch=2, prompt_len=16, gen_len=8).to_dict()
    before, after = snapshots
    assert r["decode_steps"] == after["decode_steps_total"] - before["decode_steps_total"] == 7
    decode_s = after["decode_time_s_sum"] - before["decode_time_s_sum"]
    assert r["ms_per_step"] == pytest.approx(1e3 * decode_s / 7) and r["ms_per_step"] > 0
    assert r["ms_per_step"] * 7 <= 1e3 * r["wall_s"]           # the decode steps are part of the timed generate
    # the wall figure: the 8-token generate less a 2-token one, over the 6 steps between them
    assert 0 < r["ms_per_step_wall"] * 6 < 1e3 * r["wall_s"]
    # tiny: 2 layers, 2 KV heads of 32, fp32 on CPU; 2 sequences at a mean context of 16 + 8 / 2 tokens
    assert r["kv_bytes_per_step"] == 2 * 2 * 2 * 32 * 4 * (16 + 4) * 2
    # every projection, norm and the untied head, fp32: hidden 64, q 4 x 32, kv 2 x 32, mlp 128, vocab 512
    per_layer = 64 * (128 + 2 * 64) + 128 * 64 + 64 * 2 * 128 + 128 * 64 + 2 * 64
    assert r["weight_bytes"] == 4 * (2 * per_layer + 64 + 512 * 64) and r["quant"] == "bf16"


def test_profile_engine_decode_on_cpu(tiny_llm):
    p = kernel_profile.profile_engine_decode(tiny_llm, batch=2, prompt_len=16, steps=4, warm_steps=1).to_dict()
    assert p["activity"] == "cpu" and p["steps_asked"] == 4 and "warning" not in p
    assert p["context_len"] == 16 + 1 + 2                      # the prompt, the warm step, the profiler's 2 warm-up
    check_profile(p, steps=4)
    # each decode step multiplies through both layers' weights: at least one matmul launch per layer per step
    mm = {k["name_full"]: k for k in p["kernels"]}["aten::mm"]
    assert mm["launches_per_step"] >= 2
    assert not tiny_llm.engine.has_unfinished_requests()       # the profile's requests were aborted
    md = report.render_markdown(DecodeResult.from_dict({"engine": [], "profiles": [dict(p, step_us_timed=123.0)]}))
    assert "123.0 us/step in the timed run" in md
    [table] = md_tables(md, "| kernel |")
    check_profile_markdown(md, table, p)


def kernel_table(events: list[dict], steps: int, on_device: bool) -> list[dict]:
    """The kernel table's rows as they land in the JSON."""
    return [r.to_dict() for r in kernel_profile.kernel_table(events, steps, on_device)]


def test_kernel_table_self_time_and_device_events():
    nested = [  # aten::linear [0, 10) holds aten::mm [2, 6); another thread's op overlaps but is not nested
        {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 1, "tid": 1, "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 2.0, "dur": 4.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 2, "ts": 3.0, "dur": 1.0},
        {"ph": "X", "cat": "user_annotation", "name": kernel_profile.STEP_MARK, "pid": 1, "tid": 1, "ts": 0.0,
         "dur": 12.0},
    ]
    rows = {r["name_full"]: r["us_per_step"] for r in kernel_table(nested, steps=2, on_device=False)}
    assert rows == {"aten::linear": 3.0, "aten::mm": 2.0, "aten::add": 0.5}
    dev = [{"ph": "X", "cat": "kernel", "name": "k1", "ts": 0, "dur": 5.0},
           {"ph": "X", "cat": "kernel", "name": "k1", "ts": 9, "dur": 3.0},
           {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "ts": 20, "dur": 1.0},
           {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 50.0}]
    rows = kernel_table(dev, steps=2, on_device=True)
    assert [(r["kernel"], r["us_per_step"], r["launches_per_step"]) for r in rows] == [
        ("k1", 4.0, 1.0), ("Memcpy HtoD (Pageable -> Device)", 0.5, 0.5)]
    # the device timeline: device activity spans [0, 21) over 2 steps, 4.5 us/step of it busy, 6 idle; CPU ops and a
    # host-side step time never enter it
    assert kernel_profile.device_step_us(dev, steps=2) == 10.5
    assert kernel_profile.device_step_us(nested, steps=2) is None


def test_device_busy_time_counts_overlapping_kernels_once():
    """Under PDL a kernel's interval starts before the one before it ends: busy time is their union, so the idle
    time (timeline less busy) cannot go negative."""
    ev = lambda ts, dur: {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}     # noqa: E731
    trace = [ev(0.0, 10.0), ev(8.0, 10.0), ev(30.0, 5.0), ev(31.0, 2.0)]                    # [0, 18) and [30, 35)
    assert kernel_profile.device_busy_us(trace, steps=1) == 23.0
    assert kernel_profile.device_step_us(trace, steps=1) == 35.0
    assert sum(e["dur"] for e in trace) == 27.0                                              # the sum counts 4 twice
    assert kernel_profile.device_busy_us([], steps=1) is None


def test_own_time_charges_a_pdl_wait_to_the_kernel_still_running():
    """A kernel launched under PDL starts while the one before it drains and waits for it: its duration counts the
    wait. Own time charges the overlap to the kernel started first, so own times sum to the busy time and a
    kernel's own time is the part of the timeline it alone holds."""
    ev = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    # gemv [0, 10); attention launched at 8 waits for it, runs to 12; a copy nested in [30, 35); a gap before it
    trace = [ev("gemv", 0.0, 10.0), ev("attn", 8.0, 4.0), ev("gemv", 30.0, 5.0), ev("copy", 31.0, 2.0)]
    rows = {r["name_full"]: r for r in kernel_table(trace, steps=1, on_device=True)}
    assert {n: (r["us_per_step"], r["own_us_per_step"]) for n, r in rows.items()} == {
        "gemv": (15.0, 15.0), "attn": (4.0, 2.0), "copy": (2.0, 0.0)}
    assert sum(r["own_us_per_step"] for r in rows.values()) == kernel_profile.device_busy_us(trace, steps=1) == 17.0
    # over two steps, per step; listed in any order, the same
    rows = {r["name_full"]: r["own_us_per_step"] for r in kernel_table(trace[::-1], steps=2, on_device=True)}
    assert rows == {"gemv": 7.5, "attn": 1.0, "copy": 0.0}
    # CPU ops have no own time (self time already excludes what is nested)
    cpu = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 0.0, "dur": 3.0}]
    assert kernel_table(cpu, steps=1, on_device=False)[0].get("own_us_per_step") is None


def test_profile_markdown_shows_the_device_timeline():
    p = KernelProfile(model="m", quant="bf16", batch=8, activity="cuda", steps=16, context_len=1024,
                      step_us_measured=4204.0, kernel_us_per_step=4768.0, gap_us_per_step=-564.0,
                      num_kernel_names=1, device_step_us=4800.0, device_idle_us_per_step=32.0,
                      kernels=[KernelRow(kernel="k", name_full="k", us_per_step=4768.0, launches_per_step=1.0,
                                         share_of_step=4768.0 / 4204.0)])
    md = report.render_markdown(DecodeResult.from_dict({"engine": [], "profiles": [p.to_dict()]}))
    assert "device timeline 4800.0 us/step: kernels 4768.0, idle 32.0 us/step (0.7%)" in md
    # shares written before share_basis existed are of the host's step; a device-based profile says so
    assert "| % of step |" in md and "(device)" not in md
    p.share_basis = "device"
    md = report.render_markdown(DecodeResult.from_dict({"engine": [], "profiles": [p.to_dict()]}))
    assert "| % of step (device) |" in md


def test_timeline_warnings_bound_kernels_by_the_device_timeline():
    """Async scheduling (2026-12-02, H200, MXFP4 c1): kernels 2,578 us/step, host step 2,171, device timeline
    2,754. The host's step is no bound there: no warning. Kernels past the device timeline are a contradiction."""
    assert kernel_profile.timeline_warnings(2578.0, 2171.0, 2754.0) == []
    bad = kernel_profile.timeline_warnings(3000.0, 3100.0, 2754.0)
    assert len(bad) == 1 and "exceeds the device timeline (2754 us/step)" in bad[0]
    # kernels that overlap (PDL): the warning says by how much, from the union of their intervals
    assert "overlap by 300 us/step (PDL launches early)" in kernel_profile.timeline_warnings(3000.0, 3100.0, 2754.0,
                                                                                            2700.0)[0]
    # no device timeline: the host's step is the only bound left, and the note says why it may not hold
    assert kernel_profile.timeline_warnings(2578.0, 2700.0, None) == []
    assert "async scheduling" in kernel_profile.timeline_warnings(2578.0, 2171.0, None)[0]


def test_short_kernel_name():
    s = kernel_profile.short_kernel_name
    assert s("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<int>, "
             "at::detail::Array<char*, 1> >(int, at::native::FillFunctor<int>, at::detail::Array<char*, 1>)"
             ) == "vectorized_elementwise_kernel<4, FillFunctor<int>, Array<char*, 1>>"
    assert s("_paged_decode_kernel") == "_paged_decode_kernel" and s("aten::mm") == "aten::mm"
    assert s("Memcpy HtoD (Pageable -> Device)") == "Memcpy HtoD (Pageable -> Device)"
    long = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas"
    short = s(long)
    assert len(short) == kernel_profile.KERNEL_NAME_MAX and short.startswith("sm90_xmma_gemm_bf16bf16")
    assert short.endswith("kernel__5x_cublas") and "…" in short


def _synthetic_result():
    eng = lambda q, b, ms: {"model": "qwen3-8b", "quant": q, "batch": b, "ms_per_step": ms, "floor_ms": 3.6,  # noqa: E731
                            "frac_of_floor": 3.6 / ms}
    return {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "date": "2026-12-01", "complete": True,
            "copy_bandwidth_gbs": 4200.0, "prompt_len": 1024, "gen_len": 128,
            "engine": [dict(eng("bf16", 1, 5.0), ms_per_step_wall=4.6, frac_of_floor_wall=3.6 / 4.6),
                       eng("bf16", 8, 6.0), eng("mxfp4", 1, 3.0),
                       {"model": "qwen3-8b", "quant": "mxfp4", "batch": 8, "error": "RuntimeError: boom"}],
            "hf_transformers_compiled": [
                {"model": "qwen3-8b", "batch": 1, "ms_per_step": 10.0, "transformers": "5.17.0", "reps": 3,
                 "compile": "generate auto-compile: static cache + CompileConfig(mode='reduce-overhead', "
                            "fullgraph=True)"},
                {"model": "qwen3-8b", "batch": 8, "error": "RuntimeError: compile failed", "transformers": "5.17.0",
                 "compile": "generate auto-compile: static cache + CompileConfig(mode='reduce-overhead', "
                            "fullgraph=True)"}],
            "profiles": []}


def test_markdown_engine_table_shows_the_json():
    """Every engine row's cells are the JSON's figures; the speed-up is HF ms/step over engine ms/step."""
    result = _synthetic_result()
    result["hf_transformers_compiled"][1] = dict(result["hf_transformers_compiled"][0], batch=8, ms_per_step=7.5)
    [table] = md_tables(report.render_markdown(DecodeResult.from_dict(result)), "| model |")
    hf = {h["batch"]: h["ms_per_step"] for h in result["hf_transformers_compiled"]}
    assert len(table) == len(result["engine"])
    for row, r in zip(table, result["engine"]):
        assert (row["model"], row["quant"], row["concurrency"]) == (r["model"], r["quant"], str(r["batch"]))
        if "error" in r:
            assert row["ms/step"] == f"error: {r['error']}"
            continue
        assert shown(row["ms/step"], r["ms_per_step"], 3) and shown(row["floor ms"], r["floor_ms"], 3)
        assert shown(row["% of floor"], 100 * r["floor_ms"] / r["ms_per_step"], 1)
        if r.get("ms_per_step_wall"):
            assert shown(row["wall ms/step"], r["ms_per_step_wall"], 3)
            assert shown(row["% of floor (wall)"], 100 * r["floor_ms"] / r["ms_per_step_wall"], 1)
        else:                                       # files from before the wall figure: empty cells
            assert row["wall ms/step"] == row["% of floor (wall)"] == ""
        if r["quant"] == "bf16":
            assert shown(row["HF compiled ms/step"], hf[r["batch"]], 3)
            assert shown(row["engine speed-up vs HF"], hf[r["batch"]] / r["ms_per_step"], 2)
        else:
            assert row["HF compiled ms/step"] == row["engine speed-up vs HF"] == ""
    assert [row["engine speed-up vs HF"] for row in table[:2]] == ["2.00×", "1.25×"]


def test_markdown_hf_column_and_ratio():
    md = report.render_markdown(DecodeResult.from_dict(_synthetic_result()))
    rows = {tuple(c.strip() for i, c in enumerate(line.split("|")[1:5]) if i != 2): line
            for line in md.splitlines() if line.startswith("| qwen3-8b")}
    assert all("| base |" in line for line in rows.values())
    assert "HF compiled ms/step" in md and "engine speed-up vs HF" in md
    assert "| 5.000 |" in rows[("qwen3-8b", "bf16", "1")] and rows[("qwen3-8b", "bf16", "1")].endswith(
        "| 10.000 | 2.00× |")
    assert rows[("qwen3-8b", "bf16", "8")].endswith("| error |  |")
    assert rows[("qwen3-8b", "mxfp4", "1")].endswith("|  |  |")          # no HF figure against a quantized row
    assert "error: RuntimeError: boom" in rows[("qwen3-8b", "mxfp4", "8")]
    assert "HF transformers 5.17.0: generate auto-compile" in md and "median of 3" in md
    assert "HF qwen3-8b c8: error: RuntimeError: compile failed" in md
    assert "Incomplete run" not in md
    incomplete = DecodeResult.from_dict(dict(_synthetic_result(), complete=False))
    assert "Incomplete run" in report.render_markdown(incomplete)


def test_unique_stem_and_outputs(tmp_path, monkeypatch):
    out, copy = tmp_path / "results", tmp_path / "OUT"
    copy.mkdir()
    base = "decode-2026-12-01"
    assert report.unique_stem(out, base) == base
    monkeypatch.setenv("OUT", str(copy))
    result = _synthetic_result()
    report.write_outputs(DecodeResult.from_dict(result), out, base)
    assert report.unique_stem(out, base) == base + "-2"
    (out / f"{base}-2.md").write_text("an earlier run's markdown alone still claims the name\n")
    assert report.unique_stem(out, base) == base + "-3"
    for d in (out, copy):
        assert json.loads((d / f"{base}.json").read_text()) == result
        assert (d / f"{base}.md").read_text() == report.render_markdown(DecodeResult.from_dict(result))


RESULT_FILES = sorted((Path(__file__).parents[1] / "bench" / "results").glob("decode-*.json"))


def test_committed_results_are_there():
    assert len(RESULT_FILES) >= 7               # the parametrized read-back below must not pass on no files


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_committed_results_read_back(path):
    """Every committed result file reads into the typed result and writes back key for key; files in the current
    format render the markdown committed beside them (the first run's markdown had no variant column)."""
    data = json.loads(path.read_text())
    result = DecodeResult.from_dict(data)
    assert result.to_dict() == data
    assert result.engine and all(r.error is not None or r.ms_per_step > 0 for r in result.engine)
    if "variants" in data:
        assert report.render_markdown(result) == path.with_suffix(".md").read_text()


def test_result_keys_are_checked_on_reading():
    row = {"model": "qwen3-8b", "quant": "bf16", "batch": 1, "ms_per_stepp": 5.0}
    with pytest.raises(ValueError, match="EngineTiming has no field 'ms_per_stepp'"):
        DecodeResult.from_dict({"engine": [row]})


def test_model_specs_error_names_the_bad_value():
    assert decode_cli.parse_model_specs("qwen3-8b:bf16, tiny:mxfp4") == [("qwen3-8b", "bf16"), ("tiny", "mxfp4")]
    with pytest.raises(ValueError, match="'qwen3-8b'"):
        decode_cli.parse_model_specs("qwen3-8b")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-host refusal")
def test_main_refuses_without_cuda(tmp_path):
    assert decode.main(str(tmp_path), ["--hf", "--profile"]) == 2
    assert not list(tmp_path.iterdir())


@pytest.fixture
def cpu_stand_ins(monkeypatch, tmp_path):
    """main() on CPU: the GPU-only pieces stood in for (CUDA probes, copy bandwidth), engines and HF built on CPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu-stand-in")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(common, "copy_bandwidth_gbs", lambda: 100.0)
    build = engine_timing.build_llm
    bounds = []

    def cpu_build(model, quant, n, levers, max_model_len):
        bounds.append(max_model_len)             # the --max-model-len flag reaches the engine (None: its default)
        return build(model, quant, n, levers, device="cpu", backend="torch", num_kv_blocks=64, max_model_len=256)
    monkeypatch.setattr(engine_timing, "build_llm", cpu_build)
    hf = hf_baseline.hf_decode_ms
    monkeypatch.setattr(hf_baseline, "hf_decode_ms", lambda *a, **k: hf(*a, **dict(k, device="cpu", compile=False)))
    monkeypatch.setenv("OUT", str(tmp_path / "OUT"))
    (tmp_path / "OUT").mkdir()
    monkeypatch.engine_bounds = bounds
    return monkeypatch


def test_main_orchestration_on_cpu(tmp_path, cpu_stand_ins):
    """Every figure lands in the JSON, HF only for bf16 specs, a failing part is recorded and the rest goes on."""
    from vtengine import cli
    argv = ["--models", "tiny:bf16,tiny:mxfp4,tiny:int3", "--batches", "1,2", "--prompt-len", "16", "--gen-len", "8",
            "--hf", "--hf-reps", "2", "--profile", "--profile-steps", "3"]
    assert cli.main(["bench", "decode", "--out", str(tmp_path / "res")] + argv) == 0
    [path] = (tmp_path / "res").glob("decode-*.json")
    res = json.loads(path.read_text())
    assert res["complete"] and res["copy_bandwidth_gbs"] == 100.0 and "interrupted" not in res
    assert cpu_stand_ins.engine_bounds == [None] * 3          # one engine per spec, at the engine's own bound
    eng = {(r["model"], r["quant"], r["batch"]): r for r in res["engine"]}
    for q in ("bf16", "mxfp4"):
        for b in (1, 2):
            r = eng[("tiny", q, b)]
            assert r["ms_per_step"] > 0 and r["decode_steps"] == 8 - 1 and r["max_model_len"] == 256
            # the floor: every weight and the K/V read once at the stand-in's 100 GB/s
            assert r["floor_ms"] == pytest.approx(1e3 * (r["weight_bytes"] + r["kv_bytes_per_step"]) / 100e9)
            assert r["frac_of_floor"] == pytest.approx(r["floor_ms"] / r["ms_per_step"])
        assert eng[("tiny", q, 2)]["kv_bytes_per_step"] == 2 * eng[("tiny", q, 1)]["kv_bytes_per_step"]
    # 4-bit projections: the quantized model reads fewer weight bytes than the dense one
    assert eng[("tiny", "mxfp4", 1)]["weight_bytes"] < eng[("tiny", "bf16", 1)]["weight_bytes"]
    assert "int3" in eng[("tiny", "int3", 1)]["error"] and "int3" in eng[("tiny", "int3", 2)]["error"]
    hf = res["hf_transformers_compiled"]
    assert [(h["model"], h["batch"], h["reps"]) for h in hf] == [("tiny", 1, 2), ("tiny", 2, 2)]
    for h in hf:
        figures = hf_figures(h)
        assert {k: h[k] for k in figures} == pytest.approx(figures)
    prof = [p for p in res["profiles"] if "error" not in p]
    assert [(p["quant"], p["batch"]) for p in prof] == [("bf16", 1), ("bf16", 2), ("mxfp4", 1), ("mxfp4", 2)]
    for p in prof:
        check_profile(p, steps=3)
        assert p["step_us_timed"] == pytest.approx(1e3 * eng[("tiny", p["quant"], p["batch"])]["ms_per_step"])
    md = path.with_suffix(".md").read_text()
    assert "context bound (max_model_len) 256\n" in md
    [engine_table] = md_tables(md, "| model |")
    rows = {(row["quant"], row["concurrency"]): row for row in engine_table}
    for b, h in zip((1, 2), hf):
        r = eng[("tiny", "bf16", b)]
        assert shown(rows[("bf16", str(b))]["ms/step"], r["ms_per_step"], 3)
        assert shown(rows[("bf16", str(b))]["engine speed-up vs HF"], h["ms_per_step"] / r["ms_per_step"], 2)
    kernel_tables = md_tables(md, "| kernel |")
    assert len(kernel_tables) == len(prof) == md.count("sum of kernel time") == 4
    for table, p in zip(kernel_tables, prof):
        check_profile_markdown(md, table, p)
    assert (tmp_path / "OUT" / path.name).read_text() == path.read_text()


def test_main_interrupted_keeps_the_engine_figures(tmp_path, cpu_stand_ins):
    def interrupted(*a, **k):
        raise KeyboardInterrupt          # what a step time limit (SIGINT) raises

    cpu_stand_ins.setattr(hf_baseline, "hf_decode_ms", interrupted)
    argv = ["--models", "tiny:bf16", "--batches", "1", "--prompt-len", "16", "--gen-len", "8", "--hf", "--profile"]
    assert decode.main(str(tmp_path / "res"), argv) == 130
    [path] = (tmp_path / "OUT").glob("decode-*.json")
    res = json.loads(path.read_text())
    assert res["interrupted"] and not res["complete"] and res["engine"][0]["ms_per_step"] > 0
    assert [p["batch"] for p in res["profiles"]] == [1]          # profiled on the timed engine, before HF
    assert "Interrupted run" in path.with_suffix(".md").read_text()


def test_variants_parse_and_run_beside_the_base(tmp_path, cpu_stand_ins):
    assert decode_cli.parse_variants({"gqa_swap": "on"}, ["pdl=on", "pdl=on, triton_gemv=on"]) == [
        ("base", {"gqa_swap": "on"}), ("pdl=on", {"gqa_swap": "on", "pdl": "on"}),
        ("pdl=on,triton_gemv=on", {"gqa_swap": "on", "pdl": "on", "triton_gemv": "on"})]
    with pytest.raises(ValueError, match="'pdl'"):
        decode_cli.parse_variants({}, ["pdl"])
    argv = ["--models", "tiny:bf16", "--batches", "1", "--prompt-len", "16", "--gen-len", "8",
            "--lever", "gqa_swap=on", "--variant", "fast_math=on"]
    assert decode.main(str(tmp_path / "res"), argv) == 0
    [path] = (tmp_path / "res").glob("decode-*.json")
    res = json.loads(path.read_text())
    assert [(r["variant"], r["levers"]) for r in res["engine"]] == [
        ("base", {"async_scheduling": False, "gqa_swap": "on"}),      # the step itself: async pinned off
        ("fast_math=on", {"async_scheduling": False, "gqa_swap": "on", "fast_math": "on"})]
    md = path.with_suffix(".md").read_text()
    assert "| tiny | bf16 | fast_math=on | 1 |" in md and "variant `fast_math=on`" in md
    # the variants' lines say what each engine ran with, the bench's own pin included (never "at their defaults"
    # while async scheduling was pinned off)
    assert "- variant `base`: levers {'async_scheduling': False, 'gqa_swap': 'on'}" in md
    assert "- async scheduling is off in every variant (the bench's pin)" in md
    # a variant with async scheduling on (the engine's default): no such note
    served = dict(res, variants=res["variants"] + [dict(name="async_scheduling=true",
                                                         levers={"async_scheduling": "true"})])
    assert "the bench's pin" not in report.render_markdown(DecodeResult.from_dict(served))


def test_rounds_alternate_the_variants_on_fresh_engines(tmp_path, cpu_stand_ins):
    """--rounds 3: base, variant, then variant, base, then base, variant again, each on an engine built for it; every
    timing keeps its round, the profile runs once, and the markdown's rounds table shows each median, its range and
    the base's median over the variant's, from the JSON's figures."""
    built = []
    build = engine_timing.build_llm
    cpu_stand_ins.setattr(engine_timing, "build_llm", lambda *a, **k: built.append(a[3]) or build(*a, **k))
    argv = ["--models", "tiny:bf16", "--batches", "1", "--prompt-len", "16", "--gen-len", "8", "--profile",
            "--profile-steps", "2", "--variant", "fast_math=on", "--rounds", "3"]
    assert decode.main(str(tmp_path / "res"), argv) == 0
    assert [lv.get("fast_math") for lv in built] == [None, "on", "on", None, None, "on"]
    [path] = (tmp_path / "res").glob("decode-*.json")
    res = json.loads(path.read_text())
    assert [(r["variant"], r["round"]) for r in res["engine"]] == [
        ("base", 0), ("fast_math=on", 0), ("fast_math=on", 1), ("base", 1), ("base", 2), ("fast_math=on", 2)]
    assert [p["variant"] for p in res["profiles"]] == ["base", "fast_math=on"]        # first round only
    ms = {v: sorted(r["ms_per_step"] for r in res["engine"] if r["variant"] == v) for v in ("base", "fast_math=on")}
    md = path.with_suffix(".md").read_text()
    [_, rounds_table] = md_tables(md, "| model |")
    rows = {row["variant"]: row for row in rounds_table}
    assert shown(rows["base"]["ms/step"], ms["base"][1], 3) and rows["base"]["rounds"] == "3"
    assert shown(rows["fast_math=on"]["vs base"], ms["base"][1] / ms["fast_math=on"][1], 3)
    wall = {v: sorted(r["ms_per_step_wall"] for r in res["engine"] if r["variant"] == v) for v in ms}
    assert shown(rows["fast_math=on"]["wall ms/step"], wall["fast_math=on"][1], 3)
    assert shown(rows["fast_math=on"]["vs base (wall)"], wall["base"][1] / wall["fast_math=on"][1], 3)
    with pytest.raises(ValueError, match="--rounds must be >= 1"):
        decode_cli.DecodeArgs.from_namespace(decode_cli.build_parser().parse_args(["--rounds", "0"]))


def test_each_kind_of_bytes_against_its_own_floor():
    """Kernel names map to the bytes they stream (W4A16 before the generic GEMM patterns, norms to none); a tiny
    MXFP4 engine's step bytes split into its quantized projections, its bf16 LM head and K/V; the floors and
    fractions follow from a profile's kernel times, and the markdown tables them."""
    assert kernel_profile.byte_kind("_w4a16_gemm_kernel") == "w4a16_gemm"
    assert kernel_profile.byte_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "dense_gemm"
    assert kernel_profile.byte_kind("_gemv_kernel") == "dense_gemm"
    assert kernel_profile.byte_kind("_decode_kernel") == "decode_attention"
    assert kernel_profile.byte_kind("_add_rms_norm_kernel") is None
    llm = engine_timing.build_llm("tiny", "mxfp4", max_num_seqs=4, levers={}, device="cpu", backend="torch",
                                  num_kv_blocks=64, max_model_len=256)
    eng = llm.engine
    need = kernel_profile.step_bytes(eng, batch=2, context=100)
    cfg = eng.model.cfg
    qbytes = sum(w.nbytes() for L in eng.model.layers for w in (L.qkv, L.o, L.gate_up, L.down))
    assert need["w4a16_gemm"] == qbytes
    assert need["dense_gemm"] == eng.model.lm_head.numel() * eng.model.lm_head.element_size()
    assert need["decode_attention"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4 * 200
    rows = [KernelRow(kernel=n, name_full=n, us_per_step=us, launches_per_step=1.0)
            for n, us in (("_w4a16_gemm_kernel", 10.0), ("_decode_kernel", 2.0), ("_rms_norm_kernel", 1.0))]
    p = KernelProfile(model="tiny", quant="mxfp4", batch=2, context_len=96, steps=8, kernels=rows,
                      step_us_measured=20.0, kernel_us_per_step=13.0, gap_us_per_step=7.0, num_kernel_names=3)
    floors = {f.kind: f for f in kernel_profile.byte_floors(p, eng, copy_gbs=1.0)}
    assert sorted(floors) == ["decode_attention", "w4a16_gemm"]           # no dense GEMM kernel in the profile
    w = floors["w4a16_gemm"]
    assert w.kernels == ["_w4a16_gemm_kernel"] and w.floor_us == pytest.approx(1e6 * qbytes / 1e9)
    assert w.frac_of_floor == pytest.approx(w.floor_us / 10.0)
    for row in rows:
        row.share_of_step = row.us_per_step / 20.0
    p.byte_floors = list(floors.values())
    md = report.render_markdown(DecodeResult.from_dict({"engine": [], "profiles": [p.to_dict()]}))
    assert "| w4a16_gemm | `_w4a16_gemm_kernel` | 10.0 |" in md and "% of floor |" in md
    assert w.own_us_per_step is None and "own us/step" not in md      # a CPU trace, or a file before own times
    # a device trace's own times (the GEMM's 10 us less 2 of PDL wait for the kernel before it): the own
    # fraction of the floor beside the plain one, in the JSON and the markdown
    for row, own in zip(rows, (8.0, 2.0, 1.0)):
        row.own_us_per_step = own
    floors = {f.kind: f for f in kernel_profile.byte_floors(p, eng, copy_gbs=1.0)}
    w = floors["w4a16_gemm"]
    assert w.own_us_per_step == 8.0 and w.frac_of_floor_own == pytest.approx(w.floor_us / 8.0)
    p.byte_floors = list(floors.values())
    back = DecodeResult.from_dict({"engine": [], "profiles": [p.to_dict()]})
    assert back.profiles[0].byte_floors[0].frac_of_floor_own == pytest.approx(floors["w4a16_gemm"].frac_of_floor_own)
    md = report.render_markdown(back)
    assert "| kernel | us/step | own us/step | launches/step |" in md
    assert "| `_w4a16_gemm_kernel` | 10.0 | 8.0 | 1.00 | 50.0% |" in md
    own_pct = f"{100 * w.frac_of_floor_own:.1f}%"
    assert f"| 10.0 | {qbytes / 1e6:.1f} | {w.floor_us:.1f} | {100 * w.frac_of_floor:.1f}% | 8.0 | {own_pct} |" in md


def test_profiling_prints_no_kineto_lines():
    """A profiled campaign gate or bench prints none of Kineto's "USDT: ... profiler_start/stop" lines (torch 2.13
    writes two per session to stderr): quiet_profiler sets Kineto's log level above them before the session."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    session = ("import torch\nfrom torch.profiler import profile\n"
               "with profile(): torch.ones(3) + 1\nprint('ok')\n")
    quiet = subprocess.run([sys.executable, "-c", "from vtengine.bench.common import quiet_profiler\n"
                            "quiet_profiler()\n" + session], capture_output=True, text=True, timeout=120,
                           env=env)
    assert quiet.returncode == 0 and quiet.stdout == "ok\n", quiet.stderr[-2000:]
    assert "profiler_start" not in quiet.stderr and "USDT" not in quiet.stderr, quiet.stderr[-2000:]
    loud = subprocess.run([sys.executable, "-c", session], capture_output=True, text=True, timeout=120, env=env)
    if "profiler_start" not in loud.stderr:
        pytest.skip(f"torch {torch.__version__} prints no Kineto lines: nothing to silence here")


def test_a_device_stall_in_the_profile_window_is_left_out_and_warned(monkeypatch):
    """The decode bench's profile takes a device-idle gap longer than STALL_STEPS steps out of its device step and
    says so (the campaigns' profile gate does the same: tests/test_attribution.py)."""
    from types import SimpleNamespace
    steps, period, kernel = 16, 6100.0, 5900.0
    events = []
    for i in range(steps):
        shift = 250_000.0 if i >= 9 else 0.0
        events.append({"ph": "X", "cat": "user_annotation", "name": kernel_profile.STEP_MARK,
                       "ts": i * period + shift, "dur": 5600.0})
        events.append({"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "ts": i * period + shift + 5.0,
                       "dur": kernel})
    step_s = [0.0056] * (kernel_profile.PROFILER_WARM_STEPS + steps)
    monkeypatch.setattr(kernel_profile, "record_decode_trace", lambda *a, **k: (events, step_s))
    llm = SimpleNamespace(engine=SimpleNamespace(device=SimpleNamespace(type="cuda"),
                                                 config=SimpleNamespace(model="qwen3-8b", quant="bf16")))
    p = kernel_profile.profile_engine_decode(llm, batch=8, prompt_len=1024, steps=steps)
    assert p.device_step_us == pytest.approx(((steps - 1) * period + kernel - (period - kernel)) / steps)
    assert p.device_idle_us_per_step == pytest.approx((steps - 2) * (period - kernel) / steps)
    assert "device idle 250.2 ms inside the window (1 stall(s) longer than 4 steps)" in p.warning
