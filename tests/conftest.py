"""Shared test setup: the `gpu` marker's skip and a per-test random generator."""

import zlib

import numpy as np
import pytest

_NO_GPU = "no CUDA GPU (cupy not installed or no device)"


def _gpu_available():
    try:
        from cupyflash import _cuda
    except ImportError:
        return False
    return _cuda.gpu_available()


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    # Probing imports cupy, which a CPU-only selection should not pay for.
    if not gpu_items or _gpu_available():
        return
    skip = pytest.mark.skip(reason=_NO_GPU)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: reproducible, and independent of test order."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
