"""The decode benchmark's results, typed: one dataclass per kind of row, each field's definition in its class's
docstring, serialised to the JSON of bench/results/decode-*.json (the evidence; the markdown is a view of it).

JSON mapping (``Record``): one key per field, in field order, named as the field. A field that is None is left
out, as the benchmark has always left out what it did not measure (an error row has no figures, a profile without
warnings no ``warning``), except the fields declared ``keep_none``, which a run always writes. ``from_dict`` reads
every result file written so far: a key the file lacks (an older run, an error row) reads as None; a key no field
names is an error, so a renamed field cannot pass silently.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar


def keep_none() -> Any:
    """A field written even when None (``"copy_bandwidth_gbs": null`` says "not measured yet")."""
    return field(default=None, metadata={"keep_none": True})


class Record:
    """A dataclass <-> its JSON object. ``nested`` maps a field to the Record class of its value (or of the items of
    its list)."""
    nested: ClassVar[dict[str, type[Record]]] = {}

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and not f.metadata.get("keep_none"):
                continue
            if isinstance(value, Record):
                value = value.to_dict()
            elif isinstance(value, list):
                value = [v.to_dict() if isinstance(v, Record) else v for v in value]
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; "
                             f"known: {', '.join(sorted(names))}")
        kw = {}
        for name, value in data.items():
            sub = cls.nested.get(name)
            if sub is not None and isinstance(value, list):
                value = [sub.from_dict(v) for v in value]
            elif sub is not None and isinstance(value, dict):
                value = sub.from_dict(value)
            kw[name] = value
        return cls(**kw)


@dataclass
class EngineTiming(Record):
    """One (model, quant, variant, concurrency) of the engine, key ``engine``: a row holds its figures or ``error``.

    - ms_per_step: the engine's own decode-step wall time, ``decode_time_s_sum / decode_steps_total`` over one
      ``generate`` of ``gen_len`` tokens after a warm-up; each step ends on the sampler's host copy, so it includes
      host work, the CUDA-graph replay and sampling. ``decode_steps`` steps were timed; ``wall_s`` is the whole
      ``generate`` (prefill included).
    - ms_per_step_wall: (t(generate gen_len tokens) - t(generate 2 tokens)) / (gen_len - 2), the same prompts: what
      a decode step costs end to end, as HF's figure is defined. Under async scheduling (pinned off unless a
      variant sets it) steps overlap the host's work, which the engine's own step timer cannot show (each step's
      launch-to-read then spans the step before it): this is the figure to compare async on against off.
    - weight_bytes: every weight read once per step (``model.weight_bytes()``, quantized weights at their packed
      size); kv_bytes_per_step: K and V of every layer for each sequence's mean context (prompt_len + gen_len / 2) at
      the cache's element size, times the batch.
    - floor_ms: (weight_bytes + kv_bytes_per_step) / copy bandwidth (vtengine/bench/common.py); frac_of_floor:
      floor_ms / ms_per_step (1.0 = the step moves its bytes at copy speed); frac_of_floor_wall likewise over
      ms_per_step_wall.
    - peak_gib: torch.cuda.max_memory_allocated since the engine was built (0 on CPU).
    - variant: the name of the lever configuration (``base`` or a ``--variant`` text); absent in the first runs.
    - max_model_len: the engine's context bound (it sizes the count split rule's slots); absent before 2026-12-02,
      when the bench's default was 4096.
    - round: which of ``--rounds`` timed it (0 first; variants run in reverse order in odd rounds, each round on a
      freshly built engine); absent in runs of one round.
    """
    model: str
    quant: str
    batch: int
    levers: dict[str, str] | None = None
    decode_steps: int | None = None
    ms_per_step: float | None = None
    wall_s: float | None = None
    ms_per_step_wall: float | None = None
    weight_bytes: int | None = None
    kv_bytes_per_step: float | None = None
    peak_gib: float | None = None
    floor_ms: float | None = None
    frac_of_floor: float | None = None
    frac_of_floor_wall: float | None = None
    error: str | None = None
    variant: str | None = None
    max_model_len: int | None = None
    round: int | None = None

    def set_floor(self, copy_bandwidth_gbs: float) -> None:
        """floor_ms and frac_of_floor from the bytes this step must read and the copy bandwidth (GB/s)."""
        self.floor_ms = 1e3 * (self.weight_bytes + self.kv_bytes_per_step) / (copy_bandwidth_gbs * 1e9)
        self.frac_of_floor = self.floor_ms / self.ms_per_step
        if self.ms_per_step_wall:
            self.frac_of_floor_wall = self.floor_ms / self.ms_per_step_wall


@dataclass
class HFTiming(Record):
    """HF transformers at one (model, concurrency), key ``hf_transformers_compiled``: random weights at the preset's
    shapes, static cache, ``compile`` says how it was compiled. Figures, or ``error`` with what was recorded until
    then.

    - ms_per_step: median over ``reps`` of (t(generate gen_len tokens) - t(generate 2 tokens)) / (gen_len - 2): the
      steady decode step, with prefill and the once-per-``generate`` costs of the decode loop (a fresh static cache,
      the compiled call's first dispatch) cancelled out, as the engine's figure excludes its graph capture.
    - ms_per_step_from_1tok: the earlier definition, (t(gen_len) - t(1)) / (gen_len - 1), medians likewise.
    - prefill_ms: median t(generate 1 token).
    - generate_s: every timed ``generate``, seconds, keyed by its new-token count ("1", "2", str(gen_len)).
    - dynamo_graphs_compiled, cudagraph_skips: dynamo's counters over the run (more than one graph = graph breaks
      or recompiles; a skip = HF ran partly without CUDA graphs); fullgraph_error: why fullgraph=True was dropped.
    """
    model: str
    batch: int
    device: str | None = None
    transformers: str | None = None
    compile: str | None = keep_none()
    reps: int | None = None
    prompt_len: int | None = None
    gen_len: int | None = None
    dtype: str | None = None
    attn_implementation: str | None = None
    fullgraph_error: str | None = None
    compile_and_warmup_s: float | None = None
    dynamo_graphs_compiled: int | None = None
    cudagraph_skips: int | None = None
    generate_s: dict[str, list[float]] | None = None
    prefill_ms: float | None = None
    ms_per_step_from_1tok: float | None = None
    ms_per_step: float | None = None
    error: str | None = None


@dataclass
class KernelRow(Record):
    """One kernel name of a profile (device activity on a GPU; a CPU op by self time on CPU).

    - kernel: the readable name (``short_kernel_name``); name_full: the trace's.
    - us_per_step: its time summed over the recorded steps / steps; launches_per_step likewise for its count.
    - share_of_step: us_per_step / the profile's device_step_us where the trace has one (with async scheduling the
      host's step is shorter than the device's), else / step_us_measured: the profile's share_basis says which
      (files written before it divided by step_us_measured).
    - own_us_per_step (device activity only; files before 2026-12-07 lack it): its time less the part before the
      end of the activities started before it (kernel_profile._own_times_us). Under PDL a kernel starts early and
      waits for the one before it, and us_per_step counts that wait; own times do not, and sum to the busy time.
    """
    kernel: str
    name_full: str
    us_per_step: float
    launches_per_step: float
    share_of_step: float | None = None
    own_us_per_step: float | None = None


@dataclass
class KernelsOther(Record):
    """The kernel names past the JSON's cut (``JSON_MAX_KERNELS``): how many, their time per step together."""
    names: int
    us_per_step: float


