"""``vtengine bench decode``: the flags, the order of the phases, and the result file rewritten after each figure.

Order: the copy bandwidth; then every (model, quant) x variant: one engine, timed at every concurrency and then
(``--profile``) profiled on the same engine; HF comes last (``--hf``). The result files are rewritten after each
figure, so a failure or a kill in an optional part never loses the figures already taken; a SIGINT (a step's time
limit) marks the run interrupted and exits 130.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vtengine.bench import common
from vtengine.bench.decode import engine_timing, hf_baseline, kernel_profile, report
from vtengine.bench.decode.results import DecodeResult, EngineTiming, KernelProfile, Variant


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vtengine bench decode")
    ap.add_argument("--models", default="qwen3-8b:bf16,qwen3-8b:mxfp4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=None, help="the engine's context bound (it sizes the "
                    "decode split rule's slots); unset: the engine's own default, the model's maximum, as a server "
                    "has it (runs before 2026-12-02 used 4096)")
    ap.add_argument("--hf", action="store_true", help="also time HF transformers for every bf16 model (static "
                    "cache + generate's torch.compile, reduce-overhead)")
    ap.add_argument("--hf-reps", type=int, default=3, help="timed repetitions for HF (the median is reported)")
    ap.add_argument("--profile", action="store_true", help="per-kernel torch.profiler breakdown of decode steps "
                    "(on the timed engine, right after its timings)")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--profile-variants", default=None, metavar="NAME;NAME",
                    help="profile only these variants ('base' and the --variant texts, ';'-separated); default all")
    ap.add_argument("--lever", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--variant", action="append", default=[], metavar="LEVER=VALUE[,LEVER=VALUE...]",
                    help="another engine configuration on top of the --lever base, timed beside it in the same run "
                    "(repeatable)")
    ap.add_argument("--rounds", type=int, default=1, help="time every variant this many times, each on a fresh "
                    "engine, in reverse order every other round (ABBA), and report the median and spread: one "
                    "engine's step time varies by several % between builds, so a single round cannot tell a few % "
                    "apart (profiles run in the first round only)")
    return ap


def parse_model_specs(text: str) -> list[tuple[str, str]]:
    """``model:quant[,model:quant...]`` -> [(model, quant), ...]."""
    specs = []
    for spec in text.split(","):
        model, sep, quant = spec.strip().partition(":")
        if not sep or not model or not quant:
            raise ValueError(f"--models expects model:quant[,model:quant...], e.g. qwen3-8b:bf16; got {spec!r}")
        specs.append((model, quant))
    return specs


def parse_variants(base: dict, texts: list[str]) -> list[tuple[str, dict]]:
    """[("base", levers)] + one (name, levers) per ``--variant LEVER=VALUE[,LEVER=VALUE...]`` on top of the base."""
    out = [("base", dict(base))]
    for text in texts:
        pairs = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in pairs if "=" not in p]
        if bad or not pairs:
            raise ValueError(f"--variant expects LEVER=VALUE[,LEVER=VALUE...], got {text!r}")
        out.append((",".join(pairs), dict(base, **dict(p.split("=", 1) for p in pairs))))
    return out


@dataclass
class DecodeArgs:
    """The flags, validated: what the run measures."""
    specs: list[tuple[str, str]]
    batches: list[int]
    prompt_len: int
    gen_len: int
    max_model_len: int | None
    hf: bool
    hf_reps: int
    profile: bool
    profile_steps: int
    profile_variants: list[str] | None      # None: profile every variant
    variants: list[tuple[str, dict]]        # ("base", the --lever values) first
    rounds: int = 1

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> DecodeArgs:
        """Raises ValueError naming the bad flag value and what is accepted."""
        specs = parse_model_specs(args.models)
        try:
            batches = [int(x) for x in args.batches.split(",")]
        except ValueError:
            raise ValueError(f"--batches expects comma-separated integers, e.g. 1,8; got {args.batches!r}") from None
        if args.gen_len < 3:
            raise ValueError(f"--gen-len must be >= 3, got {args.gen_len}")
        if args.max_model_len is not None and args.max_model_len < args.prompt_len + args.gen_len:
            raise ValueError(f"--max-model-len {args.max_model_len} must hold --prompt-len + --gen-len "
                             f"({args.prompt_len + args.gen_len})")
        if args.profile_steps < 1 or args.hf_reps < 1 or args.rounds < 1:
            raise ValueError(f"--profile-steps, --hf-reps and --rounds must be >= 1, got {args.profile_steps}, "
                             f"{args.hf_reps}, {args.rounds}")
        bad = [p for p in args.lever if "=" not in p]
        if bad:
            raise ValueError(f"--lever expects NAME=VALUE, got {bad[0]!r}")
        levers = dict(p.split("=", 1) for p in args.lever)
        return cls(specs=specs, batches=batches, prompt_len=args.prompt_len, gen_len=args.gen_len,
                   max_model_len=args.max_model_len, hf=args.hf,
                   hf_reps=args.hf_reps, profile=args.profile, profile_steps=args.profile_steps,
                   profile_variants=None if args.profile_variants is None else args.profile_variants.split(";"),
                   variants=parse_variants(levers, args.variant), rounds=args.rounds)

    def profiles(self, variant: str) -> bool:
        return self.profile and (self.profile_variants is None or variant in self.profile_variants)


class Run:
    """The result under construction, where it is written, and the run's log (seconds since the start)."""

    def __init__(self, result: DecodeResult, out_dir: Path, stem: str):
        self.result, self.out_dir, self.stem = result, out_dir, stem
        self.start = time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.0f} s] {msg}", flush=True)

    def save(self) -> None:
        self.result.elapsed_s = time.perf_counter() - self.start
        report.write_outputs(self.result, self.out_dir, self.stem)


