"""The campaign configuration: Hydra structured configs (schemas) and the one function that composes them.

The tree under conf/ mirrors the concepts: ``campaign/`` (a lever, its arms, the gates it needs, the policy),
``model/`` (the lead's presets), ``grid/`` (the binding benchmark grid), ``gate/`` (gate parameters) and
``tracking/`` (MLflow). The dataclasses below are registered in Hydra's ConfigStore as the schema of the primary
config, so every group option and every command-line override is type-checked when it is merged.

Device-dependent defaults: a CUDA host gets the ``online`` grid and the campaign's real-shape model, a CPU host
the ``rehearsal`` grid on the campaign's CPU model, unless the user names ``grid=``/``model=``/``model.quant=``
(``grid=online`` on a CPU is allowed; the policy then marks the result non-binding).
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from campaigns.gates import CORRECTNESS_GATES, GATE_NAMES
from vtengine import confdirs

DEVICES = ("auto", "cuda", "cpu")
RESIDENCIES = ("auto", "together", "alternate")      # grid.residency: how the arms' servers share the GPU


class CampaignConfigError(ValueError):
    """A bad campaign option or override; the message names the bad value and what is accepted."""


# ----------------------------------------------------------------------------------------------- schemas


@dataclass
class ArmsConfig:
    baseline: Any = None                 # None: the lever's current file default (resolved at compose time)
    candidates: Optional[List[Any]] = None   # None: the lever's other declared values (a bool lever: its flip)


@dataclass
class ModelChoice:
    preset: str = "tiny"                 # a conf/model/<preset>.yaml option
    quant: str = "bf16"


@dataclass
class ModelsConfig:
    cuda: ModelChoice = field(default_factory=lambda: ModelChoice("qwen3-8b", "bf16"))
    cpu: ModelChoice = field(default_factory=ModelChoice)


@dataclass
class PolicyConfig:
    name: str = "parity_enabler"
    near_tie_max_mnats: float = 500.0    # a divergence is a ratified tie when every gap <= this (millinats)
    min_gain: float = 0.01               # a non-byte-exact lever's WINs must clear ratio >= 1 + min_gain
    min_reps: int = 5                    # fewer reps per point than this: non-binding (3 reps: ~17% false FLIP)
    flip_on_correctness: bool = False    # a correctness fix may flip with no speed gain (RED first: see fix_gates)
    fix_gates: List[str] = field(default_factory=list)   # the gate(s) that prove the fix: FAIL on baseline, PASS on it
    neutral_margin: float = 0.02         # a KEEP is "neutral" when the pooled interval lies within ±this
    # a separated point counts as a WIN (LOSS) only when its ratio is >= 1 + this (<= 1 - this): two servers of one
    # engine can differ by a steady fraction of a percent, which five quiet reps separate (policy.py)
    min_effect: float = 0.01
    primary_axes: List[str] = field(default_factory=lambda: ["total_token_throughput", "tpot"])
    # grid name -> the primary axes on that grid alone, in place of primary_axes when the campaign runs on it (the
    # evidence keeps the list that applied): the long-prompt grid reads a stall axis the short-prompt grid cannot see
    primary_axes_by_grid: Dict[str, List[str]] = field(default_factory=dict)
    # FLIP needs WINs (REJECT-PERFORMANCE LOSSes) at this many concurrencies; 0: one per 4 points of the grid,
    # rounded up (1 on the 4-point grid, 2 on the 8-point wide one), so more points do not mean more false FLIPs
    min_win_points: int = 0
    # axis -> why the lever trades it by design, written before the campaign runs (chunked prefill raises the median
    # ITL to take the multi-second stalls out): a LOSS there is reported, never vetoes a FLIP; never a primary axis
    traded_axes: Dict[str, str] = field(default_factory=dict)
    # grid name -> {axis: why}: axes traded on that grid alone, added to traded_axes when the campaign runs on it (the
    # evidence keeps the merged map). Mixed steps give back a 32k prompt's median TTFT, which prefill first wins by
    # jumping every running request's decode; on short prompts nothing is traded but the ITL.
    traded_axes_by_grid: Dict[str, Dict[str, str]] = field(default_factory=dict)


@dataclass
class CampaignConfig:
    name: str = MISSING
    lever: str = MISSING
    arms: ArmsConfig = field(default_factory=ArmsConfig)
    models: ModelsConfig = field(default_factory=ModelsConfig)
    gates: List[str] = field(default_factory=lambda: list(GATE_NAMES))
    inapplicable: Dict[str, str] = field(default_factory=dict)   # gate -> why it cannot apply (the record quotes it)
    with_levers: Dict[str, Any] = field(default_factory=dict)    # other levers pinned for both arms
    # the binding grid a GPU run takes when the command names none (None: online): a lever decided where large
    # batches live (online_wide) must not be re-decided, and its verdict replaced, on the 4-point grid by default
    grid: Optional[str] = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    hypothesis: str = ""                 # why the lever should help: the record's narrative starts here
    residual: str = ""                   # what still bounds the gap after this lever (PR "Residual")


@dataclass
class GridConfig:
    name: str = MISSING
    binding: bool = True                 # false for rehearsal grids: never binding, whatever the host
    concurrency: List[int] = field(default_factory=lambda: [1, 2, 4, 8])
    reps: int = 5
    prompts_per_leg: List[int] = field(default_factory=lambda: [6, 6, 12, 24])
    input_len: int = 1024
    output_len: int = 128
    output_len_range: float = 0.0        # each request's output length uniform in [L(1-r), L(1+r)] (loadgen)
    warmup_requests: int = 2
    seed: int = 0
    alternate_order: bool = True         # arm order A B, B A, ... per rep, to cancel drift
    # the arms' servers: side by side, each with 0.9 / arms of the GPU's memory (together), one at a time with 0.9
    # each, restarted between blocks of legs (alternate), or together unless they do not fit (auto)
    residency: str = "auto"


@dataclass
class OpGateConfig:
    seed: int = 0
    shapes: int = 4                      # not read: the cases are fixed per device (op._shapes); kept so stored
                                         # campaign configs still load
    poison: bool = True                  # NaN-fill outputs and every allocation a kernel launcher makes


@dataclass
class BatteryGateConfig:
    prompts: int = 16
    max_tokens: int = 32


@dataclass
class ParityGateConfig:
    prompts: int = 4
    max_tokens: int = 16
    concurrency: int = 4


@dataclass
class MemcheckGateConfig:
    max_tokens: int = 4
    timeout_s: int = 600
    model: Optional[str] = None          # None: the campaign's model; a smaller preset runs the same kernels faster


@dataclass
class GateConfig:
    name: str = MISSING
    self_check: bool = True              # run each gate's deliberate fault; a gate that cannot fail voids the campaign
    op: OpGateConfig = field(default_factory=OpGateConfig)
    battery: BatteryGateConfig = field(default_factory=BatteryGateConfig)
    near_tie: Dict[str, Any] = field(default_factory=dict)   # its threshold is the policy's near_tie_max_mnats
    graph_parity: ParityGateConfig = field(default_factory=ParityGateConfig)
    async_parity: ParityGateConfig = field(default_factory=ParityGateConfig)
    mechanism: Dict[str, Any] = field(default_factory=dict)
    memcheck: MemcheckGateConfig = field(default_factory=MemcheckGateConfig)


@dataclass
class TrackingConfig:
    name: str = MISSING
    enabled: bool = True
    uri: str = MISSING                   # local: sqlite:///mlflow.db (MLflow's default) at the project root (cwd)


@dataclass
class AppConfig:
    campaign: CampaignConfig = MISSING
    model: Dict[str, Any] = field(default_factory=dict)   # the lead's preset (keys name, quant, ...)
    grid: GridConfig = MISSING
    gate: GateConfig = MISSING
    tracking: TrackingConfig = MISSING
    allow_dirty: bool = False            # run on a dirty tree anyway (the result is then non-binding)
    commit: bool = False                 # on FLIP, commit the default flip on branch row/<lever>-flip
    aa: bool = False                     # an A/A campaign: the grid's self-check, two servers at the same value
    summaries: bool = True               # render STATUS/BENCHMARKS after it (a sweep's jobs leave that to the end)
    resume: Optional[str] = None         # a campaign id under out_dir to continue, or "auto" (runner._unfinished)
    out_dir: str = "records/campaigns"
    device: str = "auto"                 # auto | cuda | cpu; composed configs carry the resolved device
    # the command line's overrides (resume= left out), recorded so that a resume can be told what to repeat
    overrides: List[str] = field(default_factory=list)


# Each group's schema, as Hydra's structured-config examples register them: a group file names its schema first in
# its defaults list (``defaults: [grid_schema, _self_]``), so Hydra type-checks the file on its own, and the error
# names the file and key, before the primary schema types the merged tree. Model presets are the engine's files
# (vtengine/models/presets.py reads them without Hydra) and stay a free mapping.
GROUP_SCHEMAS = {"campaign": CampaignConfig, "grid": GridConfig, "gate": GateConfig, "tracking": TrackingConfig}


def register_schemas() -> None:
    cs = ConfigStore.instance()
    cs.store(name="vtcampaign_schema", node=AppConfig)
    for group, node in GROUP_SCHEMAS.items():
        cs.store(group=group, name=f"{group}_schema", node=node)


register_schemas()

# ----------------------------------------------------------------------------------------------- compose


def options(group: str, conf_dir: Path | str | None = None) -> list[str]:
    """The option names of a config group (file stems under conf/<group>/: the packaged ones and a project's)."""
    if conf_dir is not None:
        return sorted(p.stem for p in (Path(conf_dir) / group).glob("*.yaml"))
    return list(confdirs.group_files(group))


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def compose(overrides: list[str] | tuple[str, ...] = (), conf_dir: Path | str | None = None,
            cuda: bool | None = None) -> DictConfig:
    """Compose and validate the campaign config for ``overrides`` (Hydra syntax: ``campaign=X grid.reps=5``).

    ``cuda`` forces the host kind (tests); None asks torch. Raises CampaignConfigError with one clear line.
    """
    overrides = list(overrides)
    # the packaged conf/ with a project's own conf/ laid over it (vtengine/confdirs.py), unless one is named
    conf_dir = Path(conf_dir).resolve() if conf_dir is not None else confdirs.merged()
    if not (conf_dir / "config.yaml").is_file():
        raise CampaignConfigError(f"no config.yaml in {conf_dir}: vtcampaign needs conf/config.yaml (the packaged "
                                  f"one, or a project's conf/ named by --conf-dir or {confdirs.ENV})")
    user_keys = _override_keys(overrides)
    first = _compose(overrides, conf_dir)
    device = first.device
    if device not in DEVICES:
        raise CampaignConfigError(f"device={device!r} is not accepted; accepted: {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if (cuda_available() if cuda is None else cuda) else "cpu"

    # Device-dependent defaults, only where the user did not choose.
    choice = first.campaign.models.cuda if device == "cuda" else first.campaign.models.cpu
    extra = []
    if "grid" not in user_keys:
        extra.append(f"grid={(first.campaign.grid or 'online') if device == 'cuda' else 'rehearsal'}")
    if "gate" not in user_keys and device != "cuda":
        extra.append("gate=quick")      # the CPU rehearsal: Triton's interpreter is slow, keep the gates small
    if "model" not in user_keys:
        extra.append(f"model={choice.preset}")
    if "model.quant" not in user_keys:
        extra.append(f"model.quant={choice.quant}")
    cfg = _compose(extra + overrides, conf_dir) if extra else first
    cfg.device = device
    by_grid = cfg.campaign.policy.get("primary_axes_by_grid") or {}
    mine = f"campaign.policy.primary_axes_by_grid.{cfg.grid.name}"
    if "campaign.policy.primary_axes" in user_keys and cfg.grid.name in by_grid and mine not in user_keys:
        raise CampaignConfigError(
            f"campaign.policy.primary_axes={list(cfg.campaign.policy.primary_axes)} would not decide this run: "
            f"campaign {cfg.campaign.name!r} declares {mine}={list(by_grid[cfg.grid.name])}, which replaces the "
            f"primary axes on grid {cfg.grid.name!r}; override {mine} instead")
    _resolve_and_validate(cfg, conf_dir)
    return cfg


def campaign_grid(name: str, conf_dir: Path | str | None = None) -> str:
    """The grid a GPU run of campaign ``name`` takes when the command names none: its file's ``grid:``, else
    online (compose's rule, read without composing)."""
    conf_dir = Path(conf_dir) if conf_dir is not None else confdirs.merged()
    path = conf_dir / "campaign" / f"{name}.yaml"
    grid = OmegaConf.load(path).get("grid") if path.is_file() else None
    return str(grid) if grid else "online"


def _override_keys(overrides: list[str]) -> set[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException as e:
        first_line = str(e).strip().splitlines()[0]
        raise CampaignConfigError(f"bad override syntax in {overrides}: {first_line}; "
                                  "write key=value, e.g. campaign=gqa_swap grid.reps=5") from None
    return {o.key_or_group for o in parsed}


def _compose(overrides: list[str], conf_dir: Path) -> DictConfig:
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3", job_name="vtcampaign"):
            return hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise CampaignConfigError(_explain(e, overrides, conf_dir)) from None
    finally:
        GlobalHydra.instance().clear()


def _explain(e: Exception, overrides: list[str], conf_dir: Path) -> str:
    """Turn a Hydra/OmegaConf exception into one line naming the bad value and what is accepted."""
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, ValidationError

    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    cause = e.__cause__ or e.__context__
    for o in overrides:                                     # a group option that has no file
        group, _, choice = o.partition("=")
        if group in ("campaign", "model", "grid", "gate", "tracking") and choice not in options(group, conf_dir):
            known = options(group, conf_dir)
            if "," in choice and all(c.strip() in known for c in choice.split(",")):
                return (f"{group}={choice} lists several options: a sweep runs them, one campaign each: "
                        f"vtcampaign run -m {' '.join(overrides)}")
            return f"unknown {group} {choice!r}; accepted: {', '.join(known)} (conf/{group}/*.yaml)"
    if "You must specify 'campaign'" in text or (isinstance(e, MissingMandatoryValue) and "campaign" in text):
        return f"no campaign chosen; add campaign=<name>, accepted: {', '.join(options('campaign', conf_dir))}"
    err = cause if isinstance(cause, (ValidationError, ConfigKeyError)) else e
    if isinstance(err, (ValidationError, ConfigKeyError)):
        key = getattr(err, "full_key", None) or "?"
        msg = str(err).strip().splitlines()[0]
        if isinstance(err, ConfigKeyError) or "not in" in msg:
            return _unknown_key(key, overrides)
        bad = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") == key]
        return f"bad value for {key}" + (f" ({bad[0]!r})" if bad else "") + f": {msg}"
    m = re.match(r"Could not override '([^']+)'", first)
    if m:
        return _unknown_key(m.group(1), overrides)
    if cause is not None and str(cause).strip():
        return f"{first}: {str(cause).strip().splitlines()[0]}"
    return first


def _unknown_key(key: str, overrides: list[str]) -> str:
    parent = key.rsplit(".", 1)[0] if "." in key else ""
    accepted = _keys_of(parent)
    bad = next((o for o in overrides if o.split("=", 1)[0].lstrip("+~") == key), None)
    return (f"unknown key {key!r}" + (f" in override {bad!r}" if bad else "")
            + (f"; accepted keys of {parent or 'the top level'}: {', '.join(accepted)}" if accepted
               else f"; to add a new key write +{key}=..."))


def _keys_of(path: str) -> list[str]:
    """The schema's keys at a dotted path ('' = top level, 'grid', 'campaign.policy'), from the dataclasses."""
    import dataclasses
    import typing
    cls: Any = AppConfig
    for part in [p for p in path.split(".") if p]:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        cls = hints.get(part)
    if not dataclasses.is_dataclass(cls):
        return []
    return [f.name for f in dataclasses.fields(cls)]


def _resolve_and_validate(cfg: DictConfig, conf_dir: Path) -> None:
    """Checks Hydra's types cannot express: the lever exists, arm values parse, lists line up."""
    from vtengine import levers as lever_registry
    from vtengine.config import QUANTS

    import dataclasses
    fields = [f.name for f in dataclasses.fields(AppConfig)]
    extra = sorted(set(cfg.keys()) - set(fields))
    if extra:
        raise CampaignConfigError(f"unknown top-level key(s) {extra}; accepted: {', '.join(fields)}")
    camp = cfg.campaign
    known = lever_registry.registry(conf_dir / "lever")
    if camp.lever not in known:
        raise CampaignConfigError(f"campaign {camp.name!r}: unknown lever {camp.lever!r}; accepted: "
                                  f"{', '.join(sorted(known))} (conf/lever/*.yaml)")
    lever = known[camp.lever]
    try:
        # the default an engine that sets nothing runs: the file's, or the value an on preset gives the lever
        # on the campaign's quantization (a lever's file may give it its own default there)
        quant = cfg.model.get("quant") if cfg.get("model") else None
        default = lever_registry.effective_defaults(known, quant=quant if quant in QUANTS else None)[camp.lever]
        baseline = default if camp.arms.baseline is None else lever.parse(camp.arms.baseline, "baseline arm")
        if camp.arms.candidates is None:
            # the lever's other values: once a FLIP changes the default, the same campaign measures the way back
            candidates = [v for v in lever.values if v != baseline]
        else:
            candidates = [lever.parse(v, "candidate arm") for v in camp.arms.candidates]
    except lever_registry.LeverError as e:
        raise CampaignConfigError(str(e)) from None
    if cfg.aa:
        # the grid's self-check: two servers at one value (the baseline's), arms named a and b; no gates (they
        # prove a lever, and there is none to prove here), and the A/A rule instead of the lever rule
        candidates = [baseline]
        camp.gates = []
    if not candidates:
        raise CampaignConfigError(f"campaign {camp.name!r}: campaign.arms.candidates is empty; give at least one "
                                  f"value of {lever.name} ({lever.accepted()})")
    if baseline in candidates and not cfg.aa:
        raise CampaignConfigError(f"campaign {camp.name!r}: candidate {baseline!r} equals the baseline; "
                                  f"candidates must differ from the baseline ({lever.name} default); for the grid's "
                                  "A/A self-check (both arms at one value) add aa=true")
    if len({arm_name(v) for v in candidates}) != len(candidates):
        raise CampaignConfigError(f"campaign {camp.name!r}: duplicate candidates {list(candidates)}")
    camp.arms.baseline = baseline
    camp.arms.candidates = candidates
    bad_gates = [g for g in camp.gates if g not in GATE_NAMES]
    if bad_gates:
        raise CampaignConfigError(f"unknown gate(s) {bad_gates} in campaign.gates; accepted: {', '.join(GATE_NAMES)}")
    pinned = {}
    for name, raw in (camp.with_levers or {}).items():
        if name not in known:
            raise CampaignConfigError(f"campaign.with_levers: unknown lever {name!r}; accepted: "
                                      f"{', '.join(sorted(n for n in known if n != camp.lever))}")
        if name == camp.lever:
            raise CampaignConfigError(f"campaign.with_levers pins {name!r}, the campaign's own lever; its values are "
                                      "the arms (campaign.arms)")
        if name in lever.sets:
            raise CampaignConfigError(f"campaign.with_levers pins {name!r}, which the campaign's lever {lever.name!r} "
                                      f"sets (a preset: {name}={lever.sets[name]} when on); a pin would make its arms "
                                      "differ in less than the preset. Measure that lever in its own campaign")
        try:
            pinned[name] = known[name].parse(raw, "campaign.with_levers value")
        except lever_registry.LeverError as e:
            raise CampaignConfigError(str(e)) from None
    camp.with_levers = pinned
    exempt = {**dict(lever.inapplicable), **dict(camp.inapplicable or {})}
    bad = [g for g in exempt if g not in GATE_NAMES]
    if bad:
        raise CampaignConfigError(f"campaign.inapplicable names unknown gate(s) {bad}; accepted: "
                                  f"{', '.join(GATE_NAMES)}")
    empty = [g for g, why in exempt.items() if not str(why).strip()]
    if empty:
        raise CampaignConfigError(f"campaign.inapplicable {empty}: give the reason the gate cannot apply (the "
                                  "record quotes it)")
    camp.inapplicable = exempt
    pol = camp.policy
    if pol.flip_on_correctness and not cfg.aa:
        if not pol.fix_gates:
            raise CampaignConfigError(f"campaign {camp.name!r}: flip_on_correctness needs policy.fix_gates, the "
                                      f"gate(s) that FAIL on the baseline and PASS on the fix; accepted: "
                                      f"{', '.join(CORRECTNESS_GATES)}")
        wrong = [g for g in pol.fix_gates if g not in CORRECTNESS_GATES or g not in camp.gates]
        if wrong:
            raise CampaignConfigError(f"campaign {camp.name!r}: policy.fix_gates {wrong} must be correctness gates "
                                      f"the campaign runs; its gates: {', '.join(camp.gates)}")
    primary_by_grid = {g: list(axes) for g, axes in camp.policy.primary_axes_by_grid.items()}
    by_grid = {g: dict(axes) for g, axes in camp.policy.traded_axes_by_grid.items()}
    for key, grids in (("primary_axes_by_grid", primary_by_grid), ("traded_axes_by_grid", by_grid)):
        unknown_grids = sorted(set(grids) - set(options("grid", conf_dir)))
        if unknown_grids:
            raise CampaignConfigError(f"campaign.policy.{key} names unknown grid(s) {unknown_grids}; "
                                      f"accepted: {', '.join(options('grid', conf_dir))}")
    for where, axes in [("primary_axes", camp.policy.primary_axes)] + [
            (f"primary_axes_by_grid.{g}", a) for g, a in primary_by_grid.items()]:
        bad_axes = [a for a in axes if a not in _axis_names()]
        if bad_axes:
            raise CampaignConfigError(f"unknown axis {bad_axes} in campaign.policy.{where}; "
                                      f"accepted: {', '.join(_axis_names())}")
        if not axes:
            raise CampaignConfigError(f"campaign.policy.{where} is empty: name the axes that decide the verdict; "
                                      f"accepted: {', '.join(_axis_names())}")
    if cfg.grid.name in primary_by_grid:
        camp.policy.primary_axes = primary_by_grid[cfg.grid.name]
    if cfg.grid.name in by_grid:
        camp.policy.traded_axes = {**camp.policy.traded_axes, **by_grid[cfg.grid.name]}
    traded = dict(camp.policy.traded_axes)
    bad_traded = [a for a in traded if a not in _axis_names()]
    if bad_traded:
        raise CampaignConfigError(f"unknown axis {bad_traded} in campaign.policy.traded_axes; "
                                  f"accepted: {', '.join(_axis_names())}")
    primary_traded = [a for a in traded if a in camp.policy.primary_axes]
    if primary_traded:
        raise CampaignConfigError(f"campaign.policy.traded_axes {primary_traded} are primary axes: a primary axis "
                                  f"decides the verdict and cannot be traded; primary: "
                                  f"{', '.join(camp.policy.primary_axes)}")
    unexplained = [a for a, why in traded.items() if not str(why or "").strip()]
    if unexplained:
        raise CampaignConfigError(f"campaign.policy.traded_axes {unexplained} need the reason the lever trades "
                                  f"them (the record quotes it), e.g. traded_axes: {{itl: \"...\"}}")
    if camp.policy.name != "parity_enabler":
        raise CampaignConfigError(f"policy {camp.policy.name!r} is not known; accepted: parity_enabler")

    grid = cfg.grid
    if len(grid.prompts_per_leg) != len(grid.concurrency):
        raise CampaignConfigError(f"grid.prompts_per_leg {list(grid.prompts_per_leg)} must have one entry per "
                                  f"grid.concurrency {list(grid.concurrency)}")
    for key in ("concurrency", "prompts_per_leg"):
        if any(int(v) < 1 for v in grid[key]) or not grid[key]:
            raise CampaignConfigError(f"grid.{key} {list(grid[key])} must be a non-empty list of positive integers")
    short = [(int(c), int(n)) for c, n in zip(grid.concurrency, grid.prompts_per_leg) if int(n) < int(c)]
    if short:
        raise CampaignConfigError(f"grid.prompts_per_leg {list(grid.prompts_per_leg)}: a leg needs at least as many "
                                  f"prompts as its concurrency, or it never runs at that concurrency; short: "
                                  + ", ".join(f"c{c} with {n}" for c, n in short))
    if len(set(grid.concurrency)) != len(grid.concurrency):
        raise CampaignConfigError(f"grid.concurrency {list(grid.concurrency)} repeats a value; each concurrency "
                                  "is one point of the grid (use grid.reps for repetitions)")
    if grid.residency not in RESIDENCIES:
        raise CampaignConfigError(f"grid.residency={grid.residency!r} is not accepted; accepted: "
                                  f"{', '.join(RESIDENCIES)}")
    for key in ("reps", "input_len", "output_len"):
        if grid[key] < 1:
            raise CampaignConfigError(f"grid.{key}={grid[key]} must be >= 1")
    if grid.output_len < 2:
        raise CampaignConfigError(f"grid.output_len={grid.output_len} must be >= 2 (TPOT needs two tokens)")
    from campaigns.loadgen import make_output_lens
    try:
        make_output_lens(1, int(grid.output_len), float(getattr(grid, "output_len_range", 0.0)), 0)
    except ValueError as e:
        raise CampaignConfigError(f"grid.output_len_range={grid.output_len_range} with grid.output_len="
                                  f"{grid.output_len}: {e}; accepted: 0 <= r < 1 with output_len * (1 - r) >= 2") \
            from None

    model = cfg.model
    if "name" not in model or "quant" not in model:
        raise CampaignConfigError(f"model preset needs keys 'name' and 'quant', got {sorted(model.keys())}")
    if model.quant not in QUANTS:
        raise CampaignConfigError(f"model.quant={model.quant!r} is not accepted; accepted: {', '.join(QUANTS)}")
    from campaigns.gates import perturbable_kernel
    from vtengine.faults import FaultError
    try:                            # the self-checks break one of the lever's kernels that this model runs
        perturbable_kernel(cfg.campaign.lever, str(model.quant))
    except FaultError as e:
        raise CampaignConfigError(f"model.quant={model.quant} for lever {cfg.campaign.lever}: {e}, so the gates' "
                                  "self-checks could break nothing; accepted: weights the lever routes (mxfp4 or "
                                  "nvfp4 for a W4A16 GEMM lever)") from None
    if cfg.tracking.enabled and (OmegaConf.is_missing(cfg.tracking, "uri") or not cfg.tracking.uri):
        raise CampaignConfigError(f"tracking={cfg.tracking.name} needs tracking.uri=<uri> (e.g. http://host:5000, "
                                  "postgresql://..., sqlite:///mlflow.db), or use tracking=local / tracking=off")


def settings(ev) -> AppConfig:
    """An evidence file's composed config as the typed AppConfig (its schema checked, defaults filled for keys an
    older campaign did not have), so readers write ``settings(ev).grid.reps`` instead of ``.get()`` chains.
    Cached on the evidence for as long as its config object is the same one (configs are not edited in place,
    except by campaigns/calibrate.py's template, which drops the cache)."""
    from campaigns.evidence import _build
    cached = ev.__dict__.get("_settings")
    if cached is not None and cached[0] is ev.config:
        return cached[1]
    typed = _build(AppConfig, ev.config, "config")
    if "min_effect" not in ((ev.config.get("campaign") or {}).get("policy") or {}):
        typed.campaign.policy.min_effect = 0.0      # decided before the rule had it: every separation counted
    ev.__dict__["_settings"] = (ev.config, typed)
    return typed


def _axis_names() -> list[str]:
    from campaigns.stats import AXES, OPTIONAL_AXES
    return [a.name for a in AXES + OPTIONAL_AXES]


# ----------------------------------------------------------------------------------------------- helpers


def arm_name(value: Any) -> str:
    """The arm's name in records and MLflow: 'off'/'on' for booleans and 'off', else the value as text."""
    if value is False or value == "off":
        return "off"
    if value is True:
        return "on"
    return str(value)


def arm_env_value(value: Any) -> str:
    """The lever's env string that reproduces ``value`` in a server process."""
    return {False: "off", True: "on"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def to_plain(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)


# Keys that change what happens around a campaign, not what it measures: a resume may differ in them (a sweep's job
# ran with commit=false summaries=false tracking=off; its resume by hand need not repeat them).
UNMEASURED_KEYS = ("resume", "commit", "summaries", "tracking", "allow_dirty", "out_dir", "overrides")


def config_diff(then: DictConfig | dict, now: DictConfig | dict, limit: int = 6) -> list[str]:
    """The measured keys (UNMEASURED_KEYS left out) whose values differ between two composed configs, as
    "grid.name: 'online' then, 'online_wide' now", at most ``limit`` of them."""
    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(d, dict):
            out = {}
            for k, v in d.items():
                if not prefix and k in UNMEASURED_KEYS:
                    continue
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: d}
    a = flat(to_plain(then) if isinstance(then, DictConfig) else dict(then))
    b = flat(to_plain(now) if isinstance(now, DictConfig) else dict(now))
    keys = sorted(k for k in a.keys() | b.keys() if a.get(k, "(absent)") != b.get(k, "(absent)"))
    return [f"{k}: {a.get(k, '(absent)')!r} then, {b.get(k, '(absent)')!r} now" for k in keys[:limit]]


def config_hash(cfg: DictConfig | dict) -> str:
    """sha256 of the canonical JSON of the resolved config, without UNMEASURED_KEYS (they do not change the run)."""
    plain = to_plain(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    plain = {k: v for k, v in plain.items() if k not in UNMEASURED_KEYS}
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()
