"""Static instruction counts of the W4A16 GEMV: the dense swap-AB kernel compiled for sm_90 without a GPU, its
K loop's SASS counted by opcode, per e2m1 decode (``vtengine bench w4a16-sass`` or
``python -m vtengine.bench.w4a16_sass [OUT_DIR]``).

Why: at M <= 16 the kernel is bound by instruction issue, not bytes (bench/results/w4a16-notes-2026-11-30.md), so
the instructions one K step issues per weight are the figure a decode change moves, and they can be read off the
compiled binary on any host: Triton compiles for a named target (``GPUTarget("cuda", 90, 32)``) and ships ptxas and
nvdisasm. The K loop is the longest backward branch's body; weights per thread per iteration = BLOCK_N x BLOCK_K /
(32 x num_warps). The counts are static (each instruction once, whatever its latency or predication) and belong to
the Triton that compiled them (the H200 host runs another: its counts may differ; compare decodes within one run).

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

CONFIG = dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=256, num_warps=2, num_stages=3)   # dense_config at M <= 8
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s*(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def compile_dense(decode: int, nvfp4: bool = False, split: bool = True, pdl: bool = False, prefetch: bool = False):
    """The dense swap-AB kernel compiled for sm_90 (no GPU needed): Triton's CompiledKernel."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from vtengine.kernels import w4a16
    sig = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*u8", "gs_ptr": "*fp32", "y_ptr": "*bf16",
           "sorted_ids_ptr": "*bf16", "num_post_ptr": "*bf16", "ws_ptr": "*fp32", "lock_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_ym": "i32", "SPLIT_K": "i32", "res_ptr": "*bf16", "stride_res": "i32", "ss_out_ptr": "*fp32",
           "ss_in_ptr": "*fp32", "n_ss_in": "i32", "g_ptr": "*bf16", "eps": "fp32"}
    const = dict(NVFP4=nvfp4, DECODE=decode, GATHER=False, SWAP_AB=True, BLOCK_M=CONFIG["BLOCK_M"],
                 BLOCK_N=CONFIG["BLOCK_N"], BLOCK_K=CONFIG["BLOCK_K"], SPLIT=split, EVEN_K=True,
                 DOT_DTYPE=tl.bfloat16, DOT_PREC="tf32", REPACKED=True, USE_PDL=pdl, PREFETCH=prefetch, SILU_MUL=False,
                 ADD_RES=False, NORM=False, SS_BLOCK=1, FAST_MATH=False)
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


def count(decode: int, nvfp4: bool = False) -> dict:
    body = k_loop(disassemble(compile_dense(decode, nvfp4).asm["cubin"]))
    weights = CONFIG["BLOCK_N"] * CONFIG["BLOCK_K"] // (32 * CONFIG["num_warps"])
    ops = collections.Counter(op.split(".")[0] for op in body)
    return {"instructions": len(body), "weights_per_thread": weights,
            "per_weight": round(len(body) / weights, 3), "by_opcode": dict(ops.most_common())}


def before_wait(sass: list[str]) -> dict[str, int]:
    """Instructions issued before the PDL wait (griddepcontrol.wait = ACQBULK): L2 prefetches (CCTL.E.PF2) and
    global loads (LDG / LDGSTS). Under pdl_prefetch the weights' prefetches must sit there, and no load may."""
    ops = [m.group(1) for line in sass if (m := _INSTR.match(line))]
    head = ops[:ops.index("ACQBULK")] if "ACQBULK" in ops else []
    return {"waits": ops.count("ACQBULK"), "prefetches": sum(op.startswith("CCTL.E.PF2") for op in head),
            "loads": sum(op.startswith(("LDG", "LDGSTS")) for op in head)}


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
    # the lever pdl_prefetch (with pdl): what runs before the wait
    result["pdl"] = {name: before_wait(disassemble(compile_dense(w4a16.DECODE_ROT, pdl=True, prefetch=pf)
                                                   .asm["cubin"]))
                     for name, pf in (("pdl", False), ("pdl_prefetch", True))}
    print(json.dumps(result["pdl"]), flush=True)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"w4a16-sass-{now.strftime('%Y-%m-%d')}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# W4A16 dense GEMV K loop, static SASS counts — sm_90, triton {result['triton']}, "
             f"{result['date_utc']}",
             "", f"Config {CONFIG}; {result['rows'][0]['weights_per_thread']} weights per thread per iteration.", "",
             "| fmt | decode | instructions | per weight | top opcodes |", "|---|---|---|---|---|"]
    for r in result["rows"]:
        top = ", ".join(f"{k} {v}" for k, v in list(r["by_opcode"].items())[:8])
        lines.append(f"| {r['fmt']} | {r['decode']} | {r['instructions']} | {r['per_weight']} | {top} |")
    lines += ["", "Before the PDL wait (rotation decode, MXFP4): " + "; ".join(
        f"{name}: {v['prefetches']} L2 prefetches, {v['loads']} global loads, {v['waits']} wait(s)"
        for name, v in result["pdl"].items())]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return result


def run(out_dir: str = "bench/results") -> int:
    """main() in a fresh process with the interpreter off; its exit status."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    return subprocess.run([sys.executable, "-m", "vtengine.bench.w4a16_sass", out_dir], env=env).returncode


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "0":
        sys.exit(run(*(sys.argv[1:2] or [])))
    main(*(sys.argv[1:2] or []))
