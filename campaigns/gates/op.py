"""op: each kernel the lever affects, in this arm's setting, against the torch reference (fp32 math) on fresh random
inputs at several shapes (ragged context lengths, shuffled block tables), outputs poisoned (NaN) before each run.

Poisoning covers every tensor a launcher allocates as well as the outputs the cases hand it: the kernel runs under
torch's deterministic mode with ``fill_uninitialized_memory`` (warn_only: no op is refused), so ``torch.empty`` and
its kin return NaN (integers: their largest value). An element a kernel never writes then shows as NaN, never as the
stale, correct value an earlier run's freed output left in the allocator's cache (the gate runs each case in both
arms' settings). A probe checks the fill took on the gate's device; ``op.poison: false`` turns it off, and the result
says so.

Passes when every case's relative L2 error is within its kernel's bound and every output element was written.
Bounds come from measurement (op_bounds.yaml beside this file, written by ``python -m campaigns.gates.op
--measure``): per device kind, dtype and kernel, twice the largest error the reference comparison showed over
every lever setting and several seeds. Under the CPU interpreter (fp32) that is ~1e-6, so a kernel 0.1% off fails;
a bf16 kernel on a GPU is bounded near its own rounding error. A kernel without a measured bound falls back to a
per-dtype bound, and the result says so.

On the candidate arm the same inputs also run in the baseline's setting and the outputs are compared bitwise: that
is the *measured* byte-exactness the policy reads. Every kernel runs in the arm's whole lever context (the other
levers at their resolved values), as the engine would run it.

Faults (both must fail): the kernel handed a wrong stride / index (block table off by one block, K-block scales
shifted, norm weight rolled) while the reference is not; and the kernel's output off by a small relative error
(0.1%, or twice the bound where the bound is looser), the smallest error the gate claims to catch. The second
checks the comparison and its bound (an output off by that much fails it), not the kernel: the first is the one
that breaks the kernel's own work. A lever whose ``affects`` names no kernel gives no case: the gate fails and
says so (its lever file should mark op inapplicable), rather than pass on nothing. A case counts only where one of
the kernels the lever affects launched (``vtengine.counters``): one whose output came from elsewhere (a torch path)
fails, saying so, and its faults are not caught.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from campaigns.gates import GateContext, result
from campaigns.evidence import Arm, GateResult
from vtengine.backends.torch_backend import TorchBackend
from vtengine.levers import OFF_VALUES
from vtengine.quant import QuantizedWeight, quantize
from vtengine.testing import rel_l2

# The fallback where op_bounds.yaml has no measured bound for a (device, dtype, kernel); the result names it.
REL_L2_BOUND = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}
BOUNDS_FILE = Path(__file__).with_name("op_bounds.yaml")
BOUND_MARGIN = 2.0                  # bound = margin x the largest error measured
BOUND_FLOOR = {"float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-4}      # a kernel measured exact (argmax) still
SMALLEST_FAULT = 1e-3               # the output error (relative) the perturbation fault plants, at least


def measured_bounds(path: Path = BOUNDS_FILE) -> dict:
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def bound_for(device: str, dtype: torch.dtype, kernel: str, table: dict | None = None) -> tuple[float, str]:
    """(bound, source): the measured bound of this kernel on this device kind and dtype, else the dtype fallback."""
    table = measured_bounds() if table is None else table
    name = str(dtype).replace("torch.", "")
    entry = ((table.get(device) or {}).get(name) or {}).get("kernels", {}).get(kernel)
    if entry:
        return float(entry["bound"]), "measured"
    return REL_L2_BOUND[dtype], "fallback (not measured)"


def _shapes(device: str) -> dict[str, Any]:
    # bound: the context bound decode attention splits by, as the engine passes it (max_model_len: Qwen3-8B's 40960 on
    # the GPU, tiny's 2048 on the CPU); sms: the wave the split count fills (the interpreter's, as the engine's CPU
    # backend gives it). With the block tables' width instead, every nsplits_cap value planned the same grid here.
    if device == "cuda":
        return dict(hq=32, hkv=8, d=128, batches=[1, 8], ctx=[1, 100, 1025, 4097], hidden=4096,
                    gemm=[(1, 4096, 6144), (8, 4096, 4096), (16, 12288, 4096), (33, 4096, 4096)],
                    split_prefix=8192, dtype=torch.bfloat16, bound=40960, sms=None)
    from vtengine.backends.triton_backend import INTERPRETER_SMS
    return dict(hq=4, hkv=2, d=32, batches=[1, 3], ctx=[1, 17, 40], hidden=64,
                gemm=[(1, 64, 96), (3, 64, 32), (17, 128, 64)], split_prefix=200, dtype=torch.float32, bound=2048,
                sms=INTERPRETER_SMS)


def _paged(gen, dev, dtype, b, hq, hkv, d, ctx_lens, page=16):
    """Random q and a paged K/V cache with shuffled (non-contiguous) block tables."""
    blocks_per = [(c + page - 1) // page for c in ctx_lens]
    nblocks = sum(blocks_per) + 2                       # spare blocks: the off-by-one fault stays in bounds
    perm = torch.randperm(nblocks - 1, generator=gen)
    bt = torch.full((b, max(blocks_per)), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per):
        bt[i, :n] = perm[used:used + n].int()
        used += n
    k_cache = torch.randn(nblocks, page, hkv, d, generator=gen).to(dev, dtype)
    v_cache = torch.randn(nblocks, page, hkv, d, generator=gen).to(dev, dtype)
    return k_cache, v_cache, bt.to(dev), torch.tensor(ctx_lens, dtype=torch.int32, device=dev)


def _poisoned_like(shape, dtype, dev):
    return torch.full(shape, float("nan"), dtype=dtype, device=dev)


@contextlib.contextmanager
def poisoned_allocations(dev, enabled: bool = True):
    """Inside, every uninitialized allocation on any device is filled with NaN (max int for integer dtypes): torch's
    deterministic mode (warn_only, so no op raises; its warnings are silenced here) with fill_uninitialized_memory.
    Raises if a probe ``torch.empty`` on ``dev`` is not NaN (the fill did not take: the gate would be blind)."""
    if not enabled:
        yield
        return
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*(deterministic|Deterministic).*")
            if not bool(torch.isnan(torch.empty(64, device=dev)).all()):
                raise RuntimeError(f"op gate: uninitialized allocations on {dev} are not NaN-filled under torch "
                                   f"{torch.__version__}: outputs a kernel never writes would go unseen")
            yield
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])
        torch.utils.deterministic.fill_uninitialized_memory = was[2]


def decode_cases(gen, dev, sh, lever: str) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import attention
    cases = []
    for b in sh["batches"]:
        ctx_lens = [sh["ctx"][(i * 7 + b) % len(sh["ctx"])] for i in range(b)]
        k_cache, v_cache, bt, cl = _paged(gen, dev, sh["dtype"], b, sh["hq"], sh["hkv"], sh["d"], ctx_lens)
        q = torch.randn(b, sh["hq"], sh["d"], generator=gen).to(dev, sh["dtype"])
        scale = sh["d"] ** -0.5

        def run(setting, fault, q=q, k=k_cache, v=v_cache, bt=bt, cl=cl):
            tables = torch.where(bt >= 0, bt + 1, bt) if fault else bt
            out = _poisoned_like(q.shape, q.dtype, q.device)
            return attention.decode_attention(q, k, v, tables, cl, scale, out=out, max_context_len=sh["bound"],
                                              num_sms=sh["sms"], **setting)

        def ref(q=q, k=k_cache, v=v_cache, bt=bt, cl=cl):
            return TorchBackend().decode_attention(q.float(), k.float(), v.float(), bt, cl, scale)
        cases.append((f"decode_attention b={b} ctx={ctx_lens}", run, ref))
    return cases


def prefill_cases(gen, dev, sh, lever: str) -> list[tuple[str, Callable, Callable]]:
    """A chunk after a short cached prefix beside a whole prompt; for prefill_splits also a chunk after a long prefix
    (split_prefix tokens) whose keys fill the slices: a split count follows the grid alone, so the short prefix
    splits too, but into slices that are nearly all empty."""
    from vtengine.kernels import attention
    q_lens = [min(sh["ctx"][-1], 37), sh["ctx"][1]]         # the first sequence has a cached prefix
    prefixes = [sh["ctx"][-1] - q_lens[0]] + ([sh["split_prefix"]] if lever == "prefill_splits" else [])
    cases = []
    for prefix in prefixes:
        ctx_lens = [prefix + q_lens[0], q_lens[1]]
        k_cache, v_cache, bt, cl = _paged(gen, dev, sh["dtype"], 2, sh["hq"], sh["hkv"], sh["d"], ctx_lens)
        cu = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]], dtype=torch.int32, device=dev)
        q = torch.randn(sum(q_lens), sh["hq"], sh["d"], generator=gen).to(dev, sh["dtype"])
        scale = sh["d"] ** -0.5

        def run(setting, fault, q=q, k=k_cache, v=v_cache, bt=bt, cl=cl, cu=cu):
            tables = torch.where(bt >= 0, bt + 1, bt) if fault else bt
            out = _poisoned_like(q.shape, q.dtype, q.device)
            return attention.prefill_attention(q, k, v, cu, cl, tables, scale, out=out,
                                               fast_math=setting.get("fast_math", False),
                                               gqa_pack=setting.get("gqa_pack", False),
                                               splits=setting.get("splits", "off"))

        def ref(q=q, k=k_cache, v=v_cache, bt=bt, cl=cl, cu=cu):
            return TorchBackend().prefill_attention(q.float(), k.float(), v.float(), cu, cl, bt, scale)
        cases.append((f"prefill_attention q_lens={q_lens} ctx={ctx_lens}", run, ref))
    return cases


def _w4a16_inputs(gen, dev, sh, m: int, k: int, n: int, fmt: str):
    """x [m, k], a quantized [n, k] weight, and the same weight with its K-block scales shifted by one (the wrong-
    index fault the gate must catch)."""
    w = torch.randn(n, k, generator=gen).to(dev)
    qw = quantize(w, fmt)
    x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])
    shifted = QuantizedWeight(qw.fmt, qw.packed, torch.roll(qw.scales, 1, dims=1).contiguous(),
                              qw.global_scale, qw.shape)
    return x, qw, shifted


def gemm_cases(gen, dev, sh, fmt: str) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import w4a16
    cases = []
    for m, k, n in sh["gemm"]:
        x, qw, shifted = _w4a16_inputs(gen, dev, sh, m, k, n, fmt)

        def run(setting, fault, x=x, qw=qw, shifted=shifted):
            return w4a16.w4a16_linear(x, shifted if fault else qw,
                                      out=_poisoned_like((x.shape[0], qw.shape[0]), x.dtype, x.device), **setting)

        def ref(x=x, qw=qw):
            return TorchBackend().linear(x.float(), qw)
        cases.append((f"w4a16_gemm {fmt} M={m} K={k} N={n}", run, ref))
    return cases


def norm_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import fused
    x = torch.randn(37, sh["hidden"], generator=gen).to(dev, sh["dtype"])
    wt = (1 + 0.1 * torch.randn(sh["hidden"], generator=gen)).to(dev, sh["dtype"])

    def run(setting, fault):
        return fused.rms_norm(x, torch.roll(wt, 1) if fault else wt, 1e-6, fast_math=setting.get("fast_math", False),
                              out=_poisoned_like(x.shape, x.dtype, x.device), pdl=setting.get("pdl", False))

    def ref():
        return TorchBackend().rms_norm(x.float(), wt.float(), 1e-6)
    return [(f"rms_norm T=37 H={sh['hidden']}", run, ref)]


def silu_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import fused
    inter = 3 * sh["hidden"]
    gu = (2 * torch.randn(9, 2 * inter, generator=gen)).to(dev, sh["dtype"])

    def run(setting, fault):
        return fused.silu_mul(torch.roll(gu, 1, dims=1) if fault else gu,
                              out=_poisoned_like((gu.shape[0], inter), gu.dtype, gu.device),
                              pdl=setting.get("pdl", False))

    def ref():
        return TorchBackend().silu_mul(gu.float())
    return [(f"silu_mul T=9 I={inter}", run, ref)]


def gate_up_silu_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    """The MLP's first half at decode sizes (M <= 16), a gate_up weight [2I, K] in W4A16 and in the model dtype
    (the Triton GEMV): fused into the GEMM's epilogue in a fuse_silu arm, the GEMM then the silu_mul kernel
    otherwise; against silu_mul(linear) of the reference."""
    from vtengine.kernels import fused, gemv, w4a16
    cases = []
    for m, k, n in sh["gemm"]:
        if m > gemv.MAX_M or n % 2:
            continue
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, sh["dtype"])

        def run_dense(setting, fault, x=x, w=w):
            wt = torch.roll(w, 1, dims=0) if fault else w     # the fault: gate and up rows out of step by one
            pdl, pre = setting.get("pdl", False), setting.get("prefetch", False)
            if setting.get("fused"):
                return gemv.linear(x, wt, triton_gemv=True, pdl=pdl, prefetch=pre, silu_mul=True)
            return fused.silu_mul(gemv.linear(x, wt, triton_gemv=True, pdl=pdl, prefetch=pre), pdl=pdl)

        def ref_dense(x=x, w=w):
            be = TorchBackend()
            return be.silu_mul(be.linear(x.float(), w.float()))
        cases.append((f"gate_up+silu_mul {str(sh['dtype']).removeprefix('torch.')} M={m} K={k} 2I={n}", run_dense,
                      ref_dense))
    for fmt in ("mxfp4", "nvfp4"):
        for m, k, n in sh["gemm"]:
            if m > 16 or n % 32:
                continue
            x, qw, shifted = _w4a16_inputs(gen, dev, sh, m, k, n, fmt)

            def run(setting, fault, x=x, qw=qw, shifted=shifted):
                wt = shifted if fault else qw
                kw = dict(dense=True, pdl=setting.get("pdl", False), rot=setting.get("rot", False),
                          prefetch=setting.get("prefetch", False))
                if setting.get("fused"):
                    return w4a16.w4a16_linear(x, wt, silu_mul=True, **kw)
                return fused.silu_mul(w4a16.w4a16_linear(x, wt, **kw), pdl=kw["pdl"])

            def ref(x=x, qw=qw):
                be = TorchBackend()
                return be.silu_mul(be.linear(x.float(), qw))
            cases.append((f"gate_up+silu_mul {fmt} M={m} K={k} 2I={n}", run, ref))
    return cases


def qkv_epilogue_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    """Returns q and the touched cache slots of k and v, flattened into one tensor (one L2 over all three)."""
    from vtengine.backends.torch_backend import rope_cos_sin
    from vtengine.kernels import fused
    hq, hkv, d, t, page = sh["hq"], sh["hkv"], sh["d"], 7, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).to(dev, sh["dtype"])
    pos = torch.randint(0, 1000, (t,), generator=gen).to(dev)
    slots = torch.randperm(8 * page, generator=gen)[:t].to(dev)
    qn = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, sh["dtype"])
    kn = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, sh["dtype"])
    cs = rope_cos_sin(d, 1024, 1e6, device=dev)

    def pack(q, kc, vc):
        flat = kc.shape[0] * kc.shape[1]
        return torch.cat([q.reshape(-1), kc.view(flat, -1)[slots].reshape(-1), vc.view(flat, -1)[slots].reshape(-1)])

    def run(setting, fault):
        kc, vc = (_poisoned_like((8, page, hkv, d), sh["dtype"], dev) for _ in range(2))
        q = fused.qkv_epilogue(qkv, hq, hkv, pos + 1 if fault else pos, cs, kc, vc, slots, qn, kn,
                               fast_math=setting.get("fast_math", False), pdl=setting.get("pdl", False))
        return pack(q, kc, vc)

    def ref():
        kc, vc = (torch.zeros((8, page, hkv, d), dtype=torch.float32, device=dev) for _ in range(2))
        q = TorchBackend().qkv_epilogue(qkv.float(), hq, hkv, pos, cs, kc, vc, slots, qn.float(), kn.float())
        return pack(q, kc, vc)
    return [(f"qkv_epilogue T={t} heads={hq}/{hkv} d={d}", run, ref)]


def argmax_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    """Compared as one-hot rows of the chosen indices: a row with another index than torch.argmax's (the lowest on
    ties: about 9% of bf16 rows over Qwen3's vocabulary hold a tied maximum) is off by sqrt(2) in a norm of
    sqrt(rows). The logit at the chosen index, compared before, passed a tie broken the other way."""
    from vtengine.kernels import fused
    vocab = 151936 if dev == "cuda" else 1000
    logits = (4 * torch.randn(5, vocab, generator=gen)).to(dev, sh["dtype"])
    if dev != "cuda":                   # a planted tie (the interpreter's fp32 draws none): the lowest index wins
        logits[1, 7] = logits[1, 900] = logits[1].max() + 1

    def run(setting, fault):
        idx = fused.argmax(torch.roll(logits, 1, dims=1) if fault else logits, pdl=setting.get("pdl", False))
        return torch.nn.functional.one_hot(idx.long(), vocab).float()

    def ref():
        return torch.nn.functional.one_hot(logits.float().argmax(dim=1), vocab).float()
    return [(f"argmax B=5 V={vocab}", run, ref)]


def dense_linear_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import gemv
    cases = []
    for m, k, n in sh["gemm"]:
        w = torch.randn(n, k, generator=gen).to(dev, sh["dtype"])
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])

        def run(setting, fault, x=x, w=w):
            return gemv.linear(x, torch.roll(w, 1, dims=1) if fault else w,
                               out=_poisoned_like((x.shape[0], w.shape[0]), x.dtype, x.device),
                               triton_gemv=setting["triton_gemv"], pdl=setting["pdl"],
                               prefetch=setting.get("prefetch", False))

        def ref(x=x, w=w):
            return TorchBackend().linear(x.float(), w.float())
        cases.append((f"dense_linear M={m} K={k} N={n}", run, ref))
    return cases


def norm_gemv_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    """The lever fuse_norm at decode sizes, in the model dtype (the Triton GEMV) and in MXFP4 (the W4A16 GEMM's
    dense route): an o-like projection plus the residual, then RMSNorm and the next projection; fused (the add in
    the first one's epilogue, with the GEMV's x * g, the norm's rsqrt in the second's epilogue) in a fuse_norm arm,
    the projection, add_rms_norm and projection kernels otherwise. The new residual and the second output, flattened
    into one tensor."""
    from vtengine.kernels import fused, gemv, w4a16
    from vtengine.kernels.epilogue import NormIn
    cases, eps = [], 1e-6
    for m, k, n in sh["gemm"]:
        if m > gemv.MAX_M:
            continue
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])
        res = torch.randn(m, n, generator=gen).to(dev, sh["dtype"])
        g = (1 + 0.1 * torch.randn(n, generator=gen)).to(dev, sh["dtype"])
        dense = ((torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, sh["dtype"]),
                 (torch.randn(k, n, generator=gen) / n ** 0.5).to(dev, sh["dtype"]))
        quant = (quantize(torch.randn(n, k, generator=gen).to(dev) / k ** 0.5, "mxfp4"),
                 quantize(torch.randn(k, n, generator=gen).to(dev) / n ** 0.5, "mxfp4"))
        for name, (w1, w2) in (("dense", dense), ("mxfp4", quant)):
            q = name == "mxfp4"

            def proj(a, w, setting, q=q, **kw):        # as the engine launches it, with the arm's levers
                pre = setting.get("prefetch", False)
                if q:
                    return w4a16.w4a16_linear(a, w, dense=True, pdl=setting["pdl"], rot=setting.get("rot", False),
                                              prefetch=pre, **kw)
                return gemv.linear(a, w, triton_gemv=True, pdl=setting["pdl"], prefetch=pre, **kw)

            def run(setting, fault, x=x, res=res, w1=w1, w2=w2, g=g, q=q, proj=proj):
                r_in = torch.roll(res, 1, dims=1) if fault else res       # the fault: the residual one column off
                pdl, fm = setting["pdl"], setting.get("fast_math", False)
                if setting.get("fused_norm") and q:
                    r, ss = w4a16.w4a16_linear_add(x, w1, r_in, dense=True, pdl=pdl, rot=setting.get("rot", False),
                                                   prefetch=setting.get("prefetch", False))
                    y = proj(r, w2, setting, norm=NormIn(ss, g, eps, fm))
                elif setting.get("fused_norm"):                 # as the engine: the add hands on x * g
                    r, ss, xg = gemv.linear_add_gain(x, w1, r_in, g, pdl=pdl, prefetch=setting.get("prefetch", False))
                    y = proj(xg, w2, setting, norm=NormIn(ss, g, eps, fm, gained=True))
                else:
                    xn, r = fused.add_rms_norm(proj(x, w1, setting), r_in, g, eps, fast_math=fm, pdl=pdl)
                    y = proj(xn, w2, setting)
                return torch.cat([r.reshape(-1), y.reshape(-1)])

            def ref(x=x, res=res, w1=w1, w2=w2, g=g, q=q):
                be = TorchBackend()
                lin = (lambda a, w: be.linear(a, w)) if q else (lambda a, w: be.linear(a, w.float()))
                xn, r = be.add_rms_norm(lin(x.float(), w1), res.float(), g.float(), eps)
                return torch.cat([r.reshape(-1), lin(xn, w2).reshape(-1)])
            cases.append((f"linear+add_rms_norm+linear {name} M={m} K={k} N={n}", run, ref))
    return cases


def rope_gemv_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    """The lever fuse_rope at decode sizes, in the model dtype (the Triton GEMV) and in MXFP4 (the W4A16 GEMM's dense
    route): the qkv projection and the qkv epilogue (q/k norm, RoPE, KV store), in the projection's own epilogue in a
    fuse_rope arm, the projection then the qkv_epilogue kernel otherwise. q and the touched cache slots of k and v,
    flattened into one tensor; the fault rotates by the next position."""
    from vtengine.backends.torch_backend import rope_cos_sin
    from vtengine.kernels import fused, gemv, w4a16
    hq, hkv, d, k, page = sh["hq"], sh["hkv"], sh["d"], sh["hidden"], 16
    n = (hq + 2 * hkv) * d
    cs = rope_cos_sin(d, 1024, 1e6, device=dev)
    cases = []
    for m in sorted({1, gemv.MAX_M // 2, gemv.MAX_M}):
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dev, sh["dtype"])
        pos = torch.randint(0, 1000, (m,), generator=gen).to(dev)
        slots = torch.randperm(8 * page, generator=gen)[:m].to(dev)
        qn = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, sh["dtype"])
        kn = (1 + 0.1 * torch.randn(d, generator=gen)).to(dev, sh["dtype"])

        def pack(q, kc, vc, slots=slots):
            flat = kc.shape[0] * kc.shape[1]
            return torch.cat([q.reshape(-1), kc.view(flat, -1)[slots].reshape(-1),
                              vc.view(flat, -1)[slots].reshape(-1)])

        for name, wt in (("dense", w), ("mxfp4", quantize(w.float(), "mxfp4"))):
            q4 = name == "mxfp4"

            def proj(setting, x=x, wt=wt, q4=q4, **kw):
                if q4:
                    return w4a16.w4a16_linear(x, wt, dense=setting["dense"], pdl=setting["pdl"], rot=setting["rot"],
                                              prefetch=setting.get("prefetch", False), **kw)
                return gemv.linear(x, wt, triton_gemv=setting["triton_gemv"], pdl=setting["pdl"],
                                   prefetch=setting.get("prefetch", False), **kw)

            def run(setting, fault, x=x, pos=pos, slots=slots, qn=qn, kn=kn, pack=pack, proj=proj, q4=q4):
                kc, vc = (_poisoned_like((8, page, hkv, d), sh["dtype"], dev) for _ in range(2))
                p, fm = pos + 1 if fault else pos, setting.get("fast_math", False)
                if setting.get("fused_rope") and setting["dense" if q4 else "triton_gemv"]:
                    q = proj(setting, rope=fused.RopeOut(hq, hkv, p, cs, kc, vc, slots, qn, kn, fast_math=fm))
                else:
                    q = fused.qkv_epilogue(proj(setting), hq, hkv, p, cs, kc, vc, slots, qn, kn, fast_math=fm,
                                           pdl=setting["pdl"])
                return pack(q, kc, vc)

            def ref(x=x, wt=wt, pos=pos, slots=slots, qn=qn, kn=kn, pack=pack):
                be = TorchBackend()
                kc, vc = (torch.zeros((8, page, hkv, d), dtype=torch.float32, device=dev) for _ in range(2))
                qkv = be.linear(x.float(), wt) if isinstance(wt, QuantizedWeight) else be.linear(x.float(), wt.float())
                q = be.qkv_epilogue(qkv, hq, hkv, pos, cs, kc, vc, slots, qn.float(), kn.float())
                return pack(q, kc, vc)
            cases.append((f"qkv projection+qkv_epilogue {name} M={m} K={k} heads={hq}/{hkv} d={d}", run, ref))
    return cases


def setting_for(kernel: str, lever: str, values: dict[str, Any]) -> dict[str, Any]:
    """Launcher keyword arguments that run ``kernel`` in a lever context: ``values`` maps levers to their values
    (the arm's whole context; levers it does not name are off)."""
    def on(name):
        v = values.get(name, False)
        return v not in OFF_VALUES
    if kernel == "decode_attention":
        return {"gqa_swap": on("gqa_swap"), "nsplits_cap": values.get("nsplits_cap", "off") or "off",
                "split_rule": values.get("split_rule", "off") or "off", "fast_math": on("fast_math"),
                "pdl": on("pdl"), "wave_grid": on("decode_wave_grid")}
    if kernel == "prefill_attention":
        # prefill_splits acts on the packed route only: test it there, as pdl_prefetch with pdl
        return {"gqa_pack": on("prefill_gqa_pack") or lever == "prefill_splits", "fast_math": on("fast_math"),
                "splits": values.get("prefill_splits", "off") or "off"}
    if kernel == "silu_mul":            # fuse_silu's cases run the W4A16 GEMM and the GEMV with their levers
        return {"pdl": on("pdl"), "fused": on("fuse_silu"), "rot": on("w4a16_rot"), "prefetch": on("pdl_prefetch")}
    if kernel == "w4a16_gemm":
        return {"dense": on("marlin_dense"), "pdl": on("pdl") or lever == "pdl_prefetch", "rot": on("w4a16_rot"),
                "prefetch": on("pdl_prefetch"), "mid": on("w4a16_mid_m")}
    if kernel == "dense_linear":
        # the pdl levers act on the Triton GEMV only (cuBLAS ignores them): test them there, pdl_prefetch with pdl
        out = {"triton_gemv": on("triton_gemv") or lever in ("pdl", "pdl_prefetch"),
               "pdl": on("pdl") or lever == "pdl_prefetch", "prefetch": on("pdl_prefetch")}
        return out | ({"fused_norm": on("fuse_norm"), "fast_math": on("fast_math"), "rot": on("w4a16_rot")}
                      if lever == "fuse_norm" else {})
    if kernel == "qkv_epilogue" and lever == "fuse_rope":     # its cases project first (the Triton GEMV's levers)
        return {"fast_math": on("fast_math"), "pdl": on("pdl"), "triton_gemv": on("triton_gemv"),
                "dense": on("marlin_dense"), "rot": on("w4a16_rot"), "prefetch": on("pdl_prefetch"),
                "fused_rope": on("fuse_rope")}
    return {"fast_math": on("fast_math"), "pdl": on("pdl")}


def arm_context(ctx: GateContext, arm: Arm) -> dict[str, Any]:
    """Every lever's value in the arm: the registry's resolution with the campaign's pins and the arm's value."""
    from vtengine import levers
    return dict(levers.resolve(ctx.lever_values(arm), environ={}, quant=ctx.quant).values)


def build_cases(ctx: GateContext, gen) -> list[tuple[str, str, Callable, Callable]]:
    return cases_for(ctx.lever, ctx.device, _shapes(ctx.device), gen)


def cases_for(lever: str, dev: str, sh: dict[str, Any], gen) -> list[tuple[str, str, Callable, Callable]]:
    """(kernel, case name, run, reference) for each kernel the lever affects, at shapes ``sh`` on device ``dev``
    (vtengine/kernels/aot.py builds the GPU's shapes on the CPU to compile what they launch)."""
    from vtengine import levers
    out = []
    for kernel in levers.get(lever).affects:
        if kernel == "decode_attention":
            cs = decode_cases(gen, dev, sh, lever)
        elif kernel == "prefill_attention":
            cs = prefill_cases(gen, dev, sh, lever)
        elif kernel == "w4a16_gemm":
            cs = gemm_cases(gen, dev, sh, "mxfp4") + gemm_cases(gen, dev, sh, "nvfp4")
        elif kernel == "rms_norm":
            cs = norm_cases(gen, dev, sh)
        elif kernel == "dense_linear":
            cs = dense_linear_cases(gen, dev, sh) + (norm_gemv_cases(gen, dev, sh) if lever == "fuse_norm" else [])
        elif kernel == "silu_mul" and lever == "fuse_silu":
            cs = gate_up_silu_cases(gen, dev, sh)
        elif kernel == "silu_mul":
            cs = silu_cases(gen, dev, sh)
        elif kernel == "qkv_epilogue":           # fuse_rope's cases end in the epilogue: its bound
            cs = qkv_epilogue_cases(gen, dev, sh) + (rope_gemv_cases(gen, dev, sh) if lever == "fuse_rope" else [])
        elif kernel == "argmax":
            cs = argmax_cases(gen, dev, sh)
        else:
            raise ValueError(f"op gate: no cases for kernel {kernel!r}")
        out += [(kernel, name, run, ref) for name, run, ref in cs]
    return out


def run(ctx: GateContext, arm: Arm, fault: bool = False) -> GateResult:
    t0 = time.perf_counter()
    cfg = ctx.gate_cfg.op
    gen = torch.Generator().manual_seed(int(cfg.seed))
    cases = build_cases(ctx, gen)
    dtype = _shapes(ctx.device)["dtype"]
    table = measured_bounds()
    values = arm_context(ctx, arm)
    base_values = arm_context(ctx, ctx.baseline)
    rows, failures, bitwise_equal = [], 0, []
    sources = set()
    faults = {"wrong index": 0, "small output error": 0}
    poison = bool(cfg.get("poison", True))
    from vtengine import counters, levers
    affects = set(levers.get(ctx.lever).affects)
    unlaunched: list[str] = []          # cases whose run launched no kernel the lever affects

    def launched() -> int:
        return sum(r["launches"] for k, routes in counters.snapshot().items() if k in affects for r in routes.values())

    def launch(run_case, setting, fault_run, name):
        before = launched()
        with poisoned_allocations(ctx.device, poison):
            out = run_case(setting, fault_run)
        if launched() == before:        # the output came from elsewhere (a torch path, a cache): no kernel compared
            unlaunched.append(name)
        return out
    if not cases:
        why = (f"{ctx.lever} affects no kernel the op gate has cases for: nothing was compared (mark op inapplicable "
               "in its lever file, with the reason)")
        return result("op", arm, bool(fault), t0, counts={"cases": 0}, details={"why": why, "fault": ""})
    for kernel, name, run_case, ref in cases:
        bound, source = bound_for(ctx.device, dtype, kernel, table)
        sources.add(source)
        setting = setting_for(kernel, ctx.lever, values)
        expected = ref()
        if fault:                       # a fault counts as caught only where the lever's kernels ran
            size = max(SMALLEST_FAULT, 2 * bound)
            wrong = rel_l2(launch(run_case, setting, True, name), expected)
            off = rel_l2(launch(run_case, setting, False, name) * (1 + size), expected)
            ran = name not in unlaunched
            faults["wrong index"] += ran and not wrong <= bound
            faults["small output error"] += ran and not off <= bound
            rows.append({"case": name, "bound": bound, "wrong_index_rel_l2": _finite(wrong),
                         "planted_error": size, "small_error_rel_l2": _finite(off), "launched": ran})
            continue
        out = launch(run_case, setting, False, name)
        err = rel_l2(out, expected)
        ok = err <= bound and bool(torch.isfinite(out).all()) and name not in unlaunched
        failures += not ok
        row = {"case": name, "rel_l2": _finite(err), "bound": bound, "bound_source": source, "ok": ok}
        if name in unlaunched:
            row["why"] = f"no kernel {ctx.lever} affects ({', '.join(sorted(affects))}) launched: nothing compared"
        if arm.role == "candidate":
            base = launch(run_case, setting_for(kernel, ctx.lever, base_values), False, name)
            row["bitwise_equal_to_baseline"] = bool(torch.equal(out, base))
            bitwise_equal.append(row["bitwise_equal_to_baseline"])
        rows.append(row)
    if fault:
        caught = {k: v == len(cases) for k, v in faults.items()}
        runs = [{"fault": k, "caught": caught[k], "cases_caught": faults[k], "cases": len(cases)} for k in faults]
        note = ("kernel handed a wrong block index / scale stride / rolled weight; kernel output off by "
                f"{min(r['planted_error'] for r in rows):.2g} relative or more")
        return result("op", arm, not all(caught.values()), t0,
                      counts={"cases": len(cases), **{f"caught_{k.replace(' ', '_')}": v for k, v in faults.items()}},
                      details={"cases": rows, "fault": note, "faults": runs})
    errs = [r["rel_l2"] for r in rows if r["rel_l2"] != "inf"]
    counts = {"cases": len(rows), "failed": failures, "max_rel_l2": max(errs, default=0.0),
              "max_bound": max(r["bound"] for r in rows) if rows else 0.0}
    byte_exact = all(bitwise_equal) if bitwise_equal else None
    if bitwise_equal:
        counts["bitwise_equal_cases"] = sum(bitwise_equal)
    return result("op", arm, failures == 0, t0, counts=counts, byte_exact=byte_exact,
                  details={"cases": rows, "fault": "", "bounds": sorted(sources),
                           "poisoned": "outputs and every allocation NaN-filled" if poison else
                           "allocations not NaN-filled (op.poison is false): only the outputs the cases hand in are",
                           "context": {k: v for k, v in sorted(values.items())}})


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else "inf"


# ----------------------------------------------------------------------------------------------- measurement


def measure(device: str, seeds: int = 8) -> dict[str, float]:
    """The largest rel L2 error per kernel over every lever's every value (the rest at their defaults) and
    ``seeds`` seeds: what op_bounds.yaml's bounds are made from."""
    from omegaconf import OmegaConf

    from campaigns.fingerprint import make_arms
    from vtengine import levers
    worst: dict[str, float] = {}
    for name, lever in sorted(levers.registry().items()):
        vals = [v for v in lever.values if not (isinstance(v, int) and not isinstance(v, bool) and v > 16)]
        arms = make_arms(name, vals[0], vals[1:])
        for seed in range(seeds):
            ctx = GateContext(lever=name, arms=arms, model="tiny", quant="bf16", device=device,
                              gate_cfg=OmegaConf.create({"op": {"seed": seed, "shapes": 4, "poison": True}}))
            gen = torch.Generator().manual_seed(seed)
            for kernel, case, run_case, ref in build_cases(ctx, gen):
                expected = ref()
                for arm in arms:
                    with poisoned_allocations(device):
                        out = run_case(setting_for(kernel, name, arm_context(ctx, arm)), False)
                    err = rel_l2(out, expected)
                    worst[kernel] = max(worst.get(kernel, 0.0), err)
    return worst


def write_bounds(device: str, worst: dict[str, float], seeds: int, path: Path = BOUNDS_FILE) -> dict:
    import datetime
    import platform

    import triton
    dtype = str(_shapes(device)["dtype"]).replace("torch.", "")
    name = torch.cuda.get_device_name(0) if device == "cuda" else f"{platform.machine()} CPU, Triton interpreter"
    table = measured_bounds()                   # the project's table, this device kind's entry replaced
    table.setdefault(device, {})[dtype] = {
        "measured": {"device": name, "date": datetime.date.today().isoformat(), "seeds": seeds,
                     "torch": str(torch.__version__), "triton": str(triton.__version__), "margin": BOUND_MARGIN},
        "kernels": {k: {"observed_max": float(f"{v:.3g}"),
                        "bound": float(f"{max(BOUND_MARGIN * v, BOUND_FLOOR[dtype]):.2g}")}
                    for k, v in sorted(worst.items())},
    }
    header = ("# The op gate's bounds (relative L2 vs the fp32 torch reference), measured by\n"
              "# `python -m campaigns.gates.op --measure`: per device kind and dtype, the largest error over every\n"
              "# lever value and several seeds (observed_max), and bound = margin x that (at least a small floor).\n")
    path.write_text(header + yaml.safe_dump(table, sort_keys=True))
    return table


def main(argv: list[str] | None = None) -> int:
    """``python -m campaigns.gates.op --measure [--seeds N]``: measure this host's kernel errors and write the
    bounds for its device kind into op_bounds.yaml."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m campaigns.gates.op")
    ap.add_argument("--measure", action="store_true", help="measure the errors and write op_bounds.yaml")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--out", default=str(BOUNDS_FILE))
    args = ap.parse_args(argv)
    if not args.measure:
        ap.error("nothing to do: pass --measure")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    worst = measure(device, args.seeds)
    table = write_bounds(device, worst, args.seeds, Path(args.out))
    print(yaml.safe_dump({device: table[device]}, sort_keys=True))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main())