def engine_phase(cfg: DecodeArgs, run: Run) -> None:
    """Each (model, quant) x round x variant: one engine, timed at every concurrency, then (``--profile``, first
    round) profiled on the same engine. Variants of one model run back to back, so their ratios come from one
    machine state; with ``--rounds`` they alternate order (ABBA), so a drift over the run favours none."""
    bw = run.result.copy_bandwidth_gbs
    rows = run.result.engine
    for model, quant in cfg.specs:
        for rnd, (name, levers) in ((rnd, v) for rnd in range(cfg.rounds)
                                    for v in (cfg.variants if rnd % 2 == 0 else cfg.variants[::-1])):
            llm = None
            round_ = rnd if cfg.rounds > 1 else None            # None: a run of one round records no round
            tag = f"{model} {quant} [{name}]" + (f" round {rnd}" if round_ is not None else "")
            try:
                torch.cuda.reset_peak_memory_stats()
                llm = engine_timing.build_llm(model, quant, max(max(cfg.batches), 8), levers,
                                              max_model_len=cfg.max_model_len)
                for b in cfg.batches:
                    try:
                        r = engine_timing.engine_decode_ms(llm, b, cfg.prompt_len, cfg.gen_len)
                    except Exception as e:
                        r = EngineTiming(model=model, quant=quant, batch=b, levers=levers, error=common.error_text(e))
                        run.log(f"{tag} c{b}: error {r.error}")
                    else:
                        r.set_floor(bw)
                        run.log(f"{tag} c{b}: {r.ms_per_step:.3f} ms/step ({r.ms_per_step_wall:.3f} wall), "
                                f"floor {r.floor_ms:.3f} ms "
                                f"({100 * r.frac_of_floor:.1f}% of the bandwidth floor)")
                    r.variant = name
                    r.round = round_
                    r.max_model_len = llm.engine.max_model_len
                    rows.append(r)
                    run.save()
                if cfg.profiles(name) and rnd == 0:
                    profile_phase(cfg, run, llm, model, quant, name)
            except Exception as e:                      # the engine would not build: record it, go on
                done = {r.batch for r in rows
                        if (r.model, r.quant, r.variant, r.round) == (model, quant, name, round_)}
                rows.extend([EngineTiming(model=model, quant=quant, batch=b, levers=levers, variant=name, round=round_,
                                          error=common.error_text(e)) for b in cfg.batches if b not in done])
                run.log(f"{tag}: error {common.error_text(e)}")
                run.save()
            finally:
                llm = None
                common.free_memory()


