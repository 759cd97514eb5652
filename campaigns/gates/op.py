"""op: each kernel the lever affects, in this arm's setting, against the torch reference (fp32 math) on fresh random
inputs at several shapes (ragged context lengths, shuffled block tables), outputs poisoned (NaN) before each run.

Passes when every case's relative L2 error is within the dtype's bound and every output element was written.
On the candidate arm the same inputs also run in the baseline's setting and the outputs are compared bitwise:
that is the *measured* byte-exactness the policy reads. Fault: the kernel is handed a wrong stride / index (block
table off by one block, K-block scales shifted, norm weight rolled) while the reference is not; it must fail.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from campaigns.gates import GateContext, result
from campaigns.evidence import Arm, GateResult
from vtengine.backends.torch_backend import TorchBackend
from vtengine.quant import QuantizedWeight, quantize
from vtengine.testing import rel_l2

REL_L2_BOUND = {torch.float32: 2e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def _shapes(device: str) -> dict[str, Any]:
    if device == "cuda":
        return dict(hq=32, hkv=8, d=128, batches=[1, 8], ctx=[1, 100, 1025, 4097], hidden=4096,
                    gemm=[(1, 4096, 6144), (8, 4096, 4096), (16, 12288, 4096), (33, 4096, 4096)],
                    dtype=torch.bfloat16)
    return dict(hq=4, hkv=2, d=32, batches=[1, 3], ctx=[1, 17, 40], hidden=64,
                gemm=[(1, 64, 96), (3, 64, 32), (17, 128, 64)], dtype=torch.float32)


class Case:
    """One random input set for one kernel: ``run(setting, fault)`` -> output; ``ref()`` -> reference."""
    name: str
    run: Callable[[Any, bool], torch.Tensor]
    ref: Callable[[], torch.Tensor]


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
            return attention.decode_attention(q, k, v, tables, cl, scale, out=out, **setting)

        def ref(q=q, k=k_cache, v=v_cache, bt=bt, cl=cl):
            return TorchBackend().decode_attention(q.float(), k.float(), v.float(), bt, cl, scale)
        cases.append((f"decode_attention b={b} ctx={ctx_lens}", run, ref))
    return cases


def prefill_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import attention
    ctx_lens = [sh["ctx"][-1], sh["ctx"][1]]
    q_lens = [min(ctx_lens[0], 37), sh["ctx"][1]]       # the first sequence has a cached prefix
    k_cache, v_cache, bt, cl = _paged(gen, dev, sh["dtype"], 2, sh["hq"], sh["hkv"], sh["d"], ctx_lens)
    cu = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]], dtype=torch.int32, device=dev)
    q = torch.randn(sum(q_lens), sh["hq"], sh["d"], generator=gen).to(dev, sh["dtype"])
    scale = sh["d"] ** -0.5

    def run(setting, fault):
        tables = torch.where(bt >= 0, bt + 1, bt) if fault else bt
        out = _poisoned_like(q.shape, q.dtype, q.device)
        return attention.prefill_attention(q, k_cache, v_cache, cu, cl, tables, scale, out=out,
                                           fast_math=setting.get("fast_math", False))

    def ref():
        return TorchBackend().prefill_attention(q.float(), k_cache.float(), v_cache.float(), cu, cl, bt, scale)
    return [(f"prefill_attention q_lens={q_lens} ctx={ctx_lens}", run, ref)]


def gemm_cases(gen, dev, sh, fmt: str) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import w4a16
    cases = []
    for m, k, n in sh["gemm"]:
        w = torch.randn(n, k, generator=gen).to(dev)
        qw = quantize(w, fmt)
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])
        shifted = QuantizedWeight(qw.fmt, qw.packed, torch.roll(qw.scales, 1, dims=1).contiguous(),
                                  qw.global_scale, qw.shape)

        def run(setting, fault, x=x, qw=qw, shifted=shifted):
            # poison: free a NaN buffer of the output's size right before the launch (the allocator reuses it)
            junk = _poisoned_like((x.shape[0], qw.shape[0]), x.dtype, x.device)
            del junk
            return w4a16.w4a16_linear(x, shifted if fault else qw, **setting)

        def ref(x=x, qw=qw):
            return TorchBackend().linear(x.float(), qw)
        cases.append((f"w4a16_gemm {fmt} M={m} K={k} N={n}", run, ref))
    return cases


def norm_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import fused
    x = torch.randn(37, sh["hidden"], generator=gen).to(dev, sh["dtype"])
    wt = (1 + 0.1 * torch.randn(sh["hidden"], generator=gen)).to(dev, sh["dtype"])

    def run(setting, fault):
        junk = _poisoned_like(x.shape, x.dtype, x.device)
        del junk
        return fused.rms_norm(x, torch.roll(wt, 1) if fault else wt, 1e-6, fast_math=setting.get("fast_math", False),
                              pdl=setting.get("pdl", False))

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
    """Compared through the logit each chosen index points at (an index is not a quantity to take an L2 of)."""
    from vtengine.kernels import fused
    vocab = 151936 if dev == "cuda" else 1000
    logits = (4 * torch.randn(5, vocab, generator=gen)).to(dev, sh["dtype"])

    def run(setting, fault):
        idx = fused.argmax(torch.roll(logits, 1, dims=1) if fault else logits, pdl=setting.get("pdl", False))
        return logits.gather(1, idx[:, None]).float()

    def ref():
        return logits.float().max(dim=1, keepdim=True).values
    return [(f"argmax B=5 V={vocab}", run, ref)]


def dense_linear_cases(gen, dev, sh) -> list[tuple[str, Callable, Callable]]:
    from vtengine.kernels import gemv
    cases = []
    for m, k, n in sh["gemm"]:
        w = torch.randn(n, k, generator=gen).to(dev, sh["dtype"])
        x = torch.randn(m, k, generator=gen).to(dev, sh["dtype"])

        def run(setting, fault, x=x, w=w):
            return gemv.linear(x, torch.roll(w, 1, dims=1) if fault else w,
                               out=_poisoned_like((x.shape[0], w.shape[0]), x.dtype, x.device), **setting)

        def ref(x=x, w=w):
            return TorchBackend().linear(x.float(), w.float())
        cases.append((f"dense_linear M={m} K={k} N={n}", run, ref))
    return cases


def setting_for(kernel: str, lever: str, value: Any) -> dict[str, Any]:
    """Launcher keyword arguments that put ``kernel`` in the lever's ``value`` (other levers at their OFF)."""
    if kernel == "decode_attention":
        s = {"gqa_swap": False, "nsplits_cap": "off", "fast_math": False, "pdl": False}
    elif kernel == "w4a16_gemm":
        s = {"dense": False, "pdl": False}
    elif kernel == "dense_linear":
        # the pdl lever acts on the Triton GEMV only (cuBLAS ignores it): test it there
        s = {"triton_gemv": lever == "pdl", "pdl": False}
    else:
        s = {"fast_math": False, "pdl": False}
    key = {"marlin_dense": "dense"}.get(lever, lever)
    if key in s:
        s[key] = value if lever == "nsplits_cap" else bool(value) and value != "off"
    return s


