"""Keep in ``.whl`` only the wheels a device call imports, so the carried tree stays under the lender's 64 MiB.

``gpu-wheelhouse.sh`` also downloads MLflow and its closure (SQLAlchemy, cryptography, the Databricks SDK,
OpenTelemetry: about 17 MB), but a device call runs its campaigns with ``tracking=off`` and the evidence is logged to
MLflow back here (``vtcampaign log``), so those wheels only cost carry room: with records/ at 48 MB on 2026-12-07 the
checkout and the full wheelhouse came to 69 MB and the lender refused the call. This keeps the dependency closure
of the packages a device step imports (read from each wheel's ``Requires-Dist``, markers evaluated for CPython 3.12
on Linux, extras not followed) and deletes the rest. Not pip's resolver (`pip install --dry-run --report`): the
wheels' requirements that the GPU image provides (anyio, numpy, torch, ...) have no wheel here, so it refuses the
set; a closure walk over what is here, with `packaging` reading the requirements, is all this needs::

    python scripts/prune_wheels.py            # prune .whl in place, print what went and the MB freed
    python scripts/prune_wheels.py --dry-run  # print only
"""
from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# What a device step imports beyond the GPU image: Hydra for the config, git for the fingerprint, the OpenAI server
# (FastAPI, uvicorn), GGUF loading, and the submitit launcher for the scale-out configs.
DEVICE_ROOTS = ("hydra-core", "omegaconf", "antlr4-python3-runtime", "gitpython", "fastapi", "uvicorn", "gguf",
                "submitit", "hydra-submitit-launcher")

ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
       "implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix"}


def wheel_requires(path: Path) -> tuple[str, list[str]]:
    """(the wheel's canonical name, the canonical names it requires on the device's Python, extras not followed)."""
    with zipfile.ZipFile(path) as zf:
        # the wheel's own .dist-info sits at its top level; vendored packages carry theirs deeper
        meta_name = next((n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")), None)
        if meta_name is None:
            raise ValueError(f"{path.name}: no top-level .dist-info/METADATA in the wheel")
        meta = Parser().parsestr(zf.read(meta_name).decode("utf-8", "replace"))
    if not meta["Name"]:
        raise ValueError(f"{path.name}: its METADATA has no Name")
    needs = []
    for spec in meta.get_all("Requires-Dist") or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({**ENV, "extra": ""}):
            needs.append(canonicalize_name(req.name))
    return canonicalize_name(meta["Name"]), needs


def closure(wheels: dict[str, list[str]], roots: tuple[str, ...]) -> set[str]:
    """The names reachable from ``roots``; names without a wheel here are in the GPU image (torch, numpy, ...)."""
    keep, todo = set(), [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in keep or name not in wheels:
            continue
        keep.add(name)
        todo.extend(wheels[name])
    return keep


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheelhouse", nargs="?", default=".whl", help="the folder gpu-wheelhouse.sh built (default .whl)")
    ap.add_argument("--dry-run", action="store_true", help="print what would go, delete nothing")
    args = ap.parse_args(argv)
    house = Path(args.wheelhouse)
    files = sorted(house.glob("*.whl"))
    if not files:
        print(f"{house}: no wheels here; build them with ../shared/tools/gpu-wheelhouse.sh", file=sys.stderr)
        return 2
    by_name: dict[str, tuple[list[Path], list[str]]] = {}     # two wheels of one name: both kept or both dropped
    for f in files:
        name, needs = wheel_requires(f)
        got = by_name.setdefault(name, ([], []))
        got[0].append(f)
        got[1].extend(needs)
    missing = [r for r in DEVICE_ROOTS if canonicalize_name(r) not in by_name]
    if missing:
        print(f"{house} lacks wheels the device needs: {', '.join(missing)}; rebuild it with gpu-wheelhouse.sh",
              file=sys.stderr)
        return 2
    keep = closure({n: needs for n, (_, needs) in by_name.items()}, DEVICE_ROOTS)
    drop = sorted((f for n, (fs, _) in by_name.items() if n not in keep for f in fs), key=lambda f: f.name)
    freed = sum(f.stat().st_size for f in drop)
    for f in drop:
        print(f"{'would drop' if args.dry_run else 'dropped'} {f.name}")
        if not args.dry_run:
            f.unlink()
    kept = sum(f.stat().st_size for f in files if f not in drop)
    print(f"{len(drop)} wheel(s), {freed / 1e6:.1f} MB {'to free' if args.dry_run else 'freed'}; "
          f"{len(files) - len(drop)} kept, {kept / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
