"""scripts/prune_wheels.py: the wheelhouse keeps the device roots' dependency closure and drops the rest."""
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("prune_wheels", ROOT / "scripts" / "prune_wheels.py")
prune_wheels = importlib.util.module_from_spec(spec)
sys.modules["prune_wheels"] = prune_wheels
spec.loader.exec_module(prune_wheels)


def _wheel(house: Path, name: str, *requires: str) -> Path:
    path = house / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", "Version: 1.0"] + [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", "\n".join(meta) + "\n")
    return path


def _roots(house: Path) -> None:
    for r in prune_wheels.DEVICE_ROOTS:
        if r == "fastapi":
            _wheel(house, r, "starlette>=0.40", "pydantic", "python-multipart; extra == 'standard'")
        elif r == "gitpython":
            _wheel(house, r, "gitdb<5", "typing-extensions; python_version < '3.8'")
        else:
            _wheel(house, r)


def test_the_closure_stays_and_mlflow_with_its_own_dependencies_goes(tmp_path):
    _roots(tmp_path)
    _wheel(tmp_path, "starlette", "anyio")                # anyio: in the GPU image, no wheel here
    _wheel(tmp_path, "pydantic", "pydantic-core==2.1")
    _wheel(tmp_path, "pydantic_core")                      # spelled apart from its requirement: canonical names match
    _wheel(tmp_path, "gitdb", "smmap; python_version >= '3.8'")     # a marker true on the device: followed
    _wheel(tmp_path, "smmap")
    _wheel(tmp_path, "python-multipart")                   # only an extra of fastapi asks for it
    _wheel(tmp_path, "typing-extensions")                  # only for Pythons the device does not run
    _wheel(tmp_path, "mlflow-skinny", "sqlalchemy", "databricks-sdk")
    _wheel(tmp_path, "sqlalchemy", "greenlet; platform_machine == 'x86_64'")
    _wheel(tmp_path, "greenlet")
    _wheel(tmp_path, "databricks-sdk")
    assert prune_wheels.main([str(tmp_path)]) == 0
    left = {p.name.split("-")[0] for p in tmp_path.glob("*.whl")}
    expect = {r.replace("-", "_") for r in prune_wheels.DEVICE_ROOTS} | {"starlette", "pydantic", "pydantic_core",
                                                                         "gitdb", "smmap"}
    assert left == expect


def test_dry_run_deletes_nothing(tmp_path, capsys):
    _roots(tmp_path)
    extra = _wheel(tmp_path, "mlflow-skinny")
    assert prune_wheels.main([str(tmp_path), "--dry-run"]) == 0
    assert extra.exists()
    assert "would drop mlflow_skinny-1.0-py3-none-any.whl" in capsys.readouterr().out


@pytest.mark.parametrize("present", [[], ["hydra-core"]])
def test_a_wheelhouse_without_a_device_root_is_refused_and_left_whole(tmp_path, capsys, present):
    for name in present:
        _wheel(tmp_path, name)
    before = sorted(tmp_path.iterdir())
    assert prune_wheels.main([str(tmp_path)]) == 2
    assert sorted(tmp_path.iterdir()) == before
    err = capsys.readouterr().err
    assert ("no wheels here" in err) if not present else ("lacks wheels the device needs: omegaconf" in err)


def test_the_wheels_own_metadata_is_read_not_a_vendored_packages(tmp_path):
    path = tmp_path / "tool-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("tool/_vendor/jaraco.text-3.12.dist-info/METADATA", "Metadata-Version: 2.1\nName: jaraco.text\n")
        zf.writestr("tool-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tool\nRequires-Dist: smmap\n")
    assert prune_wheels.wheel_requires(path) == ("tool", ["smmap"])
