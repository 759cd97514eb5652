"""The mutation audit's list stays applicable: every planted fault's text is still in its file exactly once (a
refactor that moves the code makes this fail, so the audit is updated with it rather than silently skipped)."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("mutation_audit", ROOT / "scripts" / "mutation_audit.py")
audit = importlib.util.module_from_spec(spec)
sys.modules["mutation_audit"] = audit          # dataclasses look their module up there
spec.loader.exec_module(audit)


@pytest.mark.parametrize("m", audit.MUTATIONS, ids=lambda m: m.name)
def test_every_mutation_still_applies(m):
    for path, old, _new in [(m.path, m.old, m.new)] + m.extra:
        assert (ROOT / path).read_text().count(old) == 1, f"{m.name}: its text is gone from {path}"
    for t in m.tests:
        assert (ROOT / t.split("::")[0]).is_file(), t
