"""End-to-end decode benchmark: ms per decode step at concurrency 1 and 8 through the full engine (paged cache,
CUDA graphs, Triton kernels), as a fraction of the bandwidth floor, against HF transformers (static cache +
torch.compile) measured in the same run, and where the step's time goes kernel by kernel.

    vtengine bench decode [--out DIR] [--models qwen3-8b:bf16,...] [--batches 1,8] [--hf] [--profile]

Definitions:
- engine ms/step = the engine's own decode-step wall time (``decode_time_s_sum / decode_steps_total`` over one
  ``generate`` of ``gen_len`` tokens after a warm-up; each step ends on the sampler's host copy, so it includes host
  work, the CUDA-graph replay and sampling).
- floor per step = (bytes of every weight read once + K/V bytes of every sequence's mean context) / measured copy
  bandwidth (device-to-device copy, bytes read + written).
- HF ms/step = median over ``--hf-reps`` of (t(generate gen_len tokens) - t(generate 2 tokens)) / (gen_len - 2):
  the steady decode step, prefill and the once-per-``generate`` costs of the decode loop (a fresh static cache,
  the compiled call's first dispatch) cancelled out, as the engine's figure excludes its graph capture.
  ``ms_per_step_from_1tok`` keeps the earlier definition, (t(gen_len) - t(1)) / (gen_len - 1). HF runs for every
  bf16 model spec, random weights at the preset's shapes, bf16, one freshly loaded model per concurrency.
- profile (``--profile``): ``profile_steps`` decode steps of the engine under torch.profiler (after warm steps),
  device time summed by kernel name: us per step, launches per step, share of the measured step (the step's
  wall time under the profiler). sum of kernel time < step time; the difference is launch gaps, idle device time
  and host work.

Order: every engine configuration is timed and then (``--profile``) profiled on the same engine; HF comes last.
The result files are rewritten after each figure, so a failure or a kill in an optional part never loses the
figures already taken.
Writes OUT_DIR/decode-<date>.json and .md (decode-<date>-2... when a run of the same day is there), and copies
both to $OUT when that is set.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

PROMPT_TOKEN_RANGE = (16, 30000)            # random prompt ids, clipped to the vocabulary
STEP_MARK = "vtengine_decode_step"          # record_function range around each profiled engine step
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")   # Kineto trace categories of device activity
KERNEL_NAME_MAX = 80
MD_TOP_KERNELS = 15
JSON_MAX_KERNELS = 60


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 20."""
    import triton.testing
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _random_prompts(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    hi = min(PROMPT_TOKEN_RANGE[1], vocab_size)
    return [torch.randint(PROMPT_TOKEN_RANGE[0], hi, (prompt_len,), generator=g).tolist() for _ in range(batch)]


# -- the engine ------------------------------------------------------------------------------------------------
def build_llm(model: str, quant: str, max_num_seqs: int, levers: dict, device: str = "cuda", **engine_kwargs):
    """One engine for every concurrency of a (model, quant): graphs are captured up to ``max_num_seqs``."""
    from vtengine.engine.llm import LLM
    kw = dict(max_model_len=4096, gpu_memory_utilization=0.6) if device == "cuda" else {}
    kw.update(engine_kwargs)
    return LLM(model=model, quant=quant, levers=levers, device=device, max_num_seqs=max_num_seqs, **kw)


def engine_decode_ms(llm, batch: int, prompt_len: int, gen_len: int) -> dict:
    """Time one ``generate`` of ``gen_len`` tokens for ``batch`` sequences (after a short warm-up)."""
    from vtengine.engine.sampling_params import SamplingParams
    eng = llm.engine
    cfg = eng.model_config
    prompts = _random_prompts(batch, prompt_len, cfg.vocab_size)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))      # warm-up
    st0 = dict(eng.stats())
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    st = eng.stats()
    steps = st["decode_steps_total"] - st0["decode_steps_total"]
    dec_s = st["decode_time_s_sum"] - st0["decode_time_s_sum"]
    if steps < 1 or dec_s <= 0:
        raise RuntimeError(f"no decode steps were timed ({steps} steps, {dec_s} s)")
    ctx_mean = prompt_len + gen_len / 2
    kv_elem = torch.finfo(eng.dtype).bits // 8
    kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem) * ctx_mean * batch
    peak = torch.cuda.max_memory_allocated() / 2**30 if eng.device.type == "cuda" else 0.0
    return {"model": eng.config.model, "quant": eng.config.quant, "batch": batch, "levers": dict(eng.config.levers),
            "decode_steps": steps, "ms_per_step": 1e3 * dec_s / steps, "wall_s": wall,
            "weight_bytes": eng.model.weight_bytes(), "kv_bytes_per_step": kv_bytes, "peak_gib": peak}


