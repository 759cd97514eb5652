"""The argmax bench (vtengine/bench/argmax.py): its report's derived columns from a result, an error shown in place
of a time, and on a GPU a run whose every form returned torch's ids."""
from __future__ import annotations

import pytest
import torch

from vtengine.bench import argmax as bench

ENV = dict(device="NVIDIA H200", date="2026-12-06", torch="2.11.0", triton="3.6.0", cuda="13.0", sms=132)


def _result(rows):
    return dict(env=ENV, vocab=151936, calls=20, reps=30, copy_gbs=4000.0, rows=rows)


def test_the_report_derives_speed_ups_and_the_floor_from_the_times():
    row = dict(batch=1, splits=75, floor_us=0.15, **{"split": 2.5, "one program a row": 19.0, "torch.argmax": 7.5})
    line = next(x for x in bench.markdown(_result([row])).splitlines() if x.startswith("| 1 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == ["1", "75", "2.50", "19.00", "7.50", "x7.60", "x3.00", "0.15", "6%"], cells


def test_a_form_whose_ids_differ_shows_its_error_and_no_ratio():
    row = dict(batch=8, splits=15, floor_us=1.2, **{"split error": "ids differ from torch.argmax in 1 of 8 rows",
                                                   "one program a row": 20.0, "torch.argmax": 9.0})
    line = next(x for x in bench.markdown(_result([row])).splitlines() if x.startswith("| 8 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "ids differ from torch.argmax in 1 of 8 rows" and cells[5:7] == ["", ""] and cells[8] == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the bench times CUDA graphs)")
def test_gpu_every_form_returns_torchs_ids(tmp_path):
    result = bench.main(str(tmp_path), batches=(1, 8, 200))
    for row in result["rows"]:
        assert not [k for k in row if k.endswith("error")], row
        assert all(row[f] > 0 for f in bench.FORMS), row
    assert [r["splits"] for r in result["rows"]][-1] == 1
    assert (tmp_path / f"argmax-{result['env']['date']}.md").exists()
