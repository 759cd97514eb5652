"""Static instruction counts of the W4A16 GEMV: the dense swap-AB kernel compiled for sm_90 without a GPU, its
K loop's SASS counted by opcode, per e2m1 decode (``vtengine bench w4a16-sass`` or
``python -m vtengine.bench.w4a16_sass [OUT_DIR]``).

Why: at M <= 16 the kernel is bound by instruction issue, not bytes (bench/results/w4a16-notes-2026-11-30.md), so
the instructions one K step issues per weight are the figure a decode change moves, and they can be read off the
compiled binary on any host: Triton compiles for a named target (``GPUTarget("cuda", 90, 32)``) and ships ptxas and
nvdisasm. The K loop is the longest backward branch's body; weights per thread per iteration = BLOCK_N x BLOCK_K /
(32 x num_warps). The counts are static (each instruction once, whatever its latency or predication) and belong to
the Triton that compiled them (the H200 host runs another: its counts may differ; compare decodes within one run).

The group-scale probe (``probe`` rows): can Triton apply the block scale once per (output, 32-K group) to the
fp32 partial dot instead of per weight pair (the HMUL2s, 0.5 per weight)? That needs the weights decoded without a
scale, so not in bf16 (value * 2**-126 underflows the fp32 products) but in fp16 (value * 2**-14), with fp16
activations (read as fp16 here, as if the producer wrote them so). Three forms of one K step, the same rotation
decode shape: ``unscaled`` (one dot, no scale at all: what the decode and the dot alone cost), ``per_group`` (each
32-K group its own loads, dot and FFMA by its scale) and ``batched`` (one 3-D dot over the groups, scaled and
summed). Not kernels the engine runs: the shapes a route through Triton would take, counted.

Must run in a process whose Triton was imported with the interpreter off (vtengine selects the interpreter on a
host without CUDA as it is imported): ``run()`` starts one with TRITON_INTERPRET=0.
"""
from __future__ import annotations

import collections
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from vtengine.bench import common

CONFIG = dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=3)   # dense_config at M <= 8
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_dense(decode: int, nvfp4: bool = False, split: bool = True, pdl: bool = False, prefetch: bool = False,
                  rope: bool = False):
    """The dense swap-AB kernel compiled for sm_90 (no GPU needed): Triton's CompiledKernel. ``rope``: the lever
    fuse_rope's form (the qkv epilogue of 128-wide heads, pages of 16, after the K loop)."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vtengine.kernels import w4a16
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "y_ptr": "*bf16",
           "sorted_ids_ptr": "*bf16", "num_post_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_ym": "i32", "SPLIT_K": "i32", "res_ptr": "*bf16", "stride_res": "i32", "ss_out_ptr": "*fp32",
           "ss_in_ptr": "*fp32", "n_ss_in": "i32", "g_ptr": "*bf16", "eps": "fp32",
           "pos_ptr": "*i64", "cs_ptr": "*fp32", "stride_cs": "i32", "slot_ptr": "*i32", "qn_ptr": "*bf16",
           "kn_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "HQ": "i32", "HK": "i32",
           "stride_qot": "i32", "stride_qoh": "i32", "stride_cb": "i32", "stride_ct": "i32", "stride_ch": "i32",
           "rope_eps": "fp32"}
    const = dict(NVFP4=nvfp4, DECODE=decode, GATHER=False, SWAP_AB=True, BLOCK_M=CONFIG["BLOCK_M"],
                 BLOCK_N=CONFIG["BLOCK_N"], BLOCK_K=CONFIG["BLOCK_K"], SPLIT=split, EVEN_K=True,
                 DOT_DTYPE=tl.bfloat16, DOT_PREC="tf32", REPACKED=True, USE_PDL=pdl, PREFETCH=prefetch, SILU_MUL=False,
                 ADD_RES=False, NORM=False, SS_BLOCK=1, FAST_MATH=False,
                 PREFETCH_STEPS=4, ROPE=rope, HALF=64 if rope else 1, PAGE_SIZE=16 if rope else 1, ROPE_NORM=rope,
                 ROPE_FAST=rope)
    sig.update({k: "constexpr" for k in const})
    # what the JIT's specialisation tells a launch at Qwen3-8B shapes: 16-byte aligned pointers and N, K and the
    # strides divisible by 16 (M is never specialised)
    aligned = [n for n in sig if n.endswith("_ptr") or n in ("N", "K") or n.startswith("stride_")]
    attrs = {(w4a16._w4a16_gemm_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=w4a16._w4a16_gemm_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"]))


def disassemble(cubin: bytes) -> list[str]:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "k.cubin")
        path.write_bytes(cubin)
        return subprocess.run([str(tool), "-c", str(path)], capture_output=True, text=True,
                              check=True).stdout.splitlines()


def k_loop(sass: list[str]) -> list[str]:
    """Opcodes of the longest loop body (from a label to the backward branch that returns to it)."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(sass):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = [mm.group(1) for x in sass[labels[m.group(1)]:i + 1] if (mm := _INSTR.match(x))]
            if len(body) > len(best):
                best = body
    return best