@dataclass
class ByteFloor(Record):
    """The kernels of a profile that stream one kind of bytes, against those bytes' floor (``byte_floors``).

    - kind: ``w4a16_gemm`` (the W4A16 projections' codes and scales), ``dense_gemm`` (bf16 weights: the
      projections of a bf16 model and the LM head, through cuBLAS or the Triton GEMV), ``decode_attention`` (K and V
      of every layer at the profile's context, for every sequence).
    - kernels: the profile's kernel names of that kind; us_per_step: their time summed.
    - bytes_per_step: what they must read at least once per step; floor_us = bytes / copy bandwidth;
      frac_of_floor = floor_us / us_per_step (1.0 = those kernels stream their bytes at copy speed).
    - own_us_per_step, frac_of_floor_own: the same from the kernels' own times (KernelRow.own_us_per_step: under
      PDL a kernel's wait for the one before it is that one's time); None on CPU and in files before 2026-12-07.
    """
    kind: str
    kernels: list[str]
    us_per_step: float
    bytes_per_step: float
    floor_us: float | None = None
    frac_of_floor: float | None = None
    own_us_per_step: float | None = None
    frac_of_floor_own: float | None = None


@dataclass
class KernelProfile(Record):
    """``steps`` decode steps of one engine configuration under torch.profiler, key ``profiles``: figures or
    ``error``.

    - step_us_measured: the mean wall time of a recorded step under the profiler; step_us_timed: the same
      configuration's ms_per_step from its timed run, in us.
    - kernel_us_per_step: the sum of every kernel name's us_per_step (those past the cut included);
      gap_us_per_step = step_us_measured - kernel_us_per_step: launch gaps, idle device time and host work.
    - device_step_us (CUDA only): the device timeline's period per recorded step (kernel_profile.device_step_us);
      device_idle_us_per_step = device_step_us - the device's busy time (the union of its kernels' intervals, so
      kernels overlapping under PDL count once; files before that subtracted kernel_us_per_step): the device
      waiting between kernels and between steps, which async scheduling exists to remove (the host-side step time
      cannot show it: with a step in flight the host returns early).
    - activity: "cuda" (device kernels, memcpy, memset) or "cpu" (CPU ops by self time, a CPU stand-in).
    - context_len: the context at the first recorded step (prompt + warm steps + the profiler's 2 warm-up steps).
    - steps_asked vs steps: the recorded steps asked for and found in the trace; warning: why the figures may be off.
    """
    nested: ClassVar[dict[str, type[Record]]] = {"kernels": KernelRow, "kernels_other": KernelsOther,
                                                  "byte_floors": ByteFloor}
    model: str
    quant: str
    batch: int
    activity: str | None = None
    steps: int | None = None
    steps_asked: int | None = None
    warm_steps: int | None = None
    context_len: int | None = None
    step_us_measured: float | None = None
    kernel_us_per_step: float | None = None
    gap_us_per_step: float | None = None
    num_kernel_names: int | None = None
    kernels: list[KernelRow] | None = None
    kernels_other: KernelsOther | None = None
    warning: str | None = None
    step_us_timed: float | None = None
    error: str | None = None
    variant: str | None = None
    byte_floors: list[ByteFloor] | None = None
    device_step_us: float | None = None
    device_idle_us_per_step: float | None = None
    share_basis: str | None = None          # "device" (device_step_us) or "host"; files before it: the host's


