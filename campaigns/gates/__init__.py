"""The correctness gates. Each gate module has ``run(ctx, arm, fault=False) -> GateResult``.

A gate is run twice per arm: for real, and with its deliberate fault(s) (``fault=True``). A fault breaks the engine
under test where a real bug would be (vtengine/faults.py: the lever's kernel output perturbed inside the forward, a
graph captured over a broken kernel, a block table pointing past the KV cache, a stale decode input, a token lost
on the serving path, the lever inert or stuck), never the gate's own bookkeeping, so the gate has to run the engine
to see it. The faulted run must fail; with several faults, every one of them (the faulted run "passes" when any
fault slipped through). ``GateResult.self_check`` records whether it failed (False = the gate cannot fail = the
campaign is INVALID).

In-process gates share one engine per arm and one oracle engine (the torch reference path), built lazily and
freed before the grid's servers start, so two 8B models never sit on the GPU next to two servers.
"""
from __future__ import annotations

import gc
import importlib
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

from campaigns.evidence import Arm, GateResult
from vtengine import confdirs


@dataclass(frozen=True)
class Gate:
    """One gate: where its function lives, where it runs (in process before the servers start, or against the
    arm's server), and whether failing it on the candidate is a correctness failure (policy rule 2; the mechanism
    gate is about an inert lever, rule 1)."""
    name: str
    function: str                       # "module:function"
    runs: str                           # "in_process" | "server"
    correctness: bool = True

    def load(self) -> Callable[..., GateResult]:
        module, fn = self.function.split(":")
        return getattr(importlib.import_module(module), fn)


# The one list of gates, in the order they run and are reported (the server gate needs the arms' servers).
GATES = {g.name: g for g in (
    Gate("op", "campaigns.gates.op:run", "in_process"),
    Gate("battery", "campaigns.gates.battery:run_battery", "in_process"),
    Gate("near_tie", "campaigns.gates.battery:run_near_tie", "in_process"),
    Gate("graph_parity", "campaigns.gates.parity:run_graph_parity", "in_process"),
    Gate("async_parity", "campaigns.gates.parity:run_async_parity", "server"),
    Gate("mechanism", "campaigns.gates.mechanism:run", "in_process", correctness=False),
    Gate("profile", "campaigns.gates.profile:run", "in_process", correctness=False),
    Gate("memcheck", "campaigns.gates.memcheck:run", "in_process"),
)}
GATE_NAMES = tuple(GATES)
CORRECTNESS_GATES = tuple(n for n, g in GATES.items() if g.correctness)
IN_PROCESS_GATES = tuple(n for n, g in GATES.items() if g.runs == "in_process")
SERVER_GATES = tuple(n for n, g in GATES.items() if g.runs == "server")

BATTERY = "battery/default.yaml"        # the fixed prompts, under conf/ (a project's own conf/ may replace them)
GATE_KV_BLOCKS = 1024                 # in-process gate engines: a small KV pool (16k tokens) is plenty
# levers whose mechanism needs prompts of full chunks of chunked_prefill's N (pinned, or the arm's own): the probe
# sends 2N + 9 tokens (with chunk_above T: T + 9, past it) and the CPU bound grows to hold them (these levers route
# no kernel, so the CPU runs the torch references)
LONG_PROMPT_LEVERS = ("chunked_prefill", "chunk_graphs", "chunk_above")


def long_prompt_len(chunk: int, above: int | None) -> int:
    """The probes' long prompt, less its tail: two full N-token chunks, and past chunk_above's T when it is on (a
    prompt of at most T would go whole)."""
    return max(2 * chunk, above or 0)


def perturbable_kernel(lever: str, quant: str) -> str:
    """The kernel the self-checks break for ``lever`` on ``quant`` weights: the first of its kernels this model runs
    (vtengine/faults.first_perturbable); rms_norm for a lever that routes none (every model runs it every step).
    FaultError when none of its kernels runs on these weights: the campaign could prove nothing."""
    from vtengine import levers
    from vtengine.faults import first_perturbable
    return first_perturbable(list(levers.get(lever).affects) or ["rms_norm"], quant)


