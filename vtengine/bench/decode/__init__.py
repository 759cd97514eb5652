"""End-to-end decode benchmark: ms per decode step at concurrency 1 and 8 through the full engine (paged cache,
CUDA graphs, Triton kernels), as a fraction of the bandwidth floor, against HF transformers (static cache +
torch.compile) measured in the same run, and where the step's time goes kernel by kernel.

    vtengine bench decode [--out DIR] [--models qwen3-8b:bf16,...] [--batches 1,8] [--hf] [--profile]

One concept per module, in the order a run uses them:

- ``results``         the typed results (DecodeResult and its rows) with every figure's definition, and their JSON
- ``engine_timing``   build an engine, time its decode steps (EngineTiming)
- ``kernel_profile``  torch.profiler over decode steps, the Kineto trace aggregated by kernel (KernelProfile)
- ``hf_baseline``     HF transformers at the same shapes, static cache + generate's compile (HFTiming)
- ``report``          the result files: JSON, and the markdown rendered from it
- ``cli``             the flags, the phases in order, the incremental saves (``main``)

The copy bandwidth the floor divides by is vtengine/bench/common.py's, the same as every other benchmark's.
Writes OUT_DIR/decode-<date>.json and .md (decode-<date>-2... when a run of the same day is there), and copies
both to $OUT when that is set.
"""
from vtengine.bench.decode.cli import main

__all__ = ["main"]