@dataclass
class Variant(Record):
    """A lever configuration timed in the run: ``base`` (the ``--lever`` values) or a ``--variant`` on top of it."""
    name: str
    levers: dict[str, str]


@dataclass
class DecodeResult(Record):
    """One ``vtengine bench decode`` run: where and with what it ran, and every figure it took.

    ``complete`` is False until the run ends (the file is rewritten after each figure); ``interrupted`` is True when
    a time limit (SIGINT) stopped it. ``copy_bandwidth_gbs`` is vtengine/bench/common.py's. ``argv``, ``variants``,
    ``profiles`` and ``complete`` are absent in the first run's file.
    """
    nested: ClassVar[dict[str, type[Record]]] = {"variants": Variant, "engine": EngineTiming,
                                                 "hf_transformers_compiled": HFTiming, "profiles": KernelProfile}
    device: str | None = None
    torch: str | None = None
    triton: str | None = None
    transformers: str | None = None
    python: str | None = None
    date: str | None = None
    complete: bool | None = None
    argv: list[str] | None = None
    copy_bandwidth_gbs: float | None = keep_none()
    prompt_len: int | None = None
    gen_len: int | None = None
    variants: list[Variant] | None = None
    engine: list[EngineTiming] = field(default_factory=list)
    hf_transformers_compiled: list[HFTiming] = field(default_factory=list)
    profiles: list[KernelProfile] | None = None
    elapsed_s: float | None = None
    interrupted: bool | None = None
