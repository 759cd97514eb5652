"""vtengine/bench/w4a16_bound.py: its read kernel reads every byte the dense W4A16 GEMM's programs read (checked
against a torch fold, in the interpreter on CPU), and its report derives the costs from the rows it measured."""
from __future__ import annotations

import pytest
import torch

from vtengine.bench import w4a16_bound as wb


@pytest.mark.parametrize("block_n, block_k, split", [(32, 128, 1), (32, 128, 2), (16, 256, 2)])
def test_the_read_kernel_folds_every_word_and_scale_of_its_grid(block_n, block_k, split):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(7)
    n, k = 48, 1024                                         # 48 rows: the last row tile is partial
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = torch.randint(0, 256, (n, k // wb.SCALE_BLOCK), generator=gen, dtype=torch.int64).to(torch.uint8)
    words, scales = words.to(dev), scales.to(dev)
    out = torch.full((split, n), -1, dtype=torch.int32, device=dev)        # poisoned
    got = wb.read_fold(words, scales, block_n, block_k, split, num_warps=2, out=out).cpu()
    want = wb.reference_fold(words, scales, split)
    assert torch.equal(got, want)
    flipped = words.clone()
    flipped[n - 1, k // 8 - 1] ^= 1 << 13                  # one bit of the last word the last program reads
    assert not torch.equal(wb.read_fold(flipped, scales, block_n, block_k, split, num_warps=2).cpu(), want)
    with pytest.raises(ValueError, match=r"K=1024 is not a whole number of BLOCK_K=384 steps per split=1"):
        wb.read_fold(words, scales, 32, 384, 1)


def test_the_report_derives_each_cost_from_the_measured_rows():
    gemm_cfg = dict(BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, num_warps=2, num_stages=3)
    on_gemm_grid = wb.read_configs(6144, 4096, gemm_cfg, 132)[0]     # named as bench_shape names its row
    rows = [dict(method="gemm", us=9.3), dict(method="gemm_split1", us=12.0),
            dict(method=wb.read_method(on_gemm_grid), us=6.0),
            dict(method="read_wide", us=5.0, config=dict(BLOCK_N=64, BLOCK_K=512, SPLIT_K=2, num_warps=4,
                                                         num_stages=4)),
            dict(method="read_wide", us=4.5, config=dict(BLOCK_N=128, BLOCK_K=256, SPLIT_K=1, num_warps=4,
                                                         num_stages=3)),
            dict(method="empty_grid", us=2.1),
            dict(method="gemm_wide", us=8.4, config=dict(gemm_cfg, BLOCK_N=64, num_warps=4, SPLIT_K=2)),
            dict(method="gemm_wide", us=8.0, config=dict(gemm_cfg, BLOCK_N=64, num_warps=8, SPLIT_K=4))]
    shp = dict(name="qkv_proj", bytes=13_381_632, rows=rows, errors=["read {...}: its fold differs"],
               gemm_config=gemm_cfg)
    assert wb.summary(shp) == dict(gemm=9.3, gemm_split1=12.0, gemm_wide=8.0, read_grid=6.0, read_best=4.5,
                                   empty_grid=2.1)
    env = dict(device="H200", date="2026-12-04", torch="2.11", triton="3.6", l2_mb=60, sms=132)
    md = wb.markdown(dict(env=env, copy_gbs=4200.0, copy_bw_method="D2D", shapes=[shp]))
    floor = 13_381_632 / 4200e3
    assert (f"| qkv_proj | 13.4 | {floor:.1f} µs | 9.3 µs ({100 * floor / 9.3:.0f}%) | 12.0 µs "
            f"({100 * floor / 12.0:.0f}%) | 8.0 µs ({100 * floor / 8.0:.0f}%) | 6.0 µs ({100 * floor / 6.0:.0f}%) | 4.5 µs ({100 * floor / 4.5:.0f}%) | "
            "2.1 µs | +3.3 µs | +1.5 µs |") in md
    assert "best read BLOCK_N=128 BLOCK_K=256 split=1" in md and "error: read {...}: its fold differs" in md
    assert "best wider GEMM tiles BLOCK_N=64 BLOCK_K=256 split=4 warps=8 stages=3" in md


@pytest.mark.parametrize("k, n", [(4096, 6144), (4096, 24576), (12288, 4096)])
def test_wider_tiles_change_only_the_program_shape_and_keep_one_to_four_programs_per_sm(k, n):
    gemm_cfg = dict(BLOCK_M=8, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, SWAP_AB=True, num_warps=2, num_stages=3,
                    TILES="decode")
    configs = wb.wide_configs(n, k, gemm_cfg, 132)
    assert configs, "no wider tiles at all"
    for c in configs:
        programs = -(-n // c["BLOCK_N"]) * c["SPLIT_K"]
        assert 132 <= programs <= 4 * 132 and (k // 256) % c["SPLIT_K"] == 0, c
        assert {key for key in c if c[key] != gemm_cfg[key]} <= {"BLOCK_N", "num_warps", "num_stages", "SPLIT_K"}
        assert (c["BLOCK_N"], c["num_warps"]) in {(64, 4), (64, 8), (128, 8)}
    assert len({tuple(sorted(c.items())) for c in configs}) == len(configs)


@pytest.mark.gpu
def test_every_figure_of_a_shape_is_measured_on_the_gpu():
    """The whole protocol at one small shape: the GEMM with and without split-K (its one-time setup outside the
    graph capture), the reads, the empty grid, all timed and none in errors."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    shp = wb.bench_shape(4096, 4096, 4000.0, props.L2_cache_size, props.multi_processor_count, gen)
    assert shp["errors"] == []
    assert all(v is not None and v > 0 for v in wb.summary(shp).values()), wb.summary(shp)