def build_cases(ctx: GateContext, gen) -> list[tuple[str, str, Callable, Callable]]:
    from vtengine import levers
    dev = ctx.device
    sh = _shapes(dev)
    out = []
    for kernel in levers.get(ctx.lever).affects:
        if kernel == "decode_attention":
            cs = decode_cases(gen, dev, sh, ctx.lever)
        elif kernel == "prefill_attention":
            cs = prefill_cases(gen, dev, sh)
        elif kernel == "w4a16_gemm":
            cs = gemm_cases(gen, dev, sh, "mxfp4") + gemm_cases(gen, dev, sh, "nvfp4")
        elif kernel == "rms_norm":
            cs = norm_cases(gen, dev, sh)
        elif kernel == "dense_linear":
            cs = dense_linear_cases(gen, dev, sh)
        elif kernel == "silu_mul":
            cs = silu_cases(gen, dev, sh)
        elif kernel == "qkv_epilogue":
            cs = qkv_epilogue_cases(gen, dev, sh)
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
    rows, failures, bitwise_equal = [], 0, []
    dtype = _shapes(ctx.device)["dtype"]
    bound = REL_L2_BOUND[dtype]
    for kernel, name, run_case, ref in cases:
        setting = setting_for(kernel, ctx.lever, arm.value)
        out = run_case(setting, fault)
        err = rel_l2(out, ref())
        ok = err <= bound and bool(torch.isfinite(out).all())
        failures += not ok
        row = {"case": name, "rel_l2": err if math.isfinite(err) else "inf", "ok": ok}
        if arm.role == "candidate" and not fault:
            base = run_case(setting_for(kernel, ctx.lever, ctx.baseline.value), False)
            row["bitwise_equal_to_baseline"] = bool(torch.equal(out, base))
            bitwise_equal.append(row["bitwise_equal_to_baseline"])
        rows.append(row)
    counts = {"cases": len(rows), "failed": failures, "bound": bound,
              "max_rel_l2": max((r["rel_l2"] for r in rows if r["rel_l2"] != "inf"), default=0.0)}
    byte_exact = all(bitwise_equal) if bitwise_equal else None
    if bitwise_equal:
        counts["bitwise_equal_cases"] = sum(bitwise_equal)
    note = "kernel handed a wrong block index / scale stride / rolled weight" if fault else ""
    return result("op", arm, failures == 0, t0, counts=counts, details={"cases": rows, "fault": note},
                  byte_exact=byte_exact)
