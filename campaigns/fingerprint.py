"""The environment fingerprint a campaign records in its preflight: git, device, versions, lever env per arm.

Two arms compare only on the same fingerprint; the policy reads ``device_type`` and ``dirty`` from it (rule 3).
"""
from __future__ import annotations

import dataclasses
import os
import platform
import re
import socket
from pathlib import Path
from typing import Any, Mapping

from campaigns.config import CampaignConfigError, arm_env_value, arm_name
from campaigns.evidence import Arm, Fingerprint
from campaigns.gitops import code_digest, repo_state


def device_info(device: str) -> tuple[str, str, str | None]:
    """(device_type, device_name, cuda_version) for 'cuda' or 'cpu'."""
    import torch
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda but torch sees no CUDA device; use device=cpu or device=auto")
        return "cuda", torch.cuda.get_device_name(0), torch.version.cuda
    return "cpu", platform.processor() or platform.machine() or "cpu", torch.version.cuda


def host_setup(device: str) -> dict[str, str | None]:
    """What a resume must find as the first run had it (runner.SAME_ON_RESUME): the device's name and the torch,
    triton, CUDA and Python versions, read on this host for ``device`` ('cuda' or 'cpu')."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    _, device_name, cuda_version = device_info(device)
    return {"device_name": device_name, "torch_version": torch.__version__, "triton_version": triton_version,
            "cuda_version": cuda_version, "python_version": platform.python_version()}


def make_arms(lever: str, baseline: Any, candidates: list[Any], aa: bool = False) -> list[Arm]:
    """The arms, named by value ('off', 'on', 'auto', '8'); an A/A campaign's two arms (one value) are 'a' and 'b'."""
    if aa:
        return [Arm("a", baseline, "baseline"), Arm("b", baseline, "candidate")]
    return ([Arm(arm_name(baseline), baseline, "baseline")]
            + [Arm(arm_name(v), v, "candidate") for v in candidates])


def arms_env(lever_env: str, arms: list[Arm], environ: Mapping[str, str] | None = None,
             pinned: Mapping[str, Any] | None = None) -> dict[str, dict[str, str]]:
    """Per arm, the VT_* environment its server runs with: inherited VT_* variables (so a stray one shows up in
    the record), the pinned levers (campaign.with_levers, by env name) and the campaign lever's own variable set to
    the arm's value."""
    environ = os.environ if environ is None else environ
    inherited = {k: v for k, v in environ.items() if k.startswith("VT_")}
    pins = {k: arm_env_value(v) for k, v in (pinned or {}).items()}
    return {a.name: dict(sorted({**inherited, **pins, lever_env: arm_env_value(a.value)}.items())) for a in arms}


def collect(repo_path: Path | str, device: str, lever_env: str, arms: list[Arm], config_hash: str,
            ignore_dirty: tuple[str, ...] = (), pinned: Mapping[str, Any] | None = None) -> Fingerprint:
    """The preflight fingerprint. ``ignore_dirty``: paths (e.g. the campaign's own out_dir) that do not count as
    dirt, since the campaign writes there while it runs."""
    state = repo_state(repo_path, ignore=ignore_dirty)
    # A lent GPU host gets a copy of the checkout without .git; the copy is committed there as a fresh repository
    # (so dirtiness is still measured against it) and the source commit is named by CAMPAIGN_SOURCE_SHA.
    source = os.environ.get("CAMPAIGN_SOURCE_SHA", "").strip()
    if source and not re.fullmatch(r"[0-9a-f]{7,40}", source):
        raise CampaignConfigError(f"CAMPAIGN_SOURCE_SHA={source!r} is not a commit sha (7 to 40 hex digits): the evidence "
                         "would name a commit no repository has, and its verdict could never be FRESH")
    if source:
        state = dataclasses.replace(state, sha=source, short_sha=source[:7],
                                    branch=os.environ.get("CAMPAIGN_SOURCE_BRANCH", state.branch))
    return Fingerprint(
        git_sha=state.sha, git_short_sha=state.short_sha, dirty=state.dirty, branch=state.branch,
        device_type=device_info(device)[0], **host_setup(device), hostname=socket.gethostname(),
        arms_env=arms_env(lever_env, arms, pinned=pinned), config_hash=config_hash, dirty_files=state.dirty_files,
        code_digest=code_digest(repo_path), dirty_digest=state.dirty_digest)