PREFILL_ONLY_KERNELS = ("prefill_attention",)      # kernels a decode step never runs


def profiled_kernel(lever: str, quant: str) -> str:
    """The kernel the profile gate's self-check slows for ``lever``: the first of its kernels that a decode step runs
    (the profile windows are decode steps), else rms_norm. A lever of prefill kernels alone (prefill_gqa_pack, the
    preset mixed_prefill) would otherwise plant its slowdown where no window looks, and its campaign end INVALID."""
    from vtengine import levers
    from vtengine.faults import first_perturbable
    decode = [k for k in levers.get(lever).affects if k not in PREFILL_ONLY_KERNELS]
    return first_perturbable(decode or ["rms_norm"], quant)


@dataclass
class GateContext:
    lever: str
    arms: list[Arm]
    model: str
    quant: str
    device: str                        # "cuda" | "cpu"
    gate_cfg: Any                      # the composed `gate` config group
    near_tie_max_mnats: float = 500.0
    work_dir: Path = Path(".")
    server_urls: dict[str, str] = field(default_factory=dict)       # arm -> base URL (async_parity)
    server_model: str = ""
    inert_arm: str | None = None       # fault injection for tests: this arm runs with the lever forced to baseline
    broken_arm: str | None = None      # fault injection for tests: this arm's engines run the perturb fault throughout
    slowed: dict[str, str] = field(default_factory=dict)   # tests: arm -> a kernel its engine runs slow_runs times
    slow_runs: int = 2                                        # per call (twice by default)
    with_levers: dict[str, Any] = field(default_factory=dict)      # other levers pinned for both arms
    cpu_max_model_len: int = 512
    _engines: dict[str, Any] = field(default_factory=dict)
    cache: dict[str, Any] = field(default_factory=dict)

    @property
    def baseline(self) -> Arm:
        return next(a for a in self.arms if a.role == "baseline")

    @property
    def backend(self) -> str:
        # the levers route Triton kernels; on CPU those run in Triton's interpreter (a lever with no kernel of its
        # own rehearses on the torch references alone)
        return "torch" if self.device != "cuda" and self.triton_kernels == [] else "triton"

    @property
    def triton_kernels(self) -> list[str] | None:
        """On CPU only the lever's own kernels go through the (interpreted) Triton path; on CUDA all of them."""
        from vtengine import levers
        return None if self.device == "cuda" else list(levers.get(self.lever).affects)

    @property
    def max_model_len(self) -> int | None:
        # decode splits follow max_model_len: keep it small on CPU, where the interpreter walks every program;
        # the runner gives the grid's servers the same value, so served and in-process decode split alike
        if self.device == "cuda":
            return None
        from vtengine import levers
        sets = levers.get(self.lever).sets             # a preset's levers (mixed_prefill: its chunk size)
        chunk = [self.with_levers.get("chunked_prefill", sets.get("chunked_prefill"))]
        above = [self.with_levers.get("chunk_above", sets.get("chunk_above"))]
        if self.lever in ("chunked_prefill", "chunk_above"):        # the arms' own values (a fault swaps them)
            (chunk if self.lever == "chunked_prefill" else above).extend(a.value for a in self.arms)
        chunk = max((c for c in chunk if isinstance(c, int)), default=None)
        above = max((a for a in above if isinstance(a, int)), default=None)
        if {self.lever, *sets} & set(LONG_PROMPT_LEVERS) and isinstance(chunk, int):
            return max(self.cpu_max_model_len, long_prompt_len(chunk, above) + 64)
        return self.cpu_max_model_len

    def lever_values(self, arm: Arm, inert: bool = False) -> dict[str, Any]:
        value = self.baseline.value if (inert or arm.name == self.inert_arm) else arm.value
        return {**self.with_levers, self.lever: value}

    def engine(self, arm: Arm):
        """The arm's in-process LLM (Triton backend), built once."""
        if arm.name not in self._engines:
            from vtengine.engine.llm import LLM
            from vtengine.faults import set_fault
            llm = LLM(model=self.model, quant=self.quant, backend=self.backend, levers=self.lever_values(arm),
                      num_kv_blocks=GATE_KV_BLOCKS, max_num_seqs=32, triton_kernels=self.triton_kernels,
                      max_model_len=self.max_model_len)
            standing = self.standing_fault(arm)
            if standing is not None:                # a product test's broken or slowed arm: broken everywhere,
                set_fault(llm.engine, standing)     # eager steps and captured graphs alike
                runner = llm.engine.runner
                if runner.use_graphs:
                    runner.graphs = {}
                    runner.capture_graphs(llm.engine.max_num_seqs)
            self._engines[arm.name] = llm
        return self._engines[arm.name]

    def standing_fault(self, arm: Arm):
        """The fault a product test planted in this arm for the whole campaign (broken_arm, slowed), or None."""
        from vtengine.faults import Fault
        if arm.name == self.broken_arm:
            return self.perturb_fault()
        if arm.name in self.slowed:
            return Fault("slow", self.slowed[arm.name], size=float(self.slow_runs - 1))
        return None

    def perturb_fault(self, size: float = -1.5):
        """The lever's own kernel broken: its output scaled by 1 + size in every call (-1.5: by -0.5); the first of
        its kernels that this model runs (no W4A16 GEMM on bf16 weights). A lever that routes no kernel (an
        engine-loop lever) gets rms_norm broken: every model runs it every step. Not a plain negation: with every
        projection broken (a quantized model's W4A16 GEMM) negations cancel in pairs (q.k, v then o, gate_up then
        down) and the engine's tokens come out unchanged; -0.5 in a pair is 0.25, which no layer undoes."""
        from vtengine.faults import Fault
        return Fault("perturb", perturbable_kernel(self.lever, self.quant), size)

    def decode_fault(self, size: float = -1.5):
        """perturb_fault on a kernel the decode graphs run (profiled_kernel): graph_parity's captured graphs are
        decode steps, so a lever of prefill kernels alone (prefill_gqa_pack, mixed_prefill) gets rms_norm broken;
        its own prefill attention in them broke nothing the gate compares, and the self-check passed (H200,
        2026-12-03, the first mixed_prefill campaign)."""
        from vtengine.faults import Fault
        return Fault("perturb", profiled_kernel(self.lever, self.quant), size)

    @contextmanager
    def synchronous(self, arm: Arm):
        """The arm's engine with async scheduling off (the in-process anchors the async_parity gate compares a
        server with are synchronous by definition)."""
        from vtengine import levers
        llm = self.engine(arm)
        be = llm.engine.backend
        saved = be.levers
        be.levers = levers.resolve({**{n: v for n, v in saved.values.items()}, "async_scheduling": False})
        try:
            yield llm
        finally:
            be.levers = saved

    @contextmanager
    def faulted(self, arm: Arm, fault):
        """The arm's engine with ``fault`` set, decoding eagerly (a captured graph would replay the clean kernels);
        mended afterwards."""
        from vtengine.faults import set_fault
        llm = self.engine(arm)
        runner = llm.engine.runner
        use_graphs, runner.use_graphs = runner.use_graphs, False
        set_fault(llm.engine, fault)
        try:
            yield llm
        finally:
            set_fault(llm.engine, self.standing_fault(arm))
            runner.use_graphs = use_graphs

    @contextmanager
    def graphs_captured_with(self, arm: Arm, fault, max_batch: int, chunk: bool = False):
        """The arm's runner replaying graphs captured while ``fault`` broke the engine: its decode graphs (batch
        sizes up to ``max_batch``), or with ``chunk`` its chunk graphs (the lever chunk_graphs, at their chunk) and
        the decode graphs as they were. Eager steps run as the arm's do (clean, or a product test's standing fault:
        mending them to clean healed a broken arm for every gate after), and the arm's own graphs (with their
        static buffers) are put back afterwards, so nothing is re-captured."""
        from vtengine.faults import set_fault
        llm = self.engine(arm)
        runner = llm.engine.runner
        saved = {k: getattr(runner, k) for k in ("graphs", "g_out", "g_ids", "g_pos", "g_ctx", "chunk_graphs",
                                                   "graph_pool")}
        set_fault(llm.engine, fault)
        try:
            if chunk:
                runner.capture_chunk_graphs(runner.chunk_graphs.chunk, runner.max_num_seqs - 1)
            else:
                runner.graphs = {}
                runner.capture_graphs(max_batch)
        finally:
            set_fault(llm.engine, self.standing_fault(arm))     # only the captured graphs carry the fault
        try:
            yield llm
        finally:
            for k, v in saved.items():
                setattr(runner, k, v)

    @contextmanager
    def lever_set_to(self, arm: Arm, value: Any):
        """The arm's engine with the campaign's lever resolved to ``value`` instead of the arm's own (an inert or a
        stuck lever), decoding eagerly. Backends read levers per call, so the kernels really take that route."""
        from vtengine import levers
        llm = self.engine(arm)
        be, runner = llm.engine.backend, llm.engine.runner
        saved, use_graphs = be.levers, runner.use_graphs
        be.levers, runner.use_graphs = levers.resolve({**self.lever_values(arm), self.lever: value},
                                                      quant=self.quant), False
        llm.engine.set_step_levers(be.levers)       # the scheduler's levers too (chunked_prefill, mixed_steps)
        try:
            yield llm
        finally:
            be.levers, runner.use_graphs = saved, use_graphs
            llm.engine.set_step_levers(saved)

    def oracle(self):
        """The torch reference path on the same weights, synchronous (a reference has no step in flight): the
        goldens' source."""
        if "oracle" not in self._engines:
            from vtengine.engine.llm import LLM
            levers = {**self.lever_values(self.baseline), "async_scheduling": False}
            self._engines["oracle"] = LLM(model=self.model, quant=self.quant, backend="torch",
                                          levers=levers, num_kv_blocks=GATE_KV_BLOCKS,
                                          max_num_seqs=32, cuda_graphs=False, max_model_len=self.max_model_len)
        return self._engines["oracle"]

    def release_engines(self) -> None:
        import torch
        self._engines.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def battery_prompts(self) -> list[str]:
        prompts = yaml.safe_load(confdirs.file(BATTERY).read_text())["prompts"]
        return prompts[: int(self.gate_cfg.battery.prompts)]


