"""Evidence: the typed record of one campaign, and the only input of everything after it.

Gates and grid legs produce dataclasses; the runner appends them to an ``Evidence`` and writes
``records/campaigns/<id>/evidence.json`` after every gate and every leg (atomically: a temporary file in the same
directory, then ``os.replace``), so an interrupted campaign leaves a complete file that ``resume=<id>`` continues.
Records, PR text, plots and MLflow runs are views rendered from this file alone.

JSON round trip is exact: ``Evidence.from_dict(json.loads(ev.to_json())) == ev``. ``load_evidence`` reads the
schema versions in SCHEMA_VERSIONS (version 1 files, written before lever context, effect sizes and calibration
were recorded, load with those fields empty) and refuses any other, naming it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import tempfile
import types
import typing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional, Union

SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (1, 2)
VERDICTS = ("INVALID", "REJECT-CORRECTNESS", "NON-BINDING", "FLIP", "REJECT-PERFORMANCE", "KEEP",
            "AA-PASS", "AA-FAIL")
SEPARATIONS = ("WIN", "LOSS", "NEUTRAL")
STATUSES = ("in-progress", "complete", "abandoned")   # abandoned: `vtcampaign abandon`, kept as it was
KINDS = ("lever", "aa")          # a lever campaign (baseline vs candidates), or the grid's A/A self-check


class EvidenceError(ValueError):
    """An evidence file is missing, torn, of another schema version, or does not match the schema."""


@dataclass
class Fingerprint:
    """Where and on what the campaign ran; two arms compare only on the same fingerprint."""
    git_sha: str
    git_short_sha: str
    dirty: bool
    branch: str
    device_type: str                        # "cuda" | "cpu"
    device_name: str                        # e.g. "NVIDIA H200" or the CPU model
    cuda_version: Optional[str]
    torch_version: str
    triton_version: Optional[str]
    python_version: str
    hostname: str
    arms_env: dict[str, dict[str, str]]     # arm -> the VT_* environment its server runs with
    config_hash: str
    dirty_files: list[str] = field(default_factory=list)
    # gitops.code_digest at git_sha: what a resume at a later commit must match (None: recorded before 2026-12-05)
    code_digest: Optional[str] = None
    # gitops.contents_digest of dirty_files: what a resume on a tree dirty in the same files must match (None: a
    # clean tree, or recorded before 2026-12-07)
    dirty_digest: Optional[str] = None


@dataclass
class Arm:
    name: str                               # "off" / "on" / "auto" / "8": config.arm_name(value)
    value: Any                              # the lever's canonical value
    role: str                               # "baseline" | "candidate"; its env is in Fingerprint.arms_env


@dataclass
class GateResult:
    """One gate on one arm. ``self_check``: did the gate catch its deliberate fault (True = the gate can fail;
    False = the faulted run passed, so the gate is broken and the campaign INVALID; None = not run on this arm).
    ``byte_exact``: the measured ON-vs-OFF bitwise comparison where the gate makes one (op, battery), else None."""
    gate: str
    arm: str
    passed: bool
    counts: dict[str, Union[int, float]] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    self_check: Optional[bool] = None
    duration_s: float = 0.0
    skipped: bool = False
    reason: str = ""
    byte_exact: Optional[bool] = None


@dataclass
class LegResult:
    """One (concurrency, rep, arm) point of the grid; metrics use `vllm bench serve` names (median_tpot_ms, ...)."""
    concurrency: int
    rep: int
    arm: str
    order_index: int                        # position in the run order (arms alternate per rep)
    prompts_sha256: str
    num_prompts: int
    metrics: dict[str, float] = field(default_factory=dict)
    valid: bool = True
    reasons: list[str] = field(default_factory=list)
    gpu_samples: list[dict[str, float]] = field(default_factory=list)   # {t_s, sm_clock_mhz, temp_c, ...}
    started: str = ""                       # ISO 8601 UTC
    ended: str = ""

    @property
    def key(self) -> tuple[int, int, str]:
        return (self.concurrency, self.rep, self.arm)

    @classmethod
    def from_loadgen(cls, m: dict[str, Any], *, rep: int, arm: str, order_index: int, started: str, ended: str,
                     gpu_samples: list[dict[str, float]] | None = None) -> "LegResult":
        """A leg from ``campaigns.loadgen.LegMetrics.to_dict()``: its numeric fields become ``metrics`` (the
        server's own counters as ``server_<name>``), its validity and failures the leg's ``valid``/``reasons``."""
        identity = {"concurrency", "num_prompts", "prompts_sha256", "valid", "failures", "server"}
        metrics = {k: float(v) for k, v in m.items()
                   if k not in identity and isinstance(v, (int, float)) and not isinstance(v, bool)}
        metrics.update({f"server_{k}": float(v) for k, v in (m.get("server") or {}).items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        return cls(concurrency=int(m["concurrency"]), rep=rep, arm=arm, order_index=order_index,
                   prompts_sha256=str(m["prompts_sha256"]), num_prompts=int(m["num_prompts"]), metrics=metrics,
                   valid=bool(m.get("valid", False)), reasons=list(m.get("failures") or []),
                   gpu_samples=list(gpu_samples or []), started=started, ended=ended)


@dataclass
class ArmSummary:
    median: float
    mean: float
    min: float
    max: float
    cv: float                               # sample stdev / mean (0 for one rep)
    n: int


@dataclass
class EffectSize:
    """A multiplicative effect with its confidence interval (campaigns/effects.py), > 1 favouring the candidate.
    ``confidence`` is the interval's achieved (exact) level; ``method`` names how it was computed."""
    ratio: float
    lo: float
    hi: float
    confidence: float
    method: str


@dataclass
class PooledEffect:
    """One axis pooled over the grid's concurrencies, for one candidate."""
    candidate: str
    axis: str
    effect: EffectSize
    primary: bool = False


@dataclass
class Calibration:
    """The grid rule's own error rates for this campaign's shape, from the policy run on synthetic evidence built
    from a null noise model (campaigns/calibrate.py). Rates are fractions of ``sims`` simulated campaigns."""
    false_flip: float                       # P(FLIP) when both arms are the same
    false_reject: float                     # P(REJECT-PERFORMANCE) when both arms are the same
    power: dict[str, float]                 # true gain (e.g. "0.05") -> P(FLIP)
    mde_80: Optional[float]                 # smallest true gain FLIPped with >= 80% probability (None: > the search)
    separations_mean: float                 # separated points (WIN or LOSS, any axis) per A/A grid, on average
    separations_q95: int                    # ... and its 95th percentile: what an A/A grid may show by chance
    comparisons: int                        # (candidate, axis, concurrency) points the rule looks at
    sims: int
    seed: int
    token_safe_as: str                      # "byte-exact" | "near-tie ratified": which FLIP rule was simulated
    noise: str                              # where the null came from, in words
    noise_campaigns: list[str] = field(default_factory=list)
    noise_legs: dict[str, int] = field(default_factory=dict)    # concurrency -> residual legs pooled


@dataclass
class AxisStat:
    """One axis at one concurrency, candidate vs baseline. ``ratio`` > 1 is better for the candidate whatever
    the axis' direction (throughput: ON/OFF medians; latency: OFF/ON)."""
    axis: str
    metric: str                             # the leg metric it reads, e.g. "median_tpot_ms"
    concurrency: int
    baseline: str                           # arm names
    candidate: str
    higher_is_better: bool
    reps: dict[str, list[float]]            # arm -> per-rep values in rep order
    summary: dict[str, ArmSummary]
    ratio: Optional[float]                  # None when the baseline median is 0 (cannot orient)
    separation: str                         # WIN | LOSS | NEUTRAL
    primary: bool = False
    effect: Optional[EffectSize] = None     # Hodges-Lehmann ratio with its exact rank-based interval


@dataclass
class Decision:
    verdict: str                            # one of VERDICTS
    rule: str                               # the rule that fired, quoted verbatim from policy.RULES
    reasons: list[str] = field(default_factory=list)
    candidate: Optional[str] = None         # the arm the verdict is about
    new_default: Any = None                 # the candidate value on FLIP, else None
    byte_exact: Optional[bool] = None       # measured (None: no gate measured it)
    token_safe: bool = False
    binding: bool = False
    headline: str = ""                      # the figure a reader quotes, e.g. "total tok/s x1.042 at c8"
    per_candidate: dict[str, str] = field(default_factory=dict)
    effect_note: str = ""                   # a KEEP: "neutral: within ±z% (95%)" or "underpowered: up to +z%"


@dataclass
class Evidence:
    campaign_id: str                        # <date>-<lever>-<sha7>
    lever: str
    arms: list[Arm]
    config: dict[str, Any]                  # the composed config, resolved
    fingerprint: Fingerprint
    created: str                            # ISO 8601 UTC, campaign start
    gates: list[GateResult] = field(default_factory=list)
    legs: list[LegResult] = field(default_factory=list)
    stats: list[AxisStat] = field(default_factory=list)
    decision: Optional[Decision] = None
    status: str = "in-progress"
    arm_fingerprints: dict[str, str] = field(default_factory=dict)   # arm -> what its server reported (hash)
    peak_memory_gib: dict[str, float] = field(default_factory=dict)  # arm -> peak GPU memory of its server
    flip: dict[str, Any] = field(default_factory=dict)               # {branch, commit} once committed
    kind: str = "lever"                                              # one of KINDS
    # lever context: every registered lever's resolved value per arm (as its server reported it), the levers whose
    # kernels ran per arm (its server's counters after the grid), and a digest of each lever's source files
    context: dict[str, dict[str, Any]] = field(default_factory=dict)
    live_levers: dict[str, list[str]] = field(default_factory=dict)
    lever_digests: dict[str, str] = field(default_factory=dict)
    pooled: list[PooledEffect] = field(default_factory=list)
    calibration: Optional[Calibration] = None
    # the arms in the order their servers started (empty: written before the order was drawn, when the baseline's
    # server always started first)
    server_order: list[str] = field(default_factory=list)
    # how the arms' servers shared the GPU: "together" (side by side, the whole grid) or "alternate" (one at a time,
    # restarted between blocks of legs: they did not fit side by side, or grid.residency=alternate asked for it)
    residency: str = "together"
    # later commits (short sha) the campaign was resumed at, each with the code of its own commit (runner.same_code)
    resumed_at: list[str] = field(default_factory=list)
    # the lever file's summary when the campaign started: what the lever did then (its values may mean something
    # else later, e.g. a rule behind "auto" rewritten); empty: written before 2026-12-06, read from git at its commit
    lever_summary: str = ""
    # `vtcampaign abandon`: {"at": ISO 8601 UTC, "why": the user's reason}; its gates and legs stay as they were
    abandoned: dict[str, str] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    # --- queries the runner and the views share
    @property
    def baseline(self) -> Arm:
        return next(a for a in self.arms if a.role == "baseline")

    @property
    def candidates(self) -> list[Arm]:
        return [a for a in self.arms if a.role == "candidate"]

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise KeyError(f"arm {name!r} not in {[a.name for a in self.arms]}")

    def done_legs(self) -> set[tuple[int, int, str]]:
        """Keys of the legs already measured (a resumed campaign skips them)."""
        return {leg.key for leg in self.legs}

    def gate(self, gate: str, arm: str) -> Optional[GateResult]:
        hits = [g for g in self.gates if g.gate == gate and g.arm == arm]
        return hits[-1] if hits else None

    @property
    def date(self) -> str:
        return self.created[:10]

    # --- serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return dump_json(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Evidence":
        return _build(cls, data, "evidence")


def dump_json(data: dict[str, Any]) -> str:
    """An evidence file's text: one line per top-level key, and inside a top-level list or object one line per item
    (a leg, a gate, a stats row, a config group), each written compactly with sorted keys. ``json.loads`` reads it
    back exactly. Indented JSON put 540 KB in an 80-leg file, 350 KB of it whitespace and separators; this form
    takes about two thirds of that (records/campaigns: 31 MB of evidence in indented form, 20 MB in this one,
    2026-12-07) and a resumed campaign's diff still reads leg by leg."""
    def one(v: Any) -> str:
        return json.dumps(v, sort_keys=True, allow_nan=True, separators=(",", ":"))

    def block(v: Any) -> str:
        if isinstance(v, list) and v:
            return "[\n" + ",\n".join("  " + one(x) for x in v) + "\n ]"
        if isinstance(v, dict) and v:
            # each item as json.dumps writes a one-key object (a key that is not a string becomes one, as before)
            return "{\n" + ",\n".join("  " + one({k: v[k]})[1:-1] for k in sorted(v)) + "\n }"
        return one(v)

    return "{\n" + ",\n".join(f" {one(k)}:{block(data[k])}" for k in sorted(data)) + "\n}\n"


# ----------------------------------------------------------------------------------------------- typed decode


@functools.lru_cache(maxsize=None)
def _shape(tp: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    """A dataclass's resolved field types and its fields, read once per class: typing.get_type_hints evaluates every
    annotation string anew, and a record's evidence files hold thousands of dataclass objects (legs, stats)."""
    return typing.get_type_hints(tp), {f.name: f for f in dataclasses.fields(tp)}


def _build(tp: Any, data: Any, where: str) -> Any:
    """Rebuild a value of type ``tp`` from JSON data, checking keys and types; errors name the JSON path."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None:
            if type(None) in args:
                return None
            raise EvidenceError(f"{where}: null where {tp} is required")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _build(arg, data, where)
            except EvidenceError as e:
                errors.append(str(e))
        raise EvidenceError(errors[0] if errors else f"{where}: cannot read {data!r} as {tp}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(data, dict):
            raise EvidenceError(f"{where}: expected an object for {tp.__name__}, got {type(data).__name__}")
        hints, fields = _shape(tp)
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise EvidenceError(f"{where}: unknown keys {unknown} for {tp.__name__}; known: {sorted(fields)}")
        kwargs = {}
        for name, f in fields.items():
            if name in data:
                kwargs[name] = _build(hints[name], data[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise EvidenceError(f"{where}: missing key {name!r} for {tp.__name__}")
        return tp(**kwargs)
    if origin is list:
        (arg,) = typing.get_args(tp) or (Any,)
        if not isinstance(data, list):
            raise EvidenceError(f"{where}: expected a list, got {type(data).__name__}")
        return [_build(arg, v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        _, arg = typing.get_args(tp) or (str, Any)
        if not isinstance(data, dict):
            raise EvidenceError(f"{where}: expected an object, got {type(data).__name__}")
        return {k: _build(arg, v, f"{where}.{k}") for k, v in data.items()}
    if tp is float:
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return data if isinstance(data, float) else float(data)
    elif tp is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
    elif isinstance(tp, type) and isinstance(data, tp):
        return data
    raise EvidenceError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {data!r}")


# ----------------------------------------------------------------------------------------------- files


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_utc(iso: str) -> datetime:
    """A timestamp as evidence writes them (utc_now: ISO 8601 with a trailing Z) as an aware datetime."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00"))


