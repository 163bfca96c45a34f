"""Shared test setup: the kernel cache the tests build into, the `gpu` marker's skip with
its reason, and a per-test random generator."""

import os
import zlib
from pathlib import Path

import numpy as np
import pytest

# The tests build hundreds of cubins (the NVRTC build check alone ~920, about 116 MB);
# they go into the checkout's own pytest cache, not the user's kernel cache in $HOME.
# The directory persists, so a second run (or CI's next step) loads them at once.
# Set CUPYFLASH_CACHE_DIR to choose another place, e.g. the cache the library uses.
TEST_CACHE = Path(__file__).resolve().parent.parent / ".pytest_cache" / "cupyflash-kernels"


def pytest_configure(config):
    os.environ.setdefault("CUPYFLASH_CACHE_DIR", str(TEST_CACHE))


def gpu_skip_reason():
    """Why the GPU tests cannot run here (cupy, NVRTC, driver or device), or None."""
    from cupyflash._gpu_status import why_not_usable
    reason = why_not_usable()
    return None if reason is None else f"no GPU tests: {reason}"


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    # Probing imports cupy, which a CPU-only selection should not pay for.
    if not gpu_items:
        return
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's id: reproducible, and independent of test order."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
