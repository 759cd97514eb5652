"""End-to-end decode benchmark: ms per decode step at concurrency 1 and 8 through the full engine (paged cache,
CUDA graphs, Triton kernels), as a fraction of the bandwidth floor, against HF transformers (static cache +
torch.compile) measured in the same run.

Floor per step = (bytes of every weight read once + K/V bytes of every sequence's context) / measured copy
bandwidth (device-to-device copy, bytes read + written). ``vtengine bench decode [--out DIR] [--models ...]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from pathlib import Path

import torch


def copy_bandwidth_gbs(nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written), median of 20."""
    import triton.testing
    src = torch.empty(nbytes // 2, dtype=torch.int16, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3) / 1e9


def engine_decode_ms(model: str, quant: str, batch: int, prompt_len: int, gen_len: int, levers: dict) -> dict:
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    llm = LLM(model=model, quant=quant, levers=levers, max_num_seqs=max(batch, 8), max_model_len=4096,
              gpu_memory_utilization=0.6)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(16, 30000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))      # warm-up
    st0 = dict(eng.stats())
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    st = eng.stats()
    steps = st["decode_steps_total"] - st0["decode_steps_total"]
    dec_s = st["decode_time_s_sum"] - st0["decode_time_s_sum"]
    cfg = eng.model_config
    ctx_mean = prompt_len + gen_len / 2
    kv_bytes = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2) * ctx_mean * batch
    out = {"model": model, "quant": quant, "batch": batch, "levers": levers, "decode_steps": steps,
           "ms_per_step": 1e3 * dec_s / max(steps, 1), "wall_s": wall,
           "weight_bytes": eng.model.weight_bytes(), "kv_bytes_per_step": kv_bytes,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    del llm, eng
    torch.cuda.empty_cache()
    return out


def hf_decode_ms(model: str, batch: int, prompt_len: int, gen_len: int) -> dict:
    """HF transformers, same shapes (random weights), bf16, static cache + torch.compile(reduce-overhead)."""
    import transformers
    from vtengine.models.presets import load_preset
    preset = load_preset(model)
    cfg = transformers.AutoConfig.for_model(**preset["hf_config"])
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    m.generation_config.cache_implementation = "static"
    m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(16, 30000, (batch, prompt_len), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=gen_len, max_new_tokens=gen_len, pad_token_id=0)
    for _ in range(2):
        m.generate(ids, **kw)                                # compile + warm-up
    torch.cuda.synchronize()
    # decode time = generate(gen_len) - generate(1) (the prefill), per generated token
    t0 = time.perf_counter()
    m.generate(ids, **dict(kw, min_new_tokens=1, max_new_tokens=1))
    torch.cuda.synchronize()
    t_prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    m.generate(ids, **kw)
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t0
    del m
    torch.cuda.empty_cache()
    return {"model": model, "batch": batch, "ms_per_step": 1e3 * (t_all - t_prefill) / (gen_len - 1)}


def main(out_dir: str = "bench/results", argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vtengine bench decode")
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-8b:mxfp4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--hf", action="store_true", help="also time HF transformers (static cache + torch.compile)")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args(argv or [])
    if not torch.cuda.is_available():
        print("vtengine bench decode needs a CUDA GPU")
        return 2
    levers = dict(p.split("=", 1) for p in args.lever)
    bw = copy_bandwidth_gbs()
    rows = []
    for spec in args.models.split(","):
        model, quant = spec.split(":")
        for b in [int(x) for x in args.batches.split(",")]:
            r = engine_decode_ms(model, quant, b, args.prompt_len, args.gen_len, levers)
            floor_ms = 1e3 * (r["weight_bytes"] + r["kv_bytes_per_step"]) / (bw * 1e9)
            r.update(floor_ms=floor_ms, frac_of_floor=floor_ms / r["ms_per_step"])
            rows.append(r)
            print(f"{model} {quant} c{b}: {r['ms_per_step']:.3f} ms/step, floor {floor_ms:.3f} ms "
                  f"({100 * r['frac_of_floor']:.1f}% of the bandwidth floor)", flush=True)
    hf = []
    if args.hf:
        for b in [int(x) for x in args.batches.split(",")]:
            try:
                h = hf_decode_ms(rows[0]["model"], b, args.prompt_len, args.gen_len)
            except Exception as e:          # record why rather than lose the engine's figures
                h = {"model": rows[0]["model"], "batch": b, "error": f"{type(e).__name__}: {e}"[:300]}
            hf.append(h)
            print(f"HF transformers compiled c{b}: {h.get('ms_per_step', float('nan')):.3f} ms/step", flush=True)
    import triton
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "date": datetime.date.today().isoformat(),
              "copy_bandwidth_gbs": bw, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
              "engine": rows, "hf_transformers_compiled": hf}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = result["date"]
    (out / f"decode-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# decode benchmark — {result['device']}, torch {result['torch']}, triton {result['triton']}, "
             f"{stamp}", "", f"copy bandwidth {bw:.0f} GB/s; prompt {args.prompt_len}, {args.gen_len} new tokens; "
             "ms per decode step (CUDA graphs)", "",
             "| model | quant | concurrency | ms/step | floor ms | % of floor | HF compiled ms/step |",
             "|---|---|---|---|---|---|---|"]
    hf_by_b = {h["batch"]: h.get("ms_per_step") for h in hf}
    for r in rows:
        hfv = hf_by_b.get(r["batch"]) if r["quant"] == "bf16" else None
        lines.append(f"| {r['model']} | {r['quant']} | {r['batch']} | {r['ms_per_step']:.3f} | {r['floor_ms']:.3f} "
                     f"| {100 * r['frac_of_floor']:.1f}% | {'' if hfv is None else f'{hfv:.3f}'} |")
    (out / f"decode-{stamp}.md").write_text("\n".join(lines) + "\n")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"decode-{stamp}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0
