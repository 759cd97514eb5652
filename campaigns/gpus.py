"""One GPU per campaign when several run at once on one host.

A sweep's jobs (``vtcampaign run -m ...``) may run side by side: Hydra's submitit_local launcher starts them all at
once and hands each the same devices, and a SLURM node may hold more GPUs than one job needs. Each job therefore
takes a GPU slot: an exclusive file lock on one of the host's GPUs (``gpu-<host>-<id>.lock`` in a lock directory
the jobs share), waiting while all are taken, and runs its campaign with CUDA_VISIBLE_DEVICES set to that GPU, so
the campaign's gate engines and both arms' servers share it and no other campaign does. The lock is released when
the job ends (the kernel drops it with the process, even on SIGKILL).

The host's GPUs are VTCAMPAIGN_GPUS (the submitting process sets it from what it sees, since submitit hands jobs
an empty CUDA_VISIBLE_DEVICES unless it assigns GPUs itself), else CUDA_VISIBLE_DEVICES, else NVML's count. With
none (a CPU host) every job runs at once, unslotted.
"""
from __future__ import annotations

import fcntl
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ENV = "VTCAMPAIGN_GPUS"


def host_gpus() -> list[str]:
    """The GPU ids this host offers campaigns (see the module docstring for where they come from)."""
    for var in (ENV, "CUDA_VISIBLE_DEVICES"):
        raw = os.environ.get(var)
        if raw is not None and raw.strip():
            return [g.strip() for g in raw.split(",") if g.strip()]
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:           # no NVIDIA driver: a CPU host
        return []


@contextmanager
def gpu_slot(lock_dir: Path | str, gpus: list[str] | None = None, poll_s: float = 1.0,
             on_wait=None) -> Iterator[str | None]:
    """Hold one of ``gpus`` (default: host_gpus()) exclusively; yields its id, or None on a host without GPUs."""
    gpus = host_gpus() if gpus is None else gpus
    if not gpus:
        yield None
        return
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    waited = False
    while True:
        for gpu in gpus:
            f = open(lock_dir / f"gpu-{host}-{gpu}.lock", "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            try:
                f.seek(0)
                f.truncate()
                f.write(f"{os.getpid()}\n")
                f.flush()
                yield gpu
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
                f.close()
            return
        if on_wait is not None and not waited:
            on_wait(gpus)
            waited = True
        time.sleep(poll_s)
