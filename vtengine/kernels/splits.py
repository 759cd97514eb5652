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

from vtengine.kernels import H200_SMS, sm_count  # noqa: F401  (the SM count the heuristic defaults to)

MAX_SPLITS = 128            # FlashAttention's cap, and ours when nsplits_cap is "off"


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


# -- the split rule (the ``split_rule`` lever) ------------------------------------------------------------------
# "off" (or "count"): the slot count S comes from the heuristic above over the context bound (max_model_len in the
#     engine), and sequence b's slice length is its context over S in whole tiles (at least two tiles).
#     Batch-invariant, but the slices depend on the bound: a 40k bound cuts a 1k context into 128-token slices,
#     and most of the S programs per (sequence, head) find no live slice (they exit at once).
# "len<L>": every slice is L tokens (L rounded up to whole tiles): a context of n tokens has cdiv(n, L) live slices,
#     whatever the batch and whatever the bound, so the result depends on the sequence alone. The bound only sizes
#     the partials workspace (cdiv(bound, L) slots); the grid has G programs per (sequence, head), each walking
#     slices s, s + G, ..., where G fills about one wave of the GPU (wave / (batch x heads), at least 1): a batch
#     of 64 gets one or two long-running programs per head, batch 1 as many as its slices.
def parse_split_rule(rule) -> tuple[str, int | None]:
    """("count", None) or ("length", L) from a lever value: "off" (the lever's default; also "count", None or False)
    or "len<L>" with L a positive integer of tokens."""
    if rule is None or rule is False:
        return "count", None
    text = str(rule).strip().lower()
    if text in ("count", "off", "0", "false"):
        return "count", None
    if text.startswith("len") and text[3:].isdigit() and int(text[3:]) > 0:
        return "length", int(text[3:])
    raise ValueError(f"split_rule {rule!r} is not valid; accepted: 'off' (the split count from the bound; also "
                     f"'count') or 'len<L>' with L a positive number of tokens (e.g. 'len256', 'len512')")


class SplitPlan(tuple):
    """(slots, min_split, programs, uncapped_programs): partial slots per (sequence, q head) and the slice-length
    formula's floor (together they fix every slice), and the grid's programs per (sequence, grid head) with the cap
    applied and without it. A plain tuple so it caches and compares."""
    __slots__ = ()

    def __new__(cls, slots: int, min_split: int, programs: int, uncapped: int):
        return super().__new__(cls, (slots, min_split, programs, uncapped))

    slots = property(lambda self: self[0])
    min_split = property(lambda self: self[1])
    programs = property(lambda self: self[2])
    uncapped = property(lambda self: self[3])


def wave_programs(batch: int, grid_heads: int, wave: int) -> int:
    """Programs per (sequence, grid head) that fill about one wave: cdiv(wave, batch x heads), at least 1. Which
    program walks which slice changes no bit, so this may follow the batch."""
    return max(1, _ceil_div(wave, max(1, batch * grid_heads)))


@lru_cache(maxsize=4096)
def split_plan(split_rule, nsplits_cap, grid_heads: int, batch: int, bound: int, block_n: int, wave: int) -> SplitPlan:
    """The split decode of one launch. ``grid_heads``: programs per sequence without splits (q heads, or kv heads
    under gqa_swap); ``bound``: the host-side bound on every context; ``wave``: programs the GPU holds at once
    (SMs x programs per SM). Under "count" the cap bounds the slot count (= programs); under "len<L>" it bounds
    the programs per (sequence, head) only (the slices are fixed by L), "auto" to floor(wave / (batch x heads))."""
    kind, length = parse_split_rule(split_rule)
    bound = max(1, int(bound))
    if kind == "count":
        min_split = 2 * block_n
        slices = _ceil_div(bound, min_split)
        slots = decode_num_splits(grid_heads, slices, nsplits_cap, num_sms=wave)
        return SplitPlan(slots, min_split, slots, decode_num_splits(grid_heads, slices, "off", num_sms=wave))
    min_split = _ceil_div(length, block_n) * block_n
    slots = _ceil_div(bound, min_split)
    uncapped = min(slots, wave_programs(batch, grid_heads, wave))
    cap = parse_cap(nsplits_cap)
    if cap == "off":
        programs = uncapped
    elif cap == "auto":
        programs = min(uncapped, wave_cap(batch * grid_heads, wave))
    else:
        programs = min(uncapped, cap)
    return SplitPlan(slots, min_split, programs, uncapped)
