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


def test_the_sweep_table_names_the_smallest_target_within_2_percent_of_the_fastest():
    per_sm = {"1": dict(splits=2, us=29.7), "2": dict(splits=4, us=16.0), "4": dict(splits=8, us=10.1),
              "8": dict(splits=16, us=10.0)}
    row = dict(batch=64, splits=2, floor_us=9.2, per_sm=per_sm, **{"split": 29.7, "one program a row": 29.5,
                                                                  "torch.argmax": 22.2})
    lines = bench.markdown(_result([row])).splitlines()
    assert any(x.startswith("| 64 | 2 | 29.70 |") for x in lines)          # the main table is unchanged
    sweep = [x for x in lines if x.startswith("| 64 | 2, ")]
    assert len(sweep) == 1, lines
    cells = [c.strip() for c in sweep[0].strip("|").split("|")]
    # K = 8 is fastest, K = 4 within 2% of it: the smaller target wins; 29.7 / 10.1
    assert cells == ["64", "2, 29.70", "4, 16.00", "8, 10.10", "16, 10.00", "4", "x2.94"], cells
    del per_sm["4"]
    row["x4 error"] = "ids differ from torch.argmax in 3 of 64 rows"
    sweep = next(x for x in bench.markdown(_result([row])).splitlines() if x.startswith("| 64 | 2, "))
    cells = [c.strip() for c in sweep.strip("|").split("|")]
    assert cells[3] == "ids differ from torch.argmax in 3 of 64 rows" and cells[-2:] == ["8", "x2.97"], cells


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the bench times CUDA graphs)")
def test_gpu_every_form_returns_torchs_ids(tmp_path):
    result = bench.main(str(tmp_path), batches=(1, 8, 200))
    for row in result["rows"]:
        assert not [k for k in row if k.endswith("error")], row
        assert all(row[f] > 0 for f in bench.FORMS), row
        assert sorted(int(k) for k in row["per_sm"]) == list(bench.PER_SM), row
        assert all(v["us"] > 0 and v["splits"] >= 1 for v in row["per_sm"].values()), row
        assert row["per_sm"]["1"]["splits"] == row["splits"]
    assert [r["splits"] for r in result["rows"]][-1] == 1
    assert (tmp_path / f"argmax-{result['env']['date']}.md").exists()
