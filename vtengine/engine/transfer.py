"""Host-to-device inputs that do not wait for the device.

``torch.tensor(data, device="cuda")`` copies from pageable host memory, and such a copy synchronises the stream: with
a step in flight (async scheduling) preparing the next step's inputs would wait for it, and nothing would overlap.
Staged in pinned memory, the copy is queued behind the step in flight instead (the caching host allocator keeps the
pinned buffer until the copy has run)."""
from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str, out: torch.Tensor | None = None) -> torch.Tensor:
    """A host list or CPU tensor on ``device``; on CUDA without a host sync. With ``out`` (a tensor on ``device`` of
    the data's shape, e.g. rows of a CUDA graph's static input buffer) the data lands there, in one copy, and
    ``out`` is returned."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    cuda = torch.device(device).type == "cuda"
    if out is not None:
        if out.shape != t.shape or out.dtype != t.dtype:
            # a dtype mismatch would convert on the host into pageable memory: a copy that waits for the device
            raise ValueError(f"to_device: data of shape {tuple(t.shape)} and dtype {t.dtype} cannot fill out of "
                             f"shape {tuple(out.shape)} and dtype {out.dtype}")
        return out.copy_(t.pin_memory() if cuda else t, non_blocking=cuda)
    if not cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
