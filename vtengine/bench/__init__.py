"""Benchmarks (CUDA): each module has ``main(out_dir, ...)`` that measures, writes JSON + a markdown table with the
device, versions and date under ``out_dir`` (committed under bench/results/), and returns the figures."""
