"""Tests marked `gpu` run where torch finds a CUDA GPU and are skipped only where it finds none (CI has none;
`scripts/gpu_check.sh` runs them on a GPU machine)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
