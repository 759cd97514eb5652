"""Numerical checks shared by the kernel tests and the campaign's op gate (one definition of each)."""
from __future__ import annotations

import os

import torch


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; inf when out holds a NaN or inf (an unwritten, poisoned element never
    passes)."""
    if not torch.isfinite(out).all():
        return float("inf")
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fresh_generator() -> tuple[torch.Generator, int]:
    """A generator on a fresh random seed (returned, so a failure can name it and be replayed)."""
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed
