"""Installed without -e (a wheel, as from a registry or a git URL) and run from another directory: the packaged
conf/ and templates/ travel with it; a project's own conf/ overrides them; nothing is ever silently empty."""
from __future__ import annotations

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from vtengine import confdirs, levers

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtual environment with the project's wheel installed (--no-deps); the dependencies come from this
    interpreter's site-packages through a .pth file, so nothing is downloaded or reinstalled."""
    tmp = tmp_path_factory.mktemp("pkg")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "dist"), str(ROOT)], check=True, capture_output=True)
    wheel = next((tmp / "dist").glob("vtengine-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pure = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(pure, "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, capture_output=True)
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    return venv, elsewhere


def run(venv: Path, cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", confdirs.ENV)}
    e.update(env or {})
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=cwd, capture_output=True, text=True,
                          env=e, timeout=300)


def test_the_wheel_carries_conf_and_templates_and_runs_from_anywhere(installed):
    venv, elsewhere = installed
    where = run(venv, elsewhere, "python", "-c", "import vtengine, campaigns.records as r; "
                                                  "print(vtengine.__file__); print(r.TEMPLATE_DIR)")
    assert where.returncode == 0, where.stderr
    pkg_file, templates = where.stdout.split()
    assert "site-packages" in pkg_file and str(ROOT) not in pkg_file     # the installed copy, not this checkout
    assert templates.endswith("campaigns/templates") and "site-packages" in templates
    lv = run(venv, elsewhere, "vtengine", "levers")
    assert lv.returncode == 0, lv.stderr
    for name in levers.registry():
        assert name in lv.stdout
    dry = run(venv, elsewhere, "vtcampaign", "run", "campaign=gqa_swap", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# plan: gqa_swap on cpu (non-binding)" in dry.stdout and "model tiny" in dry.stdout
    gen = run(venv, elsewhere, "vtengine", "generate", "--model", "tiny", "--max-tokens", "4", "--backend", "torch",
              "Once")
    assert gen.returncode == 0 and gen.stdout.startswith("Once"), gen.stderr


def test_a_projects_own_conf_overrides_the_packaged_defaults(installed):
    venv, elsewhere = installed
    proj = elsewhere / "proj"
    (proj / "conf" / "lever").mkdir(parents=True)
    text = (confdirs.PACKAGED / "lever" / "gqa_swap.yaml").read_text().replace("default: true", "default: false")
    (proj / "conf" / "lever" / "gqa_swap.yaml").write_text(text)
    # found from the working directory
    here = run(venv, proj, "python", "-c", "from vtengine import levers; lv = levers.get('gqa_swap'); "
                                           "print(lv.default, lv.path)")
    default, path = here.stdout.split()
    assert default == "False" and path == str(proj / "conf" / "lever" / "gqa_swap.yaml")
    # named by --conf-dir from elsewhere (and the other levers still come from the package)
    lv = run(venv, elsewhere, "vtengine", "--conf-dir", str(proj / "conf"), "levers")
    row = next(ln for ln in lv.stdout.splitlines() if "gqa_swap" in ln)
    assert "False" in row and "fast_math" in lv.stdout
    # a conf dir that does not exist is a clear error, not an empty registry
    bad = run(venv, elsewhere, "vtengine", "--conf-dir", str(proj / "nope"), "levers")
    assert bad.returncode == 2 and "is not a directory" in bad.stderr


def test_an_empty_lever_directory_is_an_error_not_an_empty_table(tmp_path):
    with pytest.raises(levers.LeverError, match="no lever files"):
        levers.registry(tmp_path)


def test_a_flip_never_edits_an_installed_packages_lever_file(tmp_path):
    import git

    from campaigns.gitops import GitOpsError, flip_commit
    repo = tmp_path / "proj"
    repo.mkdir()
    r = git.Repo.init(repo)
    (repo / "README.md").write_text("x\n")
    r.index.add(["README.md"])
    r.index.commit("x", author=git.Actor("t", "t@t"), committer=git.Actor("t", "t@t"))
    installed_lever_dir = tmp_path / "site-packages" / "vtengine" / "conf" / "lever"
    installed_lever_dir.mkdir(parents=True)
    (installed_lever_dir / "gqa_swap.yaml").write_text((confdirs.PACKAGED / "lever" / "gqa_swap.yaml").read_text())
    with pytest.raises(GitOpsError, match="read-only default"):
        flip_commit(repo, "gqa_swap", False, [], "flip", lever_dir=installed_lever_dir)
    assert "default: true" in (installed_lever_dir / "gqa_swap.yaml").read_text()
