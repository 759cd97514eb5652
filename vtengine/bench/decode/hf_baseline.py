"""The HF transformers baseline of the decode benchmark: the same model shapes (random weights) decoding from a
static cache under generate's own torch.compile, timed in the same run as the engine (``HFTiming``, whose
docstring defines the figures)."""
from __future__ import annotations

import statistics
import time

import torch

from vtengine.bench.common import error_text, free_memory, synchronize
from vtengine.bench.decode.engine_timing import PROMPT_TOKEN_RANGE
from vtengine.bench.decode.results import HFTiming


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
                 compile: bool = True, reps: int = 3, dtype: torch.dtype | None = None) -> HFTiming:
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
    rec = HFTiming(model=model, batch=batch, device=str(device), transformers=transformers.__version__, compile=None,
                   reps=reps, prompt_len=prompt_len, gen_len=gen_len)
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
        rec.dtype = str(dtype).removeprefix("torch.")
        rec.attn_implementation = getattr(m.config, "_attn_implementation", None)
        m.generation_config.cache_implementation = "static"
        # one cache length for every timed call, so the compiled decode step keeps one shape (newer transformers
        # read this; older ones keep the largest length seen, and generate(gen_len) runs first)
        m.generation_config.max_cache_len = prompt_len + gen_len
        if compile:
            rec.compile = _use_generate_compile(m, fullgraph=True, device=device)
        else:
            m.generation_config.disable_compile = True
            rec.compile = "none (eager, disable_compile=True)"
        g = torch.Generator().manual_seed(0)
        hi = min(PROMPT_TOKEN_RANGE[1], cfg.vocab_size)
        ids = torch.randint(PROMPT_TOKEN_RANGE[0], hi, (batch, prompt_len), generator=g).to(device)
        mask = torch.ones_like(ids)

        def timed_generate(n: int) -> float:
            synchronize(device)
            t0 = time.perf_counter()
            out = m.generate(ids, attention_mask=mask, do_sample=False, min_new_tokens=n, max_new_tokens=n,
                             pad_token_id=0)
            synchronize(device)
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
            rec.fullgraph_error = error_text(e)
            torch._dynamo.reset()
            rec.compile = _use_generate_compile(m, fullgraph=False, device=device)
            timed_generate(gen_len)
        if compile:
            graphs, _ = _dynamo_counts()
            engaged = getattr(m, "_compiled_call", None) is not None or (graphs is not None and graphs > graphs0)
            if not engaged:
                m.generation_config.disable_compile = True
                m.forward = torch.compile(m.forward, mode="reduce-overhead")
                rec.compile = ("explicit torch.compile(model.forward, mode='reduce-overhead') + "
                               "disable_compile=True (generate's auto-compile did not engage)")
                timed_generate(gen_len)
        for n in (gen_len, 1, 2):                       # warm every length that is timed
            timed_generate(n)
        rec.compile_and_warmup_s = time.perf_counter() - t0
        t1, t2, tn = [], [], []
        for _ in range(reps):
            t1.append(timed_generate(1))
            t2.append(timed_generate(2))
            tn.append(timed_generate(gen_len))
        graphs1, skips1 = _dynamo_counts()
        if graphs0 is not None:
            rec.dynamo_graphs_compiled = graphs1 - graphs0
            rec.cudagraph_skips = skips1 - skips0
        rec.generate_s = {"1": t1, "2": t2, str(gen_len): tn}
        steady = statistics.median((b - a) / (gen_len - 2) for a, b in zip(t2, tn))
        from_1 = statistics.median((b - a) / (gen_len - 1) for a, b in zip(t1, tn))
        rec.prefill_ms = 1e3 * statistics.median(t1)
        rec.ms_per_step_from_1tok = 1e3 * from_1
        if not steady > 0:
            raise RuntimeError(f"non-positive HF decode time: generate({gen_len}) {tn} s vs generate(2) {t2} s")
        rec.ms_per_step = 1e3 * steady
    except Exception as e:                              # record why rather than lose the engine's figures
        rec.error = error_text(e)
    finally:
        m = None                                        # drop the model (the closure's reference too)
        if compile:
            try:
                torch._dynamo.reset()
            except Exception:
                pass
        free_memory()
    return rec
