"""The decode benchmark's files: <stem>.json (the evidence, ``DecodeResult.to_dict``) and <stem>.md, rendered only
from the result (``render_markdown``), so any committed JSON renders its markdown again."""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from vtengine.bench.common import error_text, unique_stem  # noqa: F401  (decode and prefill name files by it)
from vtengine.bench.decode.results import DecodeResult

MD_TOP_KERNELS = 15                         # kernel rows per profile table; the rest are summed in one row


def _f(x, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def _engine_table(result: DecodeResult) -> list[str]:
    """One row per engine timing; the HF figure and the speed-up (HF ms/step over the engine's) for bf16 rows."""
    hf_by = {(h.model, h.batch): h for h in result.hf_transformers_compiled}
    rounds = any(r.round is not None for r in result.engine)
    wall = any(r.ms_per_step_wall is not None for r in result.engine)      # absent before 2026-12-02's change
    lines = ["| model | quant | variant | " + ("round | " if rounds else "") + "concurrency | ms/step | floor ms | "
             "% of floor | " + ("wall ms/step | % of floor (wall) | " if wall else "")
             + "HF compiled ms/step | engine speed-up vs HF |",
             "|---|---|---|" + ("---|" if rounds else "") + "---|---|---|---|" + ("---|---|" if wall else "")
             + "---|---|"]
    for r in result.engine:
        head = (f"| {r.model} | {r.quant} | {'base' if r.variant is None else r.variant} | "
                + (f"{r.round} | " if rounds else "") + f"{r.batch} ")
        if r.error is not None:
            lines.append(head + f"| error: {r.error[:120]} | | | | " + ("| | " if wall else "") + "|")
            continue
        h = hf_by.get((r.model, r.batch)) if r.quant == "bf16" else None
        hf_cell = ratio = ""
        if h is not None and h.ms_per_step:
            hf_cell, ratio = f"{h.ms_per_step:.3f}", f"{h.ms_per_step / r.ms_per_step:.2f}×"
        elif h is not None:
            hf_cell = "error"
        frac_pct = 100 * r.frac_of_floor if r.frac_of_floor is not None else None
        wall_pct = 100 * r.frac_of_floor_wall if r.frac_of_floor_wall is not None else None
        wall_cells = (f"{_f(r.ms_per_step_wall)} | {'' if wall_pct is None else _f(wall_pct, '.1f') + '%'} | "
                      if wall else "")
        lines.append(head + f"| {r.ms_per_step:.3f} | {_f(r.floor_ms)} | {_f(frac_pct, '.1f')}% | {wall_cells}"
                     f"{hf_cell} | {ratio} |")
    return lines


def _rounds_table(result: DecodeResult) -> list[str]:
    """With ``--rounds``: per (model, quant, variant, concurrency) the median over the rounds of the step timer's
    ms/step and of the wall ms/step, the step timer's range, and the base's medians over the variant's (> 1: the
    variant is faster); the base's own range says how far apart two builds of one configuration land."""
    groups: dict[tuple, list] = {}
    for r in result.engine:
        if r.round is not None and r.ms_per_step is not None:
            groups.setdefault((r.model, r.quant, r.variant or "base", r.batch), []).append(r)
    if not groups:
        return []

    def median(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else None

    def ratio(a, b):
        return f"{a / b:.3f}×" if a and b else ""
    lines = ["", "Over the rounds (medians; base / variant > 1: the variant is faster):", "",
             "| model | quant | variant | concurrency | rounds | ms/step | min-max | spread | vs base | wall ms/step "
             "| vs base (wall) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, quant, variant, batch), rows in groups.items():
        xs, walls = [r.ms_per_step for r in rows], [r.ms_per_step_wall for r in rows]
        base = groups.get((model, quant, "base", batch), [])
        mb, mbw = median([r.ms_per_step for r in base]), median([r.ms_per_step_wall for r in base])
        m, mw = median(xs), median(walls)
        lines.append(f"| {model} | {quant} | {variant} | {batch} | {len(xs)} | {m:.3f} | {min(xs):.3f}-{max(xs):.3f} "
                     f"| {100 * (max(xs) - min(xs)) / m:.1f}% | {ratio(mb, m)} | {_f(mw)} | {ratio(mbw, mw)} |")
    return lines


def _hf_notes(result: DecodeResult) -> list[str]:
    """How HF was timed (from its first measured row), and what went differently for any of its rows."""
    hf = result.hf_transformers_compiled
    h0 = next((h for h in hf if h.ms_per_step is not None), hf[0])
    lines = ["", f"HF transformers {h0.transformers}: {h0.compile}; bf16, random weights; "
             f"ms/step = median of {h0.reps} x (t(generate {result.gen_len}) - t(generate 2)) / "
             f"{(result.gen_len or 0) - 2}. speed-up = HF ms/step / engine ms/step."]
    for h in hf:
        notes = []
        if h.compile != h0.compile:
            notes.append(f"compile: {h.compile}")
        if h.fullgraph_error:
            notes.append(f"fullgraph=True failed ({h.fullgraph_error[:160]})")
        if (h.dynamo_graphs_compiled or 0) > 1:
            notes.append(f"{h.dynamo_graphs_compiled} dynamo graphs (graph breaks or recompiles)")
        if h.cudagraph_skips:
            notes.append(f"{h.cudagraph_skips} CUDA-graph skip(s): HF ran partly without graphs")
        if h.error:
            notes.append(f"error: {h.error[:200]}")
        if notes:
            lines.append(f"- HF {h.model} c{h.batch}: " + "; ".join(notes))
    return lines


def _profile_section(p) -> list[str]:
    """One profile: the kernel-time vs step-time line, then the top ``MD_TOP_KERNELS`` kernels and the rest."""
    title = f"### {p.model} {p.quant} [{'base' if p.variant is None else p.variant}] c{p.batch}"
    if p.error is not None:
        return [title, "", f"profile failed: {p.error[:300]}", ""]
    timed = p.step_us_timed
    lines = [f"{title}: {p.steps} decode steps at context ~{p.context_len}", "",
             f"sum of kernel time {p.kernel_us_per_step:.1f} us/step vs measured step time "
             f"{p.step_us_measured:.1f} us/step (under the profiler"
             + (f"; {timed:.1f} us/step in the timed run" if timed else "")
             + f"): gap {p.gap_us_per_step:.1f} us/step "
             f"({100 * p.gap_us_per_step / p.step_us_measured:.1f}%) = launch gaps, idle device, host work; "
             f"{p.num_kernel_names} kernel names", ""]
    if p.device_step_us is not None:
        lines += [f"device timeline {p.device_step_us:.1f} us/step: kernels {p.kernel_us_per_step:.1f}, idle "
                  f"{p.device_idle_us_per_step:.1f} us/step ({100 * p.device_idle_us_per_step / p.device_step_us:.1f}%)"
                  " between kernels and between steps", ""]
    if p.warning:
        lines += [f"**warning**: {p.warning}", ""]
    # own time (device traces from 2026-12-07): a kernel's time less its wait for the one before it under PDL
    own = bool(p.kernels) and all(k.own_us_per_step is not None for k in p.kernels)
    if own:
        lines += ["own us/step: a kernel's time less what of it overlaps kernels started before it (under PDL a "
                  "kernel starts early and waits for the one before; that wait is the earlier kernel's time). Own "
                  "times, every kernel's, sum to the device's busy time.", ""]
    lines += ["| kernel | us/step |" + (" own us/step |" if own else "") + " launches/step | % of step"
              + (" (device)" if p.share_basis == "device" else "") + " |", "|---|---|" + ("---|" if own else "")
              + "---|---|"]
    for k in p.kernels[:MD_TOP_KERNELS]:
        lines.append(f"| `{k.kernel}` | {k.us_per_step:.1f} |" + (f" {k.own_us_per_step:.1f} |" if own else "")
                     + f" {k.launches_per_step:.2f} | {100 * k.share_of_step:.1f}% |")
    rest = p.kernels[MD_TOP_KERNELS:]
    other_us = sum(k.us_per_step for k in rest) + (p.kernels_other.us_per_step if p.kernels_other else 0.0)
    if other_us:
        basis = p.device_step_us if p.share_basis == "device" else p.step_us_measured      # as the rows above
        lines.append(f"| ({p.num_kernel_names - MD_TOP_KERNELS} others) | {other_us:.1f} |" + (" |" if own else "")
                     + f" | {100 * other_us / basis:.1f}% |")
    lines.append("")
    if p.byte_floors:
        own = all(f.own_us_per_step is not None for f in p.byte_floors)
        lines += ["Each kind of bytes against its own floor (bytes / copy bandwidth):", "",
                  "| bytes | kernels | us/step | MB/step | floor us | % of floor |"
                  + (" own us/step | own % of floor |" if own else ""),
                  "|---|---|---|---|---|---|" + ("---|---|" if own else "")]
        for f in p.byte_floors:
            lines.append(f"| {f.kind} | {', '.join(f'`{k}`' for k in f.kernels[:4])}"
                         f"{' ...' if len(f.kernels) > 4 else ''} | {f.us_per_step:.1f} | "
                         f"{f.bytes_per_step / 1e6:.1f} | {_f(f.floor_us, '.1f')} | "
                         f"{_f(None if f.frac_of_floor is None else 100 * f.frac_of_floor, '.1f')}% |"
                         + (f" {f.own_us_per_step:.1f} | "
                            f"{_f(None if f.frac_of_floor_own is None else 100 * f.frac_of_floor_own, '.1f')}% |"
                            if own else ""))
        lines.append("")
    return lines


def render_markdown(result: DecodeResult) -> str:
    """The markdown view of a result (the JSON is the evidence; this is rendered only from it). A result file read
    back renders through ``DecodeResult.from_dict``."""
    lines = [f"# decode benchmark — {result.device}, torch {result.torch}, triton {result.triton}, {result.date}", ""]
    if result.interrupted:
        lines += ["**Interrupted run** (a time limit stopped it): what is here was measured, the rest was not.", ""]
    elif result.complete is False:
        lines += ["**Incomplete run**: written before the run ended (what is here was measured).", ""]
    bounds = sorted({r.max_model_len for r in result.engine if r.max_model_len})
    lines += [f"copy bandwidth {_f(result.copy_bandwidth_gbs, '.0f')} GB/s; prompt {result.prompt_len}, "
              f"{result.gen_len} new tokens; ms per decode step (CUDA graphs)"
              + (f"; context bound (max_model_len) {', '.join(map(str, bounds))}" if bounds else ""), ""]
    for v in result.variants or []:
        lines.append(f"- variant `{v.name}`: levers {v.levers or 'at their defaults'}")
    pinned = [v.name for v in result.variants or [] if (v.levers or {}).get("async_scheduling") is False]
    if pinned and len(pinned) == len(result.variants):
        lines.append("- async scheduling is off in every variant (the bench's pin): each step waits for the host's "
                     "sampling and input preparation. The engine's default, on, runs the steps back to back on the "
                     "device (on 2026-12-02, ×1.105 faster at c1 bf16): time it with `--variant "
                     "async_scheduling=true` before reading a bar on the defaults")
    lines += [""] + _engine_table(result) + _rounds_table(result)
    if result.hf_transformers_compiled:
        lines += _hf_notes(result)
    if result.profiles:
        lines += ["", "## Where the decode step goes (torch.profiler)", ""]
        for p in result.profiles:
            lines += _profile_section(p)
    return "\n".join(lines).rstrip() + "\n"


def write_outputs(result: DecodeResult, out_dir: Path, stem: str) -> None:
    """Write <stem>.json and .md to ``out_dir`` and, when $OUT is set, to $OUT as well (never raises for $OUT)."""
    text = json.dumps(result.to_dict(), indent=2, default=str) + "\n"
    try:
        md = render_markdown(result)
    except Exception as e:                              # the view must never cost the evidence
        md = f"# decode benchmark\n\nthe markdown could not be rendered ({error_text(e)}); the JSON holds the results\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(text)
    (out_dir / f"{stem}.md").write_text(md)
    if os.environ.get("OUT"):
        try:
            Path(os.environ["OUT"], f"{stem}.json").write_text(text)
            Path(os.environ["OUT"], f"{stem}.md").write_text(md)
        except OSError as e:
            print(f"could not copy the results to $OUT: {error_text(e)}", flush=True)