def count(decode: int, nvfp4: bool = False, rope: bool = False) -> dict:
    return _counted(k_loop(disassemble(compile_dense(decode, nvfp4, rope=rope).asm["cubin"])))


def before_wait(sass: list[str]) -> dict[str, int]:
    """Instructions issued before the PDL wait (griddepcontrol.wait = ACQBULK): L2 prefetches (CCTL.E.PF2) and
    global loads (LDG / LDGSTS). Under pdl_prefetch the weights' prefetches must sit there, and no load may."""
    ops = [m.group(1) for line in sass if (m := _INSTR.match(line))]
    head = ops[:ops.index("ACQBULK")] if "ACQBULK" in ops else []
    return {"waits": ops.count("ACQBULK"), "prefetches": sum(op.startswith("CCTL.E.PF2") for op in head),
            "loads": sum(op.startswith(("LDG", "LDGSTS")) for op in head)}


_PROBE = None


def _probe_kernel():
    """The probe's kernel, built on first use (this module imports triton lazily: see run())."""
    global _PROBE
    if _PROBE is not None:
        return _PROBE
    import triton
    import triton.language as tl
    from vtengine.kernels.w4a16 import _interleave8

    # the rotation decode's shape (4 rotations, 4 LOP3s per word) with the fp16 mask: sign at 15 / 31, e1 e0 m at
    # 11..9 / 27..25, so a pair is value * 2**-14 and needs no per-pair multiply
    decode = tl.constexpr("""
    {
    .reg .b32 o, r2, r6, r8, r12;
    and.b32 o, $8, 0x8E008E00;
    mov.b32 {$0, $4}, o;
    shf.l.wrap.b32 r12, $8, $8, 12;
    and.b32 o, r12, 0x8E008E00;
    mov.b32 {$1, $5}, o;
    shf.l.wrap.b32 r2, $8, $8, 2;
    shf.l.wrap.b32 r6, $8, $8, 6;
    xor.b32 o, r2, r6;
    and.b32 o, o, 0x8E008E00;
    mov.b32 {$2, $6}, o;
    shf.l.wrap.b32 r8, $8, $8, 8;
    xor.b32 o, r2, r8;
    and.b32 o, o, 0x8E008E00;
    mov.b32 {$3, $7}, o;
    }
    """)

    @triton.jit
    def _fp16_tile(p):
        e0, e1, e2, e3, e4, e5, e6, e7 = tl.inline_asm_elementwise(
            decode, "=h,=h,=h,=h,=h,=h,=h,=h,r", [p], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
        return _interleave8(e0, e1, e2, e3, e4, e5, e6, e7)

    @triton.jit
    def _group_scale_probe(x_ptr, w_ptr, s_ptr, y_ptr, K, stride_xm, stride_wn, stride_sn, stride_ym,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FORM: tl.constexpr):
        NSB: tl.constexpr = BLOCK_K // 32
        GK: tl.constexpr = 32 if FORM == 1 else BLOCK_K            # K per load: a group, or the whole step
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, GK // 8)[None, :]
        x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + tl.arange(0, GK)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if FORM == 1:
                for g in tl.static_range(NSB):
                    sc = tl.load(s_ptr + offs_n.to(tl.int64) * stride_sn + k0 // 32 + g)
                    s = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
                    w = _fp16_tile(tl.load(w_ptrs + k0 // 8 + g * 4))
                    acc += tl.dot(w, tl.trans(tl.load(x_ptrs + k0 + g * 32))) * s[:, None]
            else:
                w = _fp16_tile(tl.load(w_ptrs + k0 // 8))
                a = tl.load(x_ptrs + k0)
                if FORM == 0:
                    acc = tl.dot(w, tl.trans(a), acc)
                else:
                    sc = tl.load(s_ptr + offs_n[:, None].to(tl.int64) * stride_sn + k0 // 32
                                 + tl.arange(0, NSB)[None, :])
                    s = ((sc.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)
                    w3 = tl.permute(tl.reshape(w, [BLOCK_N, NSB, 32]), (1, 0, 2))
                    a3 = tl.permute(tl.reshape(a, [BLOCK_M, NSB, 32]), (1, 2, 0))
                    s3 = tl.permute(tl.reshape(s, [BLOCK_N, NSB, 1]), (1, 0, 2))
                    acc += tl.sum(tl.dot(w3, a3) * s3, axis=0)
        tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(tl.bfloat16))

    _PROBE = _group_scale_probe
    return _PROBE


PROBE_FORMS = {"unscaled": 0, "per_group": 1, "batched": 2}


def count_probe(form: str) -> dict:
    """The group-scale probe's K loop (see the module docstring), compiled for sm_90 at CONFIG's tiles."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    fn = _probe_kernel()
    sig = {"x_ptr": "*fp16", "w_ptr": "*i32", "s_ptr": "*u8", "y_ptr": "*bf16", "K": "i32", "stride_xm": "i32",
           "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}
    const = dict(BLOCK_M=CONFIG["BLOCK_M"], BLOCK_N=CONFIG["BLOCK_N"], BLOCK_K=CONFIG["BLOCK_K"],
                 FORM=PROBE_FORMS[form])
    sig.update({k: "constexpr" for k in const})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig if n != "FORM" and sig[n] != "constexpr"}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"]))
    return _counted(k_loop(disassemble(kernel.asm["cubin"])))


def _counted(body: list[str]) -> dict:
    weights = CONFIG["BLOCK_N"] * CONFIG["BLOCK_K"] // (32 * CONFIG["num_warps"])
    ops = collections.Counter(op.split(".")[0] for op in body)
    return {"instructions": len(body), "weights_per_thread": weights,
            "per_weight": round(len(body) / weights, 3), "by_opcode": dict(ops.most_common())}


def main(out_dir: str = "bench/results") -> dict:
    import triton
    from vtengine.kernels import w4a16
    decodes = {w4a16.DECODE_NAMES[d]: d for d in (w4a16.DECODE_ASM, w4a16.DECODE_ROT)}
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"bench": "w4a16_sass", "target": "sm_90 (compiled without a GPU)", "triton": triton.__version__,
              "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "config": CONFIG, "rows": []}
    for fmt in ("mxfp4", "nvfp4"):
        for name, d in decodes.items():
            row = {"fmt": fmt, "decode": name, **count(d, nvfp4=fmt == "nvfp4")}
            result["rows"].append(row)
            print(json.dumps({k: row[k] for k in ("fmt", "decode", "instructions", "per_weight")}), flush=True)
    # the lever fuse_rope: the qkv epilogue after the K loop leaves the loop as it is
    result["rope"] = {"fmt": "mxfp4", "decode": "bf16_rot", **count(w4a16.DECODE_ROT, rope=True)}
    print(json.dumps({k: result["rope"][k] for k in ("fmt", "decode", "instructions", "per_weight")}), flush=True)
    # the lever pdl_prefetch (with pdl): what runs before the wait
    result["pdl"] = {name: before_wait(disassemble(compile_dense(w4a16.DECODE_ROT, pdl=True, prefetch=pf)
                                                   .asm["cubin"]))
                     for name, pf in (("pdl", False), ("pdl_prefetch", True))}
    print(json.dumps(result["pdl"]), flush=True)
    result["probe"] = []
    for form in PROBE_FORMS:
        row = {"form": form, **count_probe(form)}
        result["probe"].append(row)
        print(json.dumps({k: row[k] for k in ("form", "instructions", "per_weight")}), flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / common.unique_stem(out, f"w4a16-sass-{now.strftime('%Y-%m-%d')}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# W4A16 dense GEMV K loop, static SASS counts — sm_90, triton {result['triton']}, "
             f"{result['date_utc']}",
             "", f"Config {CONFIG}; {result['rows'][0]['weights_per_thread']} weights per thread per iteration.", "",
             "| fmt | decode | instructions | per weight | top opcodes |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_opcode"].items())[:8])
        lines.append(f"| {r['fmt']} | {r['decode']} | {r['instructions']} | {r['per_weight']} | {top} |")
    lines += ["", f"With the lever fuse_rope's qkv epilogue (rotation decode, MXFP4): {result['rope']['instructions']} "
              f"instructions in the K loop, {result['rope']['per_weight']} per weight."]
    lines += ["", "Before the PDL wait (rotation decode, MXFP4): " + "; ".join(
        f"{name}: {v['prefetches']} L2 prefetches, {v['loads']} global loads, {v['waits']} wait(s)"
        for name, v in result["pdl"].items())]
    lines += ["", "Group-scale probe (MXFP4 codes decoded to fp16 without a scale, fp16 activations; see the module "
              "docstring):", "", "| form | instructions | per weight | top opcodes |", "|---|---|---|---|"]
    for r in result["probe"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_opcode"].items())[:8])
        lines.append(f"| {r['form']} | {r['instructions']} | {r['per_weight']} | {top} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


def run_offline(module: str, out_dir: str = "bench/results") -> int:
    """``python -m <module> out_dir`` in a fresh process with the interpreter off (a static-SASS bench's main());
    its exit status."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", module, out_dir], env=env).returncode


def entry(module: str, main_fn, argv: list[str]) -> None:
    """A static-SASS bench's ``__main__``: main_fn here when the interpreter is off, else in a fresh process."""
    if os.environ.get("TRITON_INTERPRET") != "0":
        sys.exit(run_offline(module, *(argv[1:2] or [])))
    main_fn(*(argv[1:2] or []))


def run(out_dir: str = "bench/results") -> int:
    """main() in a fresh process with the interpreter off; its exit status."""
    return run_offline("vtengine.bench.w4a16_sass", out_dir)


if __name__ == "__main__":
    entry("vtengine.bench.w4a16_sass", main, sys.argv)
