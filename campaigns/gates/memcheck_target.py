"""The child process memcheck runs: a short engine run in the arm's setting, clean or with a deliberate fault inside
the engine's own run (vtengine/faults.py ``oob``: decode attention reads through block-table entries far past the
end of the KV cache), which memcheck must report."""
from __future__ import annotations

import json
import sys

import torch


def main() -> int:
    spec = json.loads(sys.argv[1])
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    from vtengine.faults import Fault, set_fault
    llm = LLM(model=spec["model"], quant=spec["quant"], levers=spec["levers"], cuda_graphs=False, num_kv_blocks=64)
    if spec.get("fault"):
        set_fault(llm.engine, Fault("oob"))
    llm.generate([[5, 6, 7, 8] * 9, [9] * 3], SamplingParams(max_tokens=spec["max_tokens"], temperature=0,
                                                             ignore_eos=True))
    torch.cuda.synchronize()
    print("MEMCHECK_TARGET_DONE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
