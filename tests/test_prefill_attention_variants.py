"""The prefill-attention loop-body variants (vtengine/bench/prefill_attention_variants.py, an experiment the GPU
bench times) compute the engine's packed prefill attention: under the Triton interpreter each variant's output
equals the engine kernel's on a ragged two-sequence case with a cached prefix and scattered pages."""
from __future__ import annotations

import pytest

from vtengine.bench import prefill_attention_variants as variants


def test_every_variant_matches_the_engine_kernel():
    diffs = variants.check()
    assert set(diffs) == {n for n, f in variants.VARIANTS.items() if f is not None}
    for name, diff in diffs.items():
        assert diff < 1e-5, f"{name}: max |variant - engine| = {diff}"


def test_the_check_sees_a_wrong_variant(monkeypatch):
    """A variant that drops the softmax scale differs from the engine: the check above can fail."""
    real = variants.variant_attention

    def unscaled(q, k_cache, v_cache, cu, cl, bt, scale, tiles, flags, out=None):
        return real(q, k_cache, v_cache, cu, cl, bt, 1.0, tiles, flags, out)
    monkeypatch.setattr(variants, "variant_attention", unscaled)
    assert min(variants.check().values()) > 1e-3