def campaign_id(date: str, lever: str, short_sha: str, kind: str = "lever") -> str:
    return f"{date}-{lever}{'-aa' if kind == 'aa' else ''}-{short_sha[:7]}"


def new_campaign_id(out_dir: Path | str, date: str, lever: str, short_sha: str, kind: str = "lever") -> str:
    """``<date>-<lever>-<sha7>`` (``<date>-<lever>-aa-<sha7>`` for an A/A grid), with ``-2``, ``-3``... when that
    directory already exists (a re-run). The directory is claimed by creating it (mkdir fails if it exists), so
    two sweep jobs of one lever starting together (bf16 and MXFP4) get two ids, never one directory."""
    base = campaign_id(date, lever, short_sha, kind)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    cid, n = base, 1
    while True:
        try:
            (Path(out_dir) / cid).mkdir()
            return cid
        except FileExistsError:
            n += 1
            cid = f"{base}-{n}"


_UMASK = os.umask(0o022)     # read once, at import (os.umask can only be read by setting it), and put back
os.umask(_UMASK)


def write_atomic(path: Path | str, data: str | bytes) -> Path:
    """Write via a temporary file in the same directory and os.replace: readers see the old or the new file, with
    the mode open() would give a new file (mkstemp's own is 0600: records others on the host could not read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def save_evidence(ev: Evidence, campaign_dir: Path | str) -> Path:
    return write_atomic(Path(campaign_dir) / "evidence.json", ev.to_json())


def load_evidence(path: Path | str) -> Evidence:
    path = Path(path)
    if path.is_dir():
        path = path / "evidence.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise EvidenceError(f"evidence file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise EvidenceError(f"evidence file {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise EvidenceError(f"evidence file {path}: expected a JSON object")
    version = data.get("schema_version")
    if version not in SCHEMA_VERSIONS:
        raise EvidenceError(f"evidence file {path}: schema_version {version!r} is not supported; "
                            f"accepted: {', '.join(map(str, SCHEMA_VERSIONS))}")
    try:
        ev = Evidence.from_dict(data)
    except EvidenceError as e:
        raise EvidenceError(f"evidence file {path}: {e}") from None
    if ev.status not in STATUSES:
        raise EvidenceError(f"evidence file {path}: status {ev.status!r}; accepted: {list(STATUSES)}")
    if ev.decision is not None and ev.decision.verdict not in VERDICTS:
        raise EvidenceError(f"evidence file {path}: verdict {ev.decision.verdict!r}; accepted: {list(VERDICTS)}")
    if ev.kind not in KINDS:
        raise EvidenceError(f"evidence file {path}: kind {ev.kind!r}; accepted: {list(KINDS)}")
    return ev


def find_evidence(out_dir: Path | str) -> list[Path]:
    """Every ``<out_dir>/*/evidence.json``, sorted by path (deterministic renders)."""
    return sorted(Path(out_dir).glob("*/evidence.json"))


