"""scripts/h200_session.sh: a malformed step is refused before the device call spends its minutes."""
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("step, message", [
    ("SEC@campaign:pdl_stack:model.quant=bf16", "'SEC' before @ is not a number of seconds"),
    ("400@campain:gqa_swap", "unknown kind; accepted: campaign:"),
])
def test_a_bad_step_is_refused_before_anything_runs(tmp_path, step, message):
    """A literal 'SEC@' once cost a device call (both steps 'took 0 s' after the install): the script checks every
    step first, names the bad one, and exits 2 without installing, committing or running anything."""
    r = subprocess.run(["bash", str(ROOT / "scripts" / "h200_session.sh"), "300@decode:--rounds 1", step],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stdout and f"step '{step}'" in r.stdout
    assert list(tmp_path.iterdir()) == []               # no repository made, no results written
