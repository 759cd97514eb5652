"""Shared test set-up: the Triton interpreter on CPU hosts (before any test module imports triton), and the
`gpu` marker skipping with its reason where CUDA is unavailable."""
import vtengine  # noqa: F401  (selects TRITON_INTERPRET=1 without CUDA)

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (this host has none); run `pytest -m gpu` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # tiny CPU models: one thread is several times faster than two on a 2-core host where other work competes
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