# -- per-kernel profile --------------------------------------------------------------------------------------------
def short_kernel_name(name: str, max_len: int = KERNEL_NAME_MAX) -> str:
    """A readable kernel name: C++ kernels lose 'void', their argument list and namespace qualifiers; what is still
    too long keeps its head and tail (cuBLAS names carry the tile shape in the middle, the variant at the end)."""
    s = name.strip()
    if s.startswith("void ") or ("::" in s and re.search(r"[<( ]", s)):    # a C++ signature, not aten::mm
        s = s.removeprefix("void ")
        if s.endswith(")"):                             # drop the argument list: the ( matching the last )
            depth = 0
            for i in range(len(s) - 1, -1, -1):
                depth += {")": 1, "(": -1}.get(s[i], 0)
                if depth == 0:
                    s = s[:i] if i > 0 else s
                    break
        s = re.sub(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::", "", s)
        s = re.sub(r"\s*>\s*>", ">>", s).strip()
    s = re.sub(r"\s+", " ", s)
    if len(s) > max_len:
        tail = max_len // 3
        s = s[:max_len - tail - 1] + "…" + s[-tail:]
    return s


def _self_times_us(ops: list[dict]) -> list[float]:
    """Self time of each CPU op (its duration less that of the ops nested directly inside it, per thread)."""
    order = sorted(range(len(ops)), key=lambda i: (ops[i].get("pid"), ops[i].get("tid"), ops[i]["ts"], -ops[i]["dur"]))
    self_us = [float(op["dur"]) for op in ops]
    stack: list[int] = []
    for i in order:
        op = ops[i]
        while stack:
            top = ops[stack[-1]]
            same_thread = (top.get("pid"), top.get("tid")) == (op.get("pid"), op.get("tid"))
            if same_thread and op["ts"] < top["ts"] + top["dur"]:
                break
            stack.pop()
        if stack:
            self_us[stack[-1]] -= float(op["dur"])
        stack.append(i)
    return [max(0.0, t) for t in self_us]


def kernel_table(trace_events: list[dict], steps: int, on_device: bool) -> list[dict]:
    """Aggregate a Kineto trace by kernel name: us per step, launches per step, sorted by time.

    On a GPU the "kernels" are device activities (kernels, memcpy, memset); on CPU they are CPU ops by self time."""
    if on_device:
        acts = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATS]
        times = [float(e["dur"]) for e in acts]
    else:
        acts = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
        times = _self_times_us(acts)
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e, us in zip(acts, times):
        total[e["name"]] = total.get(e["name"], 0.0) + us
        count[e["name"]] = count.get(e["name"], 0) + 1
    rows = [{"kernel": short_kernel_name(n), "name_full": n, "us_per_step": total[n] / steps,
             "launches_per_step": count[n] / steps} for n in total]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def profile_engine_decode(llm, batch: int, prompt_len: int, steps: int = 16, warm_steps: int = 3) -> dict:
    """Profile ``steps`` decode steps of ``batch`` sequences at context ~``prompt_len`` on a built engine.

    The engine is driven step by step: requests are added, stepped until every sequence is past its prefill (has
    its first token and none waits), ``warm_steps`` decode steps run, then the profiler (2 of its own warm-up steps,
    then ``steps`` recorded ones). Every one of those steps must decode all ``batch`` sequences (no prefill, no
    preemption), or this raises. Leaves the engine idle (the requests are aborted)."""
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    from vtengine.engine.sampling_params import SamplingParams
    eng = llm.engine
    on_device = eng.device.type == "cuda"
    if eng.has_unfinished_requests():
        raise RuntimeError("profile_engine_decode needs an idle engine")
    prof_warm = 2
    params = SamplingParams(max_tokens=warm_steps + prof_warm + steps + 4, temperature=0.0, ignore_eos=True)
    rids = [f"profile-{i}" for i in range(batch)]
    for rid, prompt in zip(rids, _random_prompts(batch, prompt_len, eng.model_config.vocab_size)):
        eng.add_request(rid, prompt, params)

    def decode_step() -> float:
        n0 = eng.stats()["decode_steps_total"]
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if eng.stats()["decode_steps_total"] != n0 + 1 or len(outs) != batch or any(o.finished for o in outs):
            raise RuntimeError(f"a profiled step was not a decode of all {batch} sequences "
                               f"({len(outs)} outputs; preemptions {eng.scheduler.num_preemptions})")
        return dt

    trace: dict = {}

    def keep_trace(p) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp, "trace.json")
            p.export_chrome_trace(str(path))
            trace["events"] = json.loads(path.read_text()).get("traceEvents", [])

    try:
        for _ in range(8 * batch + 8):                  # prefill (one batch, or a few if the token budget splits it)
            if not eng.scheduler.waiting and all(eng.seqs[r].num_completion_tokens >= 1 for r in rids):
                break
            eng.step()
        else:
            raise RuntimeError("the sequences did not all get past prefill")
        for _ in range(warm_steps):
            decode_step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
        step_s = []
        with profile(activities=activities, schedule=schedule(wait=0, warmup=prof_warm, active=steps, repeat=1),
                     on_trace_ready=keep_trace) as prof:
            for _ in range(prof_warm + steps):
                with record_function(STEP_MARK):
                    step_s.append(decode_step())
                prof.step()
        _sync(eng.device)
    finally:
        for rid in rids:
            eng.abort_request(rid)
    events = trace.get("events")
    if not events:
        raise RuntimeError("the profiler returned no trace")
    marks = [e for e in events if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"]
    warnings = []
    if len(marks) != steps:                             # kept, not raised: the table is still worth having
        warnings.append(f"the trace holds {len(marks)} profiled steps, {steps} were asked")
    rows = []
    if marks:
        # only activity inside the recorded steps (a step ends on the sampler's sync, so its kernels are done);
        # Kineto puts device and host times on one clock
        lo, hi = min(e["ts"] for e in marks), max(e["ts"] + e["dur"] for e in marks)
        rows = kernel_table([e for e in events if lo <= e.get("ts", lo - 1) <= hi], steps, on_device)
        if not rows:
            warnings.append("no activity inside the recorded steps' time window: the whole trace is counted")
    rows = rows or kernel_table(events, steps, on_device)
    if not rows:
        raise RuntimeError("no " + ("device kernels" if on_device else "CPU ops") + " in the trace (on a GPU: CUPTI "
                           "reported no kernels, e.g. none inside the CUDA-graph replays)")
    step_us = 1e6 * statistics.fmean(step_s[prof_warm:])
    for r in rows:
        r["share_of_step"] = r["us_per_step"] / step_us
    kernel_us = sum(r["us_per_step"] for r in rows)
    out = {"model": eng.config.model, "quant": eng.config.quant, "batch": batch, "activity": "cuda" if on_device
           else "cpu", "steps": len(marks), "steps_asked": steps, "warm_steps": warm_steps,
           "context_len": prompt_len + warm_steps + prof_warm, "step_us_measured": step_us,
           "kernel_us_per_step": kernel_us, "gap_us_per_step": step_us - kernel_us,
           "num_kernel_names": len(rows), "kernels": rows[:JSON_MAX_KERNELS]}
    if len(rows) > JSON_MAX_KERNELS:
        rest = rows[JSON_MAX_KERNELS:]
        out["kernels_other"] = {"names": len(rest), "us_per_step": sum(r["us_per_step"] for r in rest)}
    if on_device and kernel_us > 1.05 * step_us:
        # one stream cannot be busy longer than the step: CUPTI's times inside graph replays are off
        warnings.append(f"kernel time {kernel_us:.0f} us/step exceeds the step ({step_us:.0f} us): the device "
                        "times are not trustworthy")
    if warnings:
        out["warning"] = "; ".join(warnings)
    return out


# -- HF transformers -----------------------------------------------------------------------------------------------
def _compile_config_cls():
    try:
        from transformers import CompileConfig
        return CompileConfig
    except ImportError:
        try:
            from transformers.generation.configuration_utils import CompileConfig
            return CompileConfig
        except ImportError:
            return None


def _use_generate_compile(m, fullgraph: bool, device: str) -> str:
    """Let ``generate`` compile the decode step itself (static cache + compile_config); returns how."""
    gen_cfg = m.generation_config
    gen_cfg.disable_compile = False
    cls = _compile_config_cls()
    if cls is None:
        return "generate auto-compile, transformers' default CompileConfig (CompileConfig not importable)"
    cc = cls(fullgraph=fullgraph, mode="reduce-overhead")
    if torch.device(device).type != "cuda":
        cc._compile_all_devices = True          # transformers auto-compiles only on accelerators; CPU smoke runs
    gen_cfg.compile_config = cc
    return f"generate auto-compile: static cache + CompileConfig(mode='reduce-overhead', fullgraph={fullgraph})"


def _dynamo_counts() -> tuple[int | None, int | None]:
    """(graphs compiled by dynamo so far, cudagraph skips so far), None where this torch lacks the counter."""
    try:
        from torch._dynamo.utils import counters
        return int(counters["stats"]["unique_graphs"]), int(counters["inductor"]["cudagraph_skips"])
    except Exception:
        return None, None


def hf_decode_ms(model: str, batch: int, prompt_len: int, gen_len: int, device: str = "cuda",
                 compile: bool = True, reps: int = 3, dtype: torch.dtype | None = None) -> dict:
    """HF transformers at the preset's shapes (random weights): ms per decode step, static cache, compiled once.

    Compilation: the static cache + ``generation_config.compile_config`` (mode reduce-overhead) route, i.e.
    generate's own auto-compile, which is what transformers documents for static-cache decode. It compiles only
    the decode step (fixed shapes: one token per sequence over the static cache) and leaves prefill eager, so it
    compiles once and is never retraced for the prompt's shape. Compiling ``model.forward`` ourselves as well (as
    this benchmark once did) stacks a second compile on top of generate's (prefill compiled too). fullgraph=True
    first; if dynamo refuses a graph break, fullgraph=False (transformers' default). Should generate not compile at
    all (its auto-compile criteria unmet), ``model.forward`` is compiled explicitly with ``disable_compile=True``.
    ``compile=False`` runs eagerly (``disable_compile=True``), for CPU smoke tests.

    Never raises: a failure is returned as ``error`` with what was recorded until then."""
    import transformers
    rec: dict = {"model": model, "batch": batch, "device": str(device), "transformers": transformers.__version__,
                 "compile": None, "reps": reps, "prompt_len": prompt_len, "gen_len": gen_len}
    m = None
    try:
        if gen_len < 3:
            raise ValueError(f"gen_len must be >= 3 for the HF decode time (generate(gen_len) - generate(2)), "
                             f"got {gen_len}")
        from vtengine.models.presets import load_preset
        dtype = dtype or (torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
        cfg = transformers.AutoConfig.for_model(**load_preset(model)["hf_config"])
        torch.manual_seed(0)
        with torch.device(device):
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
        rec["dtype"] = str(dtype).removeprefix("torch.")
        rec["attn_implementation"] = getattr(m.config, "_attn_implementation", None)
        m.generation_config.cache_implementation = "static"
        # one cache length for every timed call, so the compiled decode step keeps one shape (newer transformers
        # read this; older ones keep the largest length seen, and generate(gen_len) runs first)
        m.generation_config.max_cache_len = prompt_len + gen_len
        if compile:
            rec["compile"] = _use_generate_compile(m, fullgraph=True, device=device)
        else:
            m.generation_config.disable_compile = True
            rec["compile"] = "none (eager, disable_compile=True)"
        g = torch.Generator().manual_seed(0)
        hi = min(PROMPT_TOKEN_RANGE[1], cfg.vocab_size)
        ids = torch.randint(PROMPT_TOKEN_RANGE[0], hi, (batch, prompt_len), generator=g).to(device)
        mask = torch.ones_like(ids)

        def timed_generate(n: int) -> float:
            _sync(device)
            t0 = time.perf_counter()
            out = m.generate(ids, attention_mask=mask, do_sample=False, min_new_tokens=n, max_new_tokens=n,
                             pad_token_id=0)
            _sync(device)
            dt = time.perf_counter() - t0
            if tuple(out.shape) != (batch, prompt_len + n):
                raise RuntimeError(f"HF generate returned shape {tuple(out.shape)}, expected "
                                   f"{(batch, prompt_len + n)} ({n} new tokens)")
            return dt

        graphs0, skips0 = _dynamo_counts()
        t0 = time.perf_counter()
        try:
            timed_generate(gen_len)                     # compiles the decode step
        except Exception as e:
            if not compile:
                raise
            rec["fullgraph_error"] = _err(e)
            torch._dynamo.reset()
            rec["compile"] = _use_generate_compile(m, fullgraph=False, device=device)
            timed_generate(gen_len)
        if compile:
            graphs, _ = _dynamo_counts()
            engaged = getattr(m, "_compiled_call", None) is not None or (graphs is not None and graphs > graphs0)
            if not engaged:
                m.generation_config.disable_compile = True
                m.forward = torch.compile(m.forward, mode="reduce-overhead")
                rec["compile"] = ("explicit torch.compile(model.forward, mode='reduce-overhead') + "
                                  "disable_compile=True (generate's auto-compile did not engage)")
                timed_generate(gen_len)
        for n in (gen_len, 1, 2):                       # warm every length that is timed
            timed_generate(n)
        rec["compile_and_warmup_s"] = time.perf_counter() - t0
        t1, t2, tn = [], [], []
        for _ in range(reps):
            t1.append(timed_generate(1))
            t2.append(timed_generate(2))
            tn.append(timed_generate(gen_len))
        graphs1, skips1 = _dynamo_counts()
        if graphs0 is not None:
            rec["dynamo_graphs_compiled"] = graphs1 - graphs0
            rec["cudagraph_skips"] = skips1 - skips0
        rec["generate_s"] = {"1": t1, "2": t2, str(gen_len): tn}
        steady = statistics.median((b - a) / (gen_len - 2) for a, b in zip(t2, tn))
        from_1 = statistics.median((b - a) / (gen_len - 1) for a, b in zip(t1, tn))
        rec["prefill_ms"] = 1e3 * statistics.median(t1)
        rec["ms_per_step_from_1tok"] = 1e3 * from_1
        if not steady > 0:
            raise RuntimeError(f"non-positive HF decode time: generate({gen_len}) {tn} s vs generate(2) {t2} s")
        rec["ms_per_step"] = 1e3 * steady
    except Exception as e:                              # record why rather than lose the engine's figures
        rec["error"] = _err(e)
    finally:
        m = None                                        # drop the model (the closure's reference too)
        if compile:
            try:
                torch._dynamo.reset()
            except Exception:
                pass
        _free_memory()
    return rec


# -- results -------------------------------------------------------------------------------------------------------
def unique_stem(out_dir: Path, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... : the first whose .json and .md are both absent from ``out_dir``."""
    stem, n = base, 1
    while (out_dir / f"{stem}.json").exists() or (out_dir / f"{stem}.md").exists():
        n += 1
        stem = f"{base}-{n}"
    return stem


def _f(x, fmt: str = ".3f") -> str:
    return "" if x is None else format(x, fmt)


def render_markdown(result: dict) -> str:
    """The markdown view of a result dict (the JSON is the evidence; this is rendered only from it)."""
    hf = result.get("hf_transformers_compiled") or []
    hf_by = {(h["model"], h["batch"]): h for h in hf}
    lines = [f"# decode benchmark — {result.get('device')}, torch {result.get('torch')}, "
             f"triton {result.get('triton')}, {result.get('date')}", ""]
    if result.get("interrupted"):
        lines += ["**Interrupted run** (a time limit stopped it): what is here was measured, the rest was not.", ""]
    elif not result.get("complete", True):
        lines += ["**Incomplete run**: written before the run ended (what is here was measured).", ""]
    lines += [f"copy bandwidth {_f(result.get('copy_bandwidth_gbs'), '.0f')} GB/s; prompt {result.get('prompt_len')}, "
              f"{result.get('gen_len')} new tokens; ms per decode step (CUDA graphs)", ""]
    for v in result.get("variants") or []:
        lines.append(f"- variant `{v['name']}`: levers {v['levers'] or 'at their defaults'}")
    lines += ["",
              "| model | quant | variant | concurrency | ms/step | floor ms | % of floor | HF compiled ms/step | "
              "engine speed-up vs HF |", "|---|---|---|---|---|---|---|---|---|"]
    for r in result.get("engine", []):
        head = f"| {r['model']} | {r['quant']} | {r.get('variant', 'base')} | {r['batch']} "
        if "error" in r:
            lines.append(head + f"| error: {r['error'][:120]} | | | | |")
            continue
        h = hf_by.get((r["model"], r["batch"])) if r["quant"] == "bf16" else None
        hf_cell = ratio = ""
        if h is not None and h.get("ms_per_step"):
            hf_cell, ratio = f"{h['ms_per_step']:.3f}", f"{h['ms_per_step'] / r['ms_per_step']:.2f}×"
        elif h is not None:
            hf_cell = "error"
        lines.append(head + f"| {r['ms_per_step']:.3f} | {_f(r.get('floor_ms'))} | "
                     f"{_f(100 * r['frac_of_floor'] if 'frac_of_floor' in r else None, '.1f')}% | {hf_cell} | {ratio} |")
    if hf:
        h0 = next((h for h in hf if "ms_per_step" in h), hf[0])
        lines += ["", f"HF transformers {h0.get('transformers')}: {h0.get('compile')}; bf16, random weights; "
                  f"ms/step = median of {h0.get('reps')} x (t(generate {result.get('gen_len')}) - t(generate 2)) / "
                  f"{(result.get('gen_len') or 0) - 2}. speed-up = HF ms/step / engine ms/step."]
        for h in hf:
            notes = []
            if h.get("compile") != h0.get("compile"):
                notes.append(f"compile: {h.get('compile')}")
            if h.get("fullgraph_error"):
                notes.append(f"fullgraph=True failed ({h['fullgraph_error'][:160]})")
            if (h.get("dynamo_graphs_compiled") or 0) > 1:
                notes.append(f"{h['dynamo_graphs_compiled']} dynamo graphs (graph breaks or recompiles)")
            if h.get("cudagraph_skips"):
                notes.append(f"{h['cudagraph_skips']} CUDA-graph skip(s): HF ran partly without graphs")
            if h.get("error"):
                notes.append(f"error: {h['error'][:200]}")
            if notes:
                lines.append(f"- HF {h['model']} c{h['batch']}: " + "; ".join(notes))
    profiles = result.get("profiles") or []
    if profiles:
        lines += ["", "## Where the decode step goes (torch.profiler)", ""]
    for p in profiles:
        title = f"### {p['model']} {p['quant']} [{p.get('variant', 'base')}] c{p['batch']}"
        if "error" in p:
            lines += [title, "", f"profile failed: {p['error'][:300]}", ""]
            continue
        timed = p.get("step_us_timed")
        lines += [f"{title}: {p['steps']} decode steps at context ~{p['context_len']}", "",
                  f"sum of kernel time {p['kernel_us_per_step']:.1f} us/step vs measured step time "
                  f"{p['step_us_measured']:.1f} us/step (under the profiler"
                  + (f"; {timed:.1f} us/step in the timed run" if timed else "")
                  + f"): gap {p['gap_us_per_step']:.1f} us/step "
                  f"({100 * p['gap_us_per_step'] / p['step_us_measured']:.1f}%) = launch gaps, idle device, host work; "
                  f"{p['num_kernel_names']} kernel names", ""]
        if p.get("warning"):
            lines += [f"**warning**: {p['warning']}", ""]
        lines += ["| kernel | us/step | launches/step | % of step |", "|---|---|---|---|"]
        for k in p["kernels"][:MD_TOP_KERNELS]:
            lines.append(f"| `{k['kernel']}` | {k['us_per_step']:.1f} | {k['launches_per_step']:.2f} | "
                         f"{100 * k['share_of_step']:.1f}% |")
        rest = p["kernels"][MD_TOP_KERNELS:]
        other_us = sum(k["us_per_step"] for k in rest) + (p.get("kernels_other") or {}).get("us_per_step", 0.0)
        if other_us:
            lines.append(f"| ({p['num_kernel_names'] - MD_TOP_KERNELS} others) | {other_us:.1f} | | "
                         f"{100 * other_us / p['step_us_measured']:.1f}% |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def write_outputs(result: dict, out_dir: Path, stem: str) -> None:
    """Write <stem>.json and .md to ``out_dir`` and, when $OUT is set, to $OUT as well (never raises for $OUT)."""
    text = json.dumps(result, indent=2, default=str) + "\n"
    try:
        md = render_markdown(result)
    except Exception as e:                              # the view must never cost the evidence
        md = f"# decode benchmark\n\nthe markdown could not be rendered ({_err(e)}); the JSON holds the results\n"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(text)
    (out_dir / f"{stem}.md").write_text(md)
    if os.environ.get("OUT"):
        try:
            Path(os.environ["OUT"], f"{stem}.json").write_text(text)
            Path(os.environ["OUT"], f"{stem}.md").write_text(md)
        except OSError as e:
            print(f"could not copy the results to $OUT: {_err(e)}", flush=True)


def _model_specs(text: str) -> list[tuple[str, str]]:
    specs = []
    for spec in text.split(","):
        model, sep, quant = spec.strip().partition(":")
        if not sep or not model or not quant:
            raise ValueError(f"--models expects model:quant[,model:quant...], e.g. qwen3-8b:bf16; got {spec!r}")
        specs.append((model, quant))
    return specs


def parse_variants(base: dict, texts: list[str]) -> list[tuple[str, dict]]:
    """[("base", levers)] + one (name, levers) per ``--variant LEVER=VALUE[,LEVER=VALUE...]`` on top of the base."""
    out = [("base", dict(base))]
    for text in texts:
        pairs = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p]
        if bad or not pairs:
            raise ValueError(f"--variant expects LEVER=VALUE[,LEVER=VALUE...], got {text!r}")
        out.append((",".join(pairs), dict(base, **dict(p.split("=", 1) for p in pairs))))
    return out


def _engine_phase(args, specs, batches, variants, result, save, log) -> None:
    """Each (model, quant) x variant: one engine, timed at every concurrency, then (``--profile``) profiled on the
    same engine. Variants of one model run back to back, so their ratios come from one machine state."""
    bw = result["copy_bandwidth_gbs"]
    rows = result["engine"]
    for model, quant in specs:
        for name, levers in variants:
            llm = None
            tag = f"{model} {quant} [{name}]"
            try:
                torch.cuda.reset_peak_memory_stats()
                llm = build_llm(model, quant, max(max(batches), 8), levers)
                for b in batches:
                    try:
                        r = engine_decode_ms(llm, b, args.prompt_len, args.gen_len)
                    except Exception as e:
                        r = {"model": model, "quant": quant, "batch": b, "levers": levers, "error": _err(e)}
                        log(f"{tag} c{b}: error {r['error']}")
                    else:
                        floor_ms = 1e3 * (r["weight_bytes"] + r["kv_bytes_per_step"]) / (bw * 1e9)
                        r.update(floor_ms=floor_ms, frac_of_floor=floor_ms / r["ms_per_step"])
                        log(f"{tag} c{b}: {r['ms_per_step']:.3f} ms/step, floor {floor_ms:.3f} ms "
                            f"({100 * r['frac_of_floor']:.1f}% of the bandwidth floor)")
                    r["variant"] = name
                    rows.append(r)
                    save()
                if args.profile and (args.profile_variants is None or name in args.profile_variants.split(";")):
                    _profile_engine(args, llm, model, quant, name, batches, result, save, log)
            except Exception as e:                      # the engine would not build: record it, go on
                done = {r["batch"] for r in rows if (r["model"], r["quant"], r.get("variant")) == (model, quant, name)}
                rows.extend([{"model": model, "quant": quant, "batch": b, "levers": levers, "variant": name,
                              "error": _err(e)} for b in batches if b not in done])
                log(f"{tag}: error {_err(e)}")
                save()
            finally:
                llm = None
                _free_memory()


def _hf_phase(args, specs, batches, result, save, log) -> None:
    for model in dict.fromkeys(m for m, q in specs if q == "bf16"):
        for b in batches:
            log(f"HF transformers {model} c{b}: loading, compiling, timing ...")
            h = hf_decode_ms(model, b, args.prompt_len, args.gen_len, reps=args.hf_reps)
            result["hf_transformers_compiled"].append(h)
            save()
            log(f"HF transformers {model} c{b}: " + (f"{h['ms_per_step']:.3f} ms/step ({h['compile']})"
                                                      if "ms_per_step" in h else f"error {h['error']}"))


def _profile_engine(args, llm, model, quant, variant, batches, result, save, log) -> None:
    timed = {(r["model"], r["quant"], r.get("variant"), r["batch"]): r.get("ms_per_step") for r in result["engine"]}
    for b in batches:
        try:
            p = profile_engine_decode(llm, b, args.prompt_len, steps=args.profile_steps)
            if timed.get((model, quant, variant, b)):
                p["step_us_timed"] = 1e3 * timed[(model, quant, variant, b)]
            log(f"profile {model} {quant} [{variant}] c{b}: kernels {p['kernel_us_per_step']:.0f} us/step of "
                f"{p['step_us_measured']:.0f} us/step; top: {p['kernels'][0]['kernel']}")
        except Exception as e:
            p = {"model": model, "quant": quant, "batch": b, "error": _err(e)}
            log(f"profile {model} {quant} [{variant}] c{b}: error {p['error']}")
        p["variant"] = variant
        result["profiles"].append(p)
        save()


def main(out_dir: str = "bench/results", argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vtengine bench decode")
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-8b:mxfp4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers for every bf16 model (static "
                    "cache + generate's torch.compile, reduce-overhead)")
    ap.add_argument("--hf-reps", type=int, default=3, help="timed repetitions for HF (the median is reported)")
    ap.add_argument("--profile", action="store_true", help="per-kernel torch.profiler breakdown of decode steps "
                    "(on the timed engine, right after its timings)")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--profile-variants", default=None, metavar="NAME;NAME",
                    help="profile only these variants ('base' and the --variant texts, ';'-separated); default all")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--variant", action="append", default=[], metavar="LEVER=VALUE[,LEVER=VALUE...]",
                    help="another engine configuration on top of the --lever base, timed beside it in the same run "
                    "(repeatable)")
    args = ap.parse_args(argv or [])
    if not torch.cuda.is_available():
        print("vtengine bench decode needs a CUDA GPU")
        return 2
    specs = _model_specs(args.models)
    try:
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        raise ValueError(f"--batches expects comma-separated integers, e.g. 1,8; got {args.batches!r}") from None
    if args.gen_len < 3:
        raise ValueError(f"--gen-len must be >= 3, got {args.gen_len}")
    if args.profile_steps < 1 or args.hf_reps < 1:
        raise ValueError(f"--profile-steps and --hf-reps must be >= 1, got {args.profile_steps}, {args.hf_reps}")
    bad = [p for p in args.lever if "=" not in p]
    if bad:
        raise ValueError(f"--lever expects NAME=VALUE, got {bad[0]!r}")
    levers = dict(p.split("=", 1) for p in args.lever)
    variants = parse_variants(levers, args.variant)
    import transformers
    import triton
    start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = unique_stem(out, f"decode-{date}")
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "python": platform.python_version(), "date": date,
              "complete": False, "argv": list(argv or []), "copy_bandwidth_gbs": None, "prompt_len": args.prompt_len,
              "gen_len": args.gen_len, "variants": [{"name": n, "levers": lv} for n, lv in variants],
              "engine": [], "hf_transformers_compiled": [], "profiles": []}

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - start
        write_outputs(result, out, stem)

    try:
        result["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
        log(f"copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s; writing {out / stem}.json/.md")
        _engine_phase(args, specs, batches, variants, result, save, log)
        if args.hf:
            _hf_phase(args, specs, batches, result, save, log)
    except KeyboardInterrupt:                           # a step timeout (SIGINT): keep what was measured
        result["interrupted"] = True
        save()
        log(f"interrupted; what was measured is in {out / stem}.json and .md")
        return 130
    result["complete"] = True
    save()
    log(f"done: {out / stem}.json and .md" + (" (copied to $OUT)" if os.environ.get("OUT") else ""))
    return 0
