"""How many KV splits a split-KV decode attention launch uses (the ``nsplits_cap`` lever lives here).

Split-KV decode gives each (sequence, head) several programs, each over a slice of the context, and merges their
partial results with a log-sum-exp (stage 2). More splits fill more SMs when batch x heads is small, but each split
costs a partial output written and read back by the merge, and splits beyond what the SMs can run at once only add
a tail wave. The count comes from FlashAttention-2's ``num_splits_heuristic`` (hopper/heuristics.h and
flash_api.cpp there), re-derived here:

- if the grid without splits already fills >= 80% of the SMs, use 1 split;
- otherwise, for each split count s in 1..min(max_splits, num_sms, num_n_blocks), its wave efficiency is
  n_waves / ceil(n_waves) with n_waves = programs * s / num_sms;
- a split count is *eligible* only if it changes the KV blocks per split: with 64 blocks, 11 splits give
  ceil(64/11) = 6 blocks each and 12 splits also 6 (the 12th split would be empty), so 12 is skipped;
- the answer is the smallest eligible count whose efficiency is >= 0.85 x the best eligible efficiency
  (fewer splits, less merge traffic, at nearly the best occupancy).

Pure Python, no device sync: everything here is known on the host before the launch.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

H200_SMS = 132              # the SM count assumed when there is no GPU (the interpreter, CPU CI): one H200
MAX_SPLITS = 128            # FlashAttention's cap, and ours when nsplits_cap is "off"


def sm_count(device: torch.device | str | int | None = None) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when None); H200_SMS when CUDA is unavailable or
    the device is not a CUDA device (the interpreter runs CPU tensors as if on an H200)."""
    if not torch.cuda.is_available():
        return H200_SMS
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type != "cuda":
            return H200_SMS
        device = device.index
    return _cuda_sm_count(torch.cuda.current_device() if device is None else int(device))


@lru_cache(maxsize=None)
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def is_split_eligible(num_splits: int, num_n_blocks: int) -> bool:
    """False when ``num_splits`` gives the same blocks per split as ``num_splits - 1`` (its last split is empty
    or it is the same partition under another name)."""
    return num_splits == 1 or _ceil_div(num_n_blocks, num_splits) != _ceil_div(num_n_blocks, num_splits - 1)


def num_splits_heuristic(programs: int, num_sms: int, num_n_blocks: int, max_splits: int) -> int:
    """FlashAttention-2's split count: ``programs`` = launch grid without splits (batch x heads x m-blocks),
    ``num_n_blocks`` = KV tiles a program would walk with one split."""
    if programs >= 0.8 * num_sms:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eff = {}
    for s in range(1, max_splits + 1):
        if is_split_eligible(s, num_n_blocks):
            n_waves = programs * s / num_sms
            eff[s] = n_waves / math.ceil(n_waves)
    if not eff:
        return 1
    best = max(eff.values())
    return next(s for s in sorted(eff) if eff[s] >= 0.85 * best)


def wave_cap(programs: int, num_sms: int) -> int:
    """The "auto" cap: the most splits whose grid still fits in one wave, floor(num_sms / programs), at least 1.

    One wave = ``num_sms`` programs at once (the decode launcher passes SMs x programs_per_sm). Beyond one wave
    a split only adds a tail wave and merge traffic, with no more bytes in flight."""
    return max(1, num_sms // max(1, programs))


def parse_cap(nsplits_cap) -> str | int:
    """Canonical lever value: "off", "auto" or a positive int (False/None/0/"0"/"false" mean "off")."""
    if nsplits_cap is None or nsplits_cap is False:
        return "off"
    if isinstance(nsplits_cap, bool):
        raise ValueError(f"nsplits_cap {nsplits_cap!r} is not valid; accepted: 'off', 'auto' or a positive integer")
    if isinstance(nsplits_cap, int):
        if nsplits_cap == 0:
            return "off"
        if nsplits_cap > 0:
            return nsplits_cap
    elif isinstance(nsplits_cap, str):
        text = nsplits_cap.strip().lower()
        if text in ("off", "0", "false"):
            return "off"
        if text == "auto":
            return "auto"
        if text.isdigit() and int(text) > 0:
            return int(text)
    raise ValueError(f"nsplits_cap {nsplits_cap!r} is not valid; accepted: 'off', 'auto' or a positive integer")


@lru_cache(maxsize=4096)
def decode_num_splits(programs: int, num_n_blocks: int, nsplits_cap="off", num_sms: int | None = None) -> int:
    """Split count for one decode launch (cached: the launcher calls it every step, and the search is Python).

    programs:      grid size without splits: batch x q_heads (per-q-head route) or batch x kv_heads (gqa_swap).
    num_sms:       programs one wave holds: the decode launcher passes SMs x programs_per_sm of its tiles.
    num_n_blocks:  KV tiles (BLOCK_N tokens) in the longest context the launch may see (a host-side bound).
    nsplits_cap:   "off": the heuristic with max_splits = MAX_SPLITS (128; it is further bounded by num_sms and
                   num_n_blocks); "auto": max_splits = wave_cap(programs, num_sms), i.e. at most one wave of
                   programs; N: max_splits = min(N, MAX_SPLITS).
    """
    num_sms = sm_count() if num_sms is None else num_sms
    cap = parse_cap(nsplits_cap)
    if cap == "off":
        max_splits = MAX_SPLITS
    elif cap == "auto":
        max_splits = wave_cap(programs, num_sms)
    else:
        max_splits = min(cap, MAX_SPLITS)
    return num_splits_heuristic(programs, num_sms, max(1, num_n_blocks), max_splits)