def result(gate: str, arm: Arm, passed: bool, t0: float, **kw) -> GateResult:
    return GateResult(gate=gate, arm=arm.name, passed=bool(passed), duration_s=round(time.perf_counter() - t0, 3),
                      **kw)


def skipped(gate: str, arm: Arm, reason: str) -> GateResult:
    return GateResult(gate=gate, arm=arm.name, passed=True, skipped=True, reason=reason)


def run_gate(name: str, ctx: GateContext, arm: Arm, self_check: bool = True) -> GateResult:
    """Run one gate on one arm, then its deliberate fault(s); their outcome becomes ``self_check`` (True only when
    the faulted run failed, i.e. every fault was caught). ``duration_s`` is both runs' (what the campaign spent on
    the gate); the faulted run's own share is details["self_check_s"]."""
    fn = GATES[name].load()
    res = fn(ctx, arm, fault=False)
    if res.skipped or not self_check:
        return res
    t0 = time.perf_counter()
    faulted = fn(ctx, arm, fault=True)
    res.details["self_check_s"] = round(time.perf_counter() - t0, 3)
    res.duration_s = round(res.duration_s + res.details["self_check_s"], 3)
    res.self_check = not faulted.passed
    res.details["self_check_fault"] = faulted.details.get("fault", "")
    res.details["self_check_counts"] = faulted.counts
    if "faults" in faulted.details:
        res.details["self_check_faults"] = faulted.details["faults"]
    return res
