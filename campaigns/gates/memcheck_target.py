"""The child process memcheck runs: a short engine run (or, as the gate's fault, a planted out-of-bounds write)."""
from __future__ import annotations

import json
import sys

import torch


def planted_oob_write() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def _oob(out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK) + n * 1024        # far past the end, no mask: a deliberate fault
        tl.store(out_ptr + offs, tl.zeros([BLOCK], dtype=tl.float32))

    out = torch.empty(16, device="cuda")
    _oob[(1,)](out, 64, BLOCK=16)
    torch.cuda.synchronize()


def main() -> int:
    spec = json.loads(sys.argv[1])
    if spec.get("fault"):
        planted_oob_write()
        return 0
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    llm = LLM(model=spec["model"], quant=spec["quant"], levers=spec["levers"], cuda_graphs=False, num_kv_blocks=64)
    llm.generate([[5, 6, 7, 8] * 9, [9] * 3], SamplingParams(max_tokens=spec["max_tokens"], temperature=0,
                                                             ignore_eos=True))
    torch.cuda.synchronize()
    print("MEMCHECK_TARGET_DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
