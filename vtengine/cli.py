"""`vtengine [--conf-dir DIR]`: levers | generate | serve |
bench {kernels,decode,prefill,prefill-attention,w4a16-sass,fused-sass,serve}.

``--conf-dir`` (or VTENGINE_CONF_DIR) names a project's own conf/ over the packaged one (vtengine/confdirs.py).
User errors (bad model, quant, lever value, request) print one line naming the bad value and exit 2.
"""
from __future__ import annotations

import argparse
import sys

from vtengine.config import QUANTS


def _lever_args(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--lever expects name=value, got {pair!r}")
        out[name.strip()] = value.strip()
    return out


def cmd_levers(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from vtengine import levers
    from vtengine import confdirs
    resolved = levers.resolve(_lever_args(args.lever), quant=args.quant)
    dirs = ", ".join(str(d / "lever") for d in confdirs.search_dirs())
    table = Table(title=f"vtengine levers (config > env > conf/lever default; files from {dirs})")
    verdicts = _last_verdicts()
    cols = ("lever", "env", "default", "value", "source") + (("last verdict",) if verdicts else ()) + (
        "affects", "summary")
    for col in cols:                    # names and values whole (a folded name cannot be searched or copied)
        table.add_column(col, overflow="fold", no_wrap=col in ("lever", "env", "value", "source"))
    for name, lv in levers.registry().items():
        own = "".join(f"; {q}: {v}" for q, v in sorted(lv.default_by_quant.items()))
        table.add_row(name, lv.env, str(lv.default) + own, str(resolved.values[name]), resolved.sources[name],
                      *((verdicts.get(name, "—"),) if verdicts else ()), ", ".join(lv.affects), lv.summary)
    Console(width=max(160 if verdicts else 120, Console().width)).print(table)
    if not verdicts:
        print("(no binding verdicts under the project root's records/campaigns; `vtcampaign status` says more)")
    return 0


def _last_verdicts() -> dict[str, str]:
    """Each lever's latest binding verdict per model, from the project's records/campaigns ("FLIP on qwen3-8b
    (bf16), 2026-12-03"), when the campaign manager is installed beside the engine; freshness is
    `vtcampaign status`'s."""
    try:
        from campaigns.cli import DEFAULT_OUT_DIR, project_root
        from campaigns.evidence import find_evidence, load_evidence
        from campaigns.recheck import latest_binding, measured_on
    except ImportError:
        return {}
    out_dir = project_root() / DEFAULT_OUT_DIR
    if not out_dir.is_dir():
        return {}
    out: dict[str, list[str]] = {}
    for _key, ev in sorted(latest_binding([load_evidence(p) for p in find_evidence(out_dir)]).items()):
        out.setdefault(ev.lever, []).append(f"{ev.decision.verdict} on {measured_on(ev)}, {ev.date}")
    return {k: "; ".join(v) for k, v in out.items()}


def cmd_generate(args) -> int:
    from vtengine.engine.llm import LLM
    from vtengine.engine.sampling_params import SamplingParams
    llm = LLM(model=args.model, quant=args.quant, backend=args.backend, levers=_lever_args(args.lever),
              cuda_graphs=not args.no_cuda_graphs)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    prompts = args.prompts
    if args.chat:
        tok = llm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(f"model {args.model!r} has no chat template; drop --chat")
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for prompt, out in zip(args.prompts, llm.generate(prompts, params)):
        if len(args.prompts) > 1:
            print(f"--- {prompt!r}")
        print(prompt + out.outputs[0].text if not args.chat else out.outputs[0].text)
    return 0


def cmd_serve(argv: list[str]) -> int:
    from vtengine import server
    return server.main(argv) or 0


def cmd_bench(args, rest: list[str]) -> int:
    if args.what == "serve":
        from campaigns import loadgen
        return loadgen.main(rest) or 0
    out_dir = args.out
    if args.what == "prefill":
        from vtengine.bench import prefill
        return prefill.main(out_dir, rest) or 0
    if args.what == "w4a16-sass":
        from vtengine.bench import w4a16_sass
        return w4a16_sass.run(out_dir)
    if args.what == "fused-sass":
        from vtengine.bench import fused_sass
        return fused_sass.run(out_dir)
    if args.what == "prefill-attention":
        from vtengine.bench import prefill_attention
        prefill_attention.main(out_dir)
        return 0
    if args.what == "kernels":
        from vtengine.bench import attention, w4a16
        w4a16.main(out_dir)
        attention.main(out_dir)
        return 0
    from vtengine.bench import decode
    return decode.main(out_dir, rest) or 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vtengine", description=__doc__.splitlines()[0],
                                 epilog="--conf-dir DIR (first argument) reads a project's conf/ over the packaged one")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("levers", help="list every lever with its default and resolved value")
    p.add_argument("--lever", action="append", metavar="NAME=VALUE", help="explicit lever value (repeatable)")
    p.add_argument("--quant", choices=QUANTS, default=None,
                   help="resolve for a model of this quantization (a lever file may give it its own default)")

    p = sub.add_parser("generate", help="generate completions offline")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quant", default="bf16")
    p.add_argument("--backend", default=None, choices=["torch", "triton"])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--lever", action="append", metavar="NAME=VALUE")

    sub.add_parser("serve", help="OpenAI-compatible server (vtengine serve --help)", add_help=False)

    p = sub.add_parser("bench",
                       help="benchmarks: kernels | decode | prefill | prefill-attention | w4a16-sass | fused-sass | "
                            "serve")
    p.add_argument("what", choices=["kernels", "decode", "prefill", "prefill-attention", "w4a16-sass", "fused-sass",
                                    "serve"])
    p.add_argument("--out", default="bench/results", help="where kernels/decode/prefill write JSON + markdown")
    return ap


def main(argv: list[str] | None = None) -> int:
    from vtengine.confdirs import ConfDirError, take_conf_dir_flag
    try:
        argv = take_conf_dir_flag(sys.argv[1:] if argv is None else argv)
    except ConfDirError as e:
        print(f"vtengine: error: {e}", file=sys.stderr)
        return 2
    if argv[:1] == ["serve"]:
        handler = lambda: cmd_serve(argv[1:])  # noqa: E731 (serve owns its flags)
    else:
        ap = build_parser()
        args, rest = ap.parse_known_args(argv)
        if rest and not (args.cmd == "bench"):
            ap.error(f"unrecognized arguments: {' '.join(rest)}")
        handler = {"levers": lambda: cmd_levers(args), "generate": lambda: cmd_generate(args),
                   "bench": lambda: cmd_bench(args, rest)}[args.cmd]
    from vtengine.config import ConfigError
    from vtengine.engine.sampling_params import RequestError
    from vtengine.levers import LeverError
    from vtengine.quant import QuantError
    try:
        return handler()
    except (ConfigError, LeverError, RequestError, QuantError, ValueError) as e:
        print(f"vtengine: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