def evidence_head(path: Path) -> tuple[Any, Any, Any] | None:
    """(status, lever, composed config's hash) as an evidence file states them, parsed once per version of the file
    in a process (keyed by its inode, times and size: write_atomic renames a new file in), or None where it does
    not parse as an object (load_evidence says why). A search for one run's campaigns filters by it before building
    the few it may match: building all of a records folder's evidence took 1.4 s a search, and ``vtcampaign
    recheck --within`` makes two for every entry it weighs (2026-12-07, H200: 42 s of a device call's step spent
    weighing 21 entries none of which fitted)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _head(str(path), st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _head(path: str, ino: int, mtime_ns: int, ctime_ns: int, size: int) -> tuple[Any, Any, Any] | None:
    try:
        data = json.loads(Path(path).read_text())
        return data.get("status"), data.get("lever"), data.get("fingerprint", {}).get("config_hash")
    except (OSError, ValueError, AttributeError):
        return None


def new_evidence(cfg: dict[str, Any], fingerprint: Fingerprint, arms: list[Arm], campaign_id: str,
                 created: str | None = None, kind: str = "lever") -> Evidence:
    return Evidence(campaign_id=campaign_id, lever=cfg["campaign"]["lever"], arms=arms, config=cfg,
                    fingerprint=fingerprint, created=created or utc_now(), kind=kind)
