"""Evidence builders the campaign tests share: a complete, binding campaign (CUDA, clean tree, 3 reps, every gate
passed and self-checked, byte-exact) whose grid values a test chooses, so each test breaks one thing."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from campaigns import policy
from campaigns.evidence import Arm, Evidence, Fingerprint, GateResult, LegResult
from campaigns.gates import GATE_NAMES

# Baseline reps that other axes reuse for both arms (identical values -> NEUTRAL, ratio 1.0).
SAME = [10.0, 10.5, 11.0]


def fingerprint(device_type="cuda", dirty=False, sha="abc1234def5678") -> Fingerprint:
    return Fingerprint(git_sha=sha, git_short_sha=sha[:7], dirty=dirty, branch="main", device_type=device_type,
                       device_name="NVIDIA H200" if device_type == "cuda" else "cpu", cuda_version="12.8",
                       torch_version="2.13.0", triton_version="3.9.0", python_version="3.11.9",
                       hostname="host-a", arms_env={"off": {"VT_DECODE_GQA_SWAP": "off"},
                                                    "on": {"VT_DECODE_GQA_SWAP": "on"}},
                       config_hash="0" * 64)


def gates(arms=("off", "on"), byte_exact=True, **override) -> list[GateResult]:
    """Every gate passed and self-checked on every arm; ``override[(gate, arm)] = dict(field=value)`` edits one."""
    out = []
    for name in GATE_NAMES:
        for arm in arms:
            g = GateResult(gate=name, arm=arm, passed=True, counts={"checks": 8}, self_check=True, duration_s=1.5)
            if name in ("op", "battery") and arm != arms[0]:
                g.byte_exact = byte_exact
            if name == "near_tie":
                g.counts = {"divergences": 0, "max_gap_mnats": 0.0}
            for k, v in override.get(f"{name}@{arm}", {}).items():
                setattr(g, k, v)
            out.append(g)
    return out


def legs(values: dict[str, dict[str, list[float]]], concurrency=(1, 2, 4, 8), reps=3,
         arms=("off", "on")) -> list[LegResult]:
    """``values[axis_metric][arm]`` = per-rep values (same at every concurrency); unspecified metrics = SAME."""
    metrics = ("total_token_throughput", "median_tpot_ms", "median_ttft_ms", "median_itl_ms", "median_e2el_ms",
               "output_throughput", "request_throughput")
    metrics += tuple(k for k in ("p99_itl_ms", "max_itl_ms") if k in values)    # the tail axes, where given
    out, order = [], 0
    for c in concurrency:
        for r in range(reps):
            for arm in (arms if r % 2 == 0 else arms[::-1]):
                m = {k: float(values.get(k, {}).get(arm, SAME * 2)[r]) for k in metrics}
                out.append(LegResult(concurrency=c, rep=r, arm=arm, order_index=order, prompts_sha256=f"{c}-{r}",
                                     num_prompts=6, metrics=m, started="2026-11-30T10:00:00Z",
                                     ended="2026-11-30T10:00:05Z"))
                order += 1
    return out


def make_evidence(values=None, *, reps=3, concurrency=(1, 2, 4, 8), device_type="cuda", dirty=False,
                  gate_results=None, policy_cfg=None, candidates=(True,), binding=True, lever="gqa_swap",
                  created="2026-11-30T10:00:00Z", campaign_id=None, campaign_gates=GATE_NAMES,
                  inapplicable=None) -> Evidence:
    arms = [Arm("off", False, "baseline")] + [Arm(str(v).lower() if not isinstance(v, bool) else "on", v,
                                                  "candidate") for v in candidates]
    names = tuple(a.name for a in arms)
    cfg = {"campaign": {"name": lever, "lever": lever, "gates": list(campaign_gates),
                        "inapplicable": dict(inapplicable or {}),
                        "policy": {"near_tie_max_mnats": 500.0, "min_gain": 0.01, "min_effect": 0.01, "min_reps": 3,
                                   "flip_on_correctness": False, **(policy_cfg or {})},
                        "hypothesis": "K/V read once per group.", "residual": "split count next."},
           "grid": {"name": "online" if binding else "rehearsal", "binding": binding,
                    "concurrency": list(concurrency), "reps": reps, "prompts_per_leg": [6] * len(concurrency),
                    "input_len": 1024, "output_len": 128},
           "model": {"name": "qwen3-8b", "quant": "bf16"}}
    ev = Evidence(campaign_id=campaign_id or f"{created[:10]}-{lever}-abc1234", lever=lever, arms=arms, config=cfg,
                  fingerprint=fingerprint(device_type, dirty), created=created,
                  gates=gate_results if gate_results is not None else gates(names),
                  legs=legs(values or {}, concurrency, reps, names),
                  arm_fingerprints={a: "fp0" for a in names})
    return policy.conclude(ev)


TPUT_WIN = {"total_token_throughput": {"off": [100.0, 101.0, 102.0], "on": [110.0, 111.0, 112.0]}}


@contextmanager
def serving(max_num_seqs: int = 4, **engine_kwargs):
    """A real `vtengine serve` app over the `tiny` engine, on loopback in this process: yields (server, base URL)."""
    from vtengine.config import EngineConfig
    from vtengine.engine.llm_engine import LLMEngine
    from vtengine.server import Server, start_in_thread, stop_thread
    server = Server.from_engine(LLMEngine(EngineConfig(model="tiny", max_num_seqs=max_num_seqs, **engine_kwargs)))
    uv = start_in_thread(server)
    try:
        yield server, uv.url
    finally:
        stop_thread(uv)
        server.engine.shutdown()


def temp_repo(tmp_path: Path, name: str = "repo") -> Path:
    """A fresh git repository with one commit: a campaign's sandbox (its sha and cleanliness are real)."""
    import git
    repo = tmp_path / name
    repo.mkdir(parents=True)
    r = git.Repo.init(repo)
    (repo / "README.md").write_text("campaign sandbox\n")
    r.index.add(["README.md"])
    r.index.commit("sandbox", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return repo


# presets flipped on since the staleness tests were written: their premises (every step-shape lever off in every
# context) hold with these off, as they do with the per-quantization defaults dropped
PLAIN_OFF = ("mixed_prefill",)      # flipped on 2026-12-06


def copy_plain_levers(dest: Path) -> Path:
    """The project's lever files copied to ``dest`` with one default per lever: the per-quantization defaults its
    flips wrote (``default_by_quant``, pdl_stack on for bf16 since 2026-12-04) are dropped and the presets of
    PLAIN_OFF are off, so a test that writes or reads them starts from a known file whatever the project has
    flipped since."""
    import shutil
    shutil.copytree(Path(__file__).resolve().parents[1] / "conf" / "lever", dest)
    for f in dest.glob("*.yaml"):
        f.write_text("".join(("default: false\n" if f.stem in PLAIN_OFF and line.startswith("default:") else line)
                             for line in f.read_text().splitlines(keepends=True)
                             if not line.startswith("default_by_quant:")))
    return dest


def lever_repo(tmp_path: Path) -> Path:
    """A git repository (one commit) with the project's lever files (their plain defaults: the per-quantization
    ones the project's flips wrote are dropped, so the tests' premises do not move with them) and a one-line Python
    stand-in for each of their source files: staleness and recheck run against it."""
    import shutil

    import git
    from vtengine import levers
    root = tmp_path / "proj"
    copy_plain_levers(root / "conf" / "lever")
    for lv in levers.registry().values():
        for p in dict.fromkeys(levers.split_entry(e)[0] for e in lv.paths):
            (root / p).parent.mkdir(parents=True, exist_ok=True)
            (root / p).write_text(f"SOURCE = {p!r}\n")
    r = git.Repo.init(root)
    r.git.add(A=True)
    r.index.commit("project", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    return root


def plain_defaults(monkeypatch) -> None:
    """The project's levers at their plain file defaults for the rest of the test: the per-quantization defaults its
    flips wrote (pdl_stack on for bf16, 2026-12-04) are set aside and the presets of PLAIN_OFF off, as lever_repo
    has them, so tests built on today's registry keep their premises."""
    import dataclasses
    from vtengine import levers
    real = levers.registry
    monkeypatch.setattr(levers, "registry", lambda lever_dir=None: {
        name: dataclasses.replace(lv, default_by_quant={}, **({"default": False} if name in PLAIN_OFF else {}))
        for name, lv in real(lever_dir).items()})


def static_sass(module: str, tmp_path: Path) -> dict:
    """A static-SASS bench (``python -m <module> <dir>``: kernels compiled for sm_90 without a GPU) run into
    tmp_path; its JSON. Skips where this Triton ships no nvdisasm."""
    import json
    import subprocess
    import sys
    import pytest
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm").exists():
        pytest.skip("this Triton ships no nvdisasm: the static count needs it")
    r = subprocess.run([sys.executable, "-m", module, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    [path] = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    import os
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):
        return False