def profile_phase(cfg: DecodeArgs, run: Run, llm, model: str, quant: str, variant: str) -> None:
    """Every concurrency of one built engine under the profiler, beside its timed step time."""
    timed = {(r.model, r.quant, r.variant, r.batch): r.ms_per_step for r in run.result.engine}
    for b in cfg.batches:
        try:
            p = kernel_profile.profile_engine_decode(llm, b, cfg.prompt_len, steps=cfg.profile_steps)
            p.byte_floors = kernel_profile.byte_floors(p, llm.engine, run.result.copy_bandwidth_gbs)
            if timed.get((model, quant, variant, b)):
                p.step_us_timed = 1e3 * timed[(model, quant, variant, b)]
            run.log(f"profile {model} {quant} [{variant}] c{b}: kernels {p.kernel_us_per_step:.0f} us/step of "
                    f"{p.step_us_measured:.0f} us/step"
                    + (f" (device {p.device_step_us:.0f} us/step, idle {p.device_idle_us_per_step:.0f})"
                       if p.device_step_us is not None else "") + f"; top: {p.kernels[0].kernel}")
        except Exception as e:
            p = KernelProfile(model=model, quant=quant, batch=b, error=common.error_text(e))
            run.log(f"profile {model} {quant} [{variant}] c{b}: error {p.error}")
        p.variant = variant
        run.result.profiles.append(p)
        run.save()


def hf_phase(cfg: DecodeArgs, run: Run) -> None:
    """HF transformers for every bf16 model at every concurrency."""
    for model in dict.fromkeys(m for m, q in cfg.specs if q == "bf16"):
        for b in cfg.batches:
            run.log(f"HF transformers {model} c{b}: loading, compiling, timing ...")
            h = hf_baseline.hf_decode_ms(model, b, cfg.prompt_len, cfg.gen_len, reps=cfg.hf_reps)
            run.result.hf_transformers_compiled.append(h)
            run.save()
            run.log(f"HF transformers {model} c{b}: " + (f"{h.ms_per_step:.3f} ms/step ({h.compile})"
                                                          if h.ms_per_step is not None else f"error {h.error}"))


def main(out_dir: str = "bench/results", argv: list[str] | None = None) -> int:
    """Run the benchmark; writes OUT_DIR/decode-<date>.json and .md (decode-<date>-2... when a run of the same day
    is there) and copies both to $OUT when that is set. Returns the exit status (2: no CUDA GPU)."""
    args = build_parser().parse_args(argv or [])
    if not torch.cuda.is_available():
        print("vtengine bench decode needs a CUDA GPU")
        return 2
    cfg = DecodeArgs.from_namespace(args)
    import transformers
    import triton
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    date = datetime.date.today().isoformat()
    stem = report.unique_stem(out, f"decode-{date}")
    result = DecodeResult(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
                          transformers=transformers.__version__, python=platform.python_version(), date=date,
                          complete=False, argv=list(argv or []), copy_bandwidth_gbs=None, prompt_len=cfg.prompt_len,
                          gen_len=cfg.gen_len, variants=[Variant(name=n, levers={**engine_timing.BENCH_PINS, **lv})
                                                          for n, lv in cfg.variants],
                          engine=[], hf_transformers_compiled=[], profiles=[])
    run = Run(result, out, stem)
    try:
        result.copy_bandwidth_gbs = common.copy_bandwidth_gbs()
        run.log(f"copy bandwidth {result.copy_bandwidth_gbs:.0f} GB/s; writing {out / stem}.json/.md")
        engine_phase(cfg, run)
        if cfg.hf:
            hf_phase(cfg, run)
    except KeyboardInterrupt:                           # a step timeout (SIGINT): keep what was measured
        result.interrupted = True
        run.save()
        run.log(f"interrupted; what was measured is in {out / stem}.json and .md")
        return 130
    result.complete = True
    run.save()
    run.log(f"done: {out / stem}.json and .md" + (" (copied to $OUT)" if os.environ.get("OUT") else ""))
    return 0
