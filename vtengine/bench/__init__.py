"""Benchmarks (CUDA): ``decode/`` (the engine end to end), ``attention.py`` and ``w4a16.py`` (kernels) measure and
write JSON + a markdown table with the device, versions and date under an output directory (committed under
bench/results/); ``batch_invariance.py`` checks outputs across schedules. ``common.py`` holds what they share: the
one copy-bandwidth measurement every "% of floor" / "% of copy" figure divides by."""
