"""The L2 prefetch micro-bench's report (vtengine/bench/l2_prefetch.py) read back from its committed H200 run: the
GEMV's time after each prefetch is the difference the module defines, for every mode and launch kind."""
from __future__ import annotations

import json
from pathlib import Path

from vtengine.bench import l2_prefetch

RESULT = Path(__file__).resolve().parents[1] / "bench" / "results" / "l2-prefetch-2026-12-04.json"


def test_the_committed_run_renders_its_differences():
    result = json.loads(RESULT.read_text())
    text = l2_prefetch.markdown(result)
    for tag, r in result["rows"].items():
        for mode in ("line", "bulk", "load"):
            row = next(line for line in text.splitlines() if line.startswith(f"| {tag} |") and f"| {mode} |" in line)
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert float(cells[7]) == round(r[mode] - r[f"{mode} only"], 2)
            assert float(cells[8]) == round(r["none"] - r["spin"], 2)
    # the run it records: every mode made the o GEMV faster once its weight was asked for, but no mode paid for
    # its own launch and traffic (prefetch + spin + gemv above spin + gemv in every row)
    for r in result["rows"].values():
        assert all(r[mode] > r["none"] for mode in ("line", "bulk", "load"))


def test_a_missing_mode_is_shown_with_its_error():
    result = json.loads(RESULT.read_text())
    r = dict(result["rows"]["plain"])
    for key in ("bulk", "bulk only"):
        r.pop(key)
    r["bulk error"] = "PTX refused"
    text = l2_prefetch.markdown(dict(result, rows={"plain": r}))
    assert "| plain | | | | bulk | PTX refused |" in text
