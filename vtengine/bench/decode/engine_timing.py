"""The engine's side of the decode benchmark: build one engine per (model, quant, levers) and time its decode steps
(``EngineTiming``, whose docstring defines the figures)."""
from __future__ import annotations

import time

import torch

from vtengine.bench.decode.results import EngineTiming

PROMPT_TOKEN_RANGE = (16, 30000)            # random prompt ids, clipped to the vocabulary


def random_prompts(batch: int, prompt_len: int, vocab_size: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random token ids, the same on every call (seed 0)."""
    g = torch.Generator().manual_seed(0)
    hi = min(PROMPT_TOKEN_RANGE[1], vocab_size)
    return [torch.randint(PROMPT_TOKEN_RANGE[0], hi, (prompt_len,), generator=g).tolist() for _ in range(batch)]


def kv_bytes_per_step(eng, context: float, batch: int) -> float:
    """K and V of every layer a decode step reads for ``batch`` sequences at ``context`` tokens each."""
    cfg = eng.model_config
    kv_elem = torch.finfo(eng.dtype).bits // 8
    return 2.0 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem * context * batch


# what the bench sets unless a --lever or --variant names it: the decode step itself, not the pipelined loop
BENCH_PINS = {"async_scheduling": False}


def build_llm(model: str, quant: str, max_num_seqs: int, levers: dict, device: str = "cuda", **engine_kwargs):
    """One engine for every concurrency of a (model, quant): graphs are captured up to ``max_num_seqs``.

    Async scheduling is pinned off unless ``levers`` sets it: the bench times the decode step itself, and with a
    step in flight the engine's launch-to-read time of one step overlaps the next one's (``ms_per_step_wall`` is
    the figure that compares the two)."""
    from vtengine.engine.llm import LLM
    levers = {**BENCH_PINS, **levers}
    kw = dict(gpu_memory_utilization=0.6) if device == "cuda" else {}
    kw.update(engine_kwargs)
    return LLM(model=model, quant=quant, levers=levers, device=device, max_num_seqs=max_num_seqs, **kw)


def engine_decode_ms(llm, batch: int, prompt_len: int, gen_len: int) -> EngineTiming:
    """Time one ``generate`` of ``gen_len`` tokens for ``batch`` sequences (after a short warm-up), and one of 2
    tokens, whose difference is the wall time of gen_len - 2 decode steps."""
    from vtengine.engine.sampling_params import SamplingParams
    eng = llm.engine
    cfg = eng.model_config
    prompts = random_prompts(batch, prompt_len, cfg.vocab_size)
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))      # warm-up
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    short = time.perf_counter() - t0
    st0 = dict(eng.stats())
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    st = eng.stats()
    steps = st["decode_steps_total"] - st0["decode_steps_total"]
    dec_s = st["decode_time_s_sum"] - st0["decode_time_s_sum"]
    if steps < 1 or dec_s <= 0:
        raise RuntimeError(f"no decode steps were timed ({steps} steps, {dec_s} s)")
    kv_bytes = kv_bytes_per_step(eng, prompt_len + gen_len / 2, batch)
    peak = torch.cuda.max_memory_allocated() / 2**30 if eng.device.type == "cuda" else 0.0
    return EngineTiming(model=eng.config.model, quant=eng.config.quant, batch=batch, levers=dict(eng.config.levers),
                        decode_steps=steps, ms_per_step=1e3 * dec_s / steps, wall_s=wall,
                        ms_per_step_wall=1e3 * (wall - short) / (gen_len - 2),
                        weight_bytes=eng.model.weight_bytes(), kv_bytes_per_step=kv_bytes, peak_gib=peak)
