"""Where the lever fuse_norm's work sits in the bf16 GEMV: the kernel compiled for sm_90 without a GPU, its SASS cut
at the K loop (``vtengine bench fused-sass`` or ``python -m vtengine.bench.fused_sass [OUT_DIR]``).

Why: a decode GEMV takes 8-48 µs at Qwen3-8B shapes, so a dependent load or a long reduction before the first
weight load, or after the last sums, is a latency the weight stream does not hide. On the H200 (2026-12-02) the
fused GEMVs were 407 µs per step slower than the plain ones: the NORM prologue summed the producer's sums of
squares in fp64 before the K loop, and the ADD_RES epilogue loaded the residual after it. The counts here say
where that code is: instructions and global loads before the loop (``pre``), in it (``loop``) and after it
(``post``), per fused form and with split-K on and off. Static counts (each instruction once), of the Triton that
compiled them; the H200 host runs another.

Must run in a process whose Triton was imported with the interpreter off: ``run()`` starts one.
"""
from __future__ import annotations

import datetime
import json
import re
import sys
from pathlib import Path

from vtengine.bench import common
from vtengine.bench.w4a16_sass import _INSTR, before_wait, disassemble, entry, run_offline

# gemv_config's tiles on the H200 for o / qkv (32 W rows x 256 K, 3 stages, 4 warps); SS_BLOCK: a 4,096-wide
# producer's 128 tiles of sums
CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SS_BLOCK=128, num_warps=4, num_stages=3)
# form: (NORM, ADD_RES, gained: GAINED with NORM / GAIN_OUT with ADD_RES, ROPE), what the engine runs: add_res_gain
# (o, down), norm_gained (gate_up, and qkv with fuse_rope off), norm_gained_rope (qkv with the lever fuse_rope: the
# qkv epilogue of Qwen3-8B's 128-wide heads, pages of 16, in the head's last program)
FORMS = {"plain": (False, False, False, False), "norm": (True, False, False, False),
         "add_res": (False, True, False, False), "norm_gained": (True, False, True, False),
         "add_res_gain": (False, True, True, False), "norm_gained_rope": (True, False, True, True)}
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BACK = re.compile(r"BRA `\((\.L_x_\d+)\)")


def compile_gemv(norm: bool, add_res: bool, split: bool, prefetch: bool = False, gained: bool = False,
                 rope: bool = False):
    """The bf16 GEMV (gemv._gemv_kernel) compiled for sm_90, with PDL (and ``prefetch``: the lever pdl_prefetch's
    L2 prefetch of W before the wait; ``rope``: the lever fuse_rope's qkv epilogue): Triton's CompiledKernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vtengine.kernels import gemv
    sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
           "SPLIT_K": "i32", "res_ptr": "*bf16", "stride_res": "i32", "ss_out_ptr": "*fp32", "ss_in_ptr": "*fp32",
           "n_ss_in": "i32", "g_ptr": "*bf16", "eps": "fp32", "gain_ptr": "*bf16", "xg_ptr": "*bf16",
           "pos_ptr": "*i64", "cs_ptr": "*fp32", "stride_cs": "i32", "slot_ptr": "*i32", "qn_ptr": "*bf16",
           "kn_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "HQ": "i32", "HK": "i32",
           "stride_qot": "i32", "stride_qoh": "i32", "stride_cb": "i32", "stride_ct": "i32", "stride_ch": "i32",
           "rope_eps": "fp32"}
    const = dict(BLOCK_M=CONFIG["BLOCK_M"], BLOCK_N=CONFIG["BLOCK_N"], BLOCK_K=CONFIG["BLOCK_K"], SPLIT=split,
                 EVEN_K=True, DOT_DTYPE=tl.bfloat16, DOT_PREC="tf32", USE_PDL=True, SILU_MUL=False,
                 ADD_RES=add_res, NORM=norm, SS_BLOCK=CONFIG["SS_BLOCK"], FAST_MATH=False, PREFETCH=prefetch,
                 PREFETCH_STEPS=gemv.prefetch_steps(CONFIG["BLOCK_N"], CONFIG["BLOCK_K"], 2), W_BYTES=2,
                 GAINED=norm and gained, GAIN_OUT=add_res and gained, ROPE=rope, HALF=64 if rope else 1,
                 PAGE_SIZE=16 if rope else 1, ROPE_NORM=rope, ROPE_FAST=rope)
    sig.update({k: "constexpr" for k in const})
    # what the JIT's specialisation tells a launch at Qwen3-8B shapes (as w4a16_sass does)
    aligned = [n for n in sig if n.endswith("_ptr") or n in ("N", "K") or n.startswith("stride_")]
    attrs = {(gemv._gemv_kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=gemv._gemv_kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=CONFIG["num_warps"], num_stages=CONFIG["num_stages"]))


def around_loop(sass: list[str]) -> dict[str, int]:
    """Instructions and global loads before, in and after the K loop (the longest backward branch's body)."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := _LABEL.match(line))}
    loops = [(labels[m.group(1)], i) for i, line in enumerate(sass)
             if (m := _BACK.search(line)) and labels.get(m.group(1), i) < i]
    if not loops:
        raise ValueError("no K loop (backward branch) in the SASS")
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    ops = [(i, m.group(1)) for i, line in enumerate(sass) if (m := _INSTR.match(line))]
    parts = {"pre": [o for i, o in ops if i < lo], "loop": [o for i, o in ops if lo <= i <= hi],
             "post": [o for i, o in ops if i > hi]}
    out = {}
    for name, part in parts.items():
        out[name] = len(part)
        out[f"{name}_loads"] = sum(o.startswith(("LDG", "LDGSTS")) for o in part)
    return out


def main(out_dir: str = "bench/results") -> dict:
    import triton
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"bench": "fused_sass", "target": "sm_90 (compiled without a GPU)", "triton": triton.__version__,
              "date_utc": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "config": CONFIG, "rows": []}
    for form, (norm, add_res, gained, rope) in FORMS.items():
        for split in (False, True):
            cubin = compile_gemv(norm, add_res, split, gained=gained, rope=rope).asm["cubin"]
            row = {"form": form, "split": split, **around_loop(disassemble(cubin))}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
    # the lever pdl_prefetch (with pdl): what runs before the wait (the split-K NORM form, the busiest prologue)
    result["pdl"] = {name: before_wait(disassemble(compile_gemv(True, False, True, prefetch=pf).asm["cubin"]))
                     for name, pf in (("pdl", False), ("pdl_prefetch", True))}
    print(json.dumps(result["pdl"]), flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / common.unique_stem(out, f"fused-sass-{now.strftime('%Y-%m-%d')}")
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# bf16 GEMV around its K loop, static SASS counts — sm_90, triton {result['triton']}, "
             f"{result['date_utc']}", "", f"Config {CONFIG}; with PDL.", "",
             "| form | split-K | before the loop | its loads | loop | its loads | after the loop | its loads |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['form']} | {'yes' if r['split'] else 'no'} | {r['pre']} | {r['pre_loads']} | "
                     f"{r['loop']} | {r['loop_loads']} | {r['post']} | {r['post_loads']} |")
    lines += ["", "Before the PDL wait (split-K NORM form): " + "; ".join(
        f"{name}: {v['prefetches']} L2 prefetches, {v['loads']} global loads, {v['waits']} wait(s)"
        for name, v in result["pdl"].items())]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


def run(out_dir: str = "bench/results") -> int:
    """main() in a fresh process with the interpreter off; its exit status."""
    return run_offline("vtengine.bench.fused_sass", out_dir)


if __name__ == "__main__":
    entry("vtengine.bench.fused_sass", main, sys.argv)
