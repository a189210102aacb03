"""Test setup: Triton kernels on CPU tensors run in the interpreter; a private cache per test session.

Tests run on the CPU (interpreter) everywhere, and additionally on CUDA where a GPU is present
(the `device` fixture); GPU-only tests are marked `gpu` and skip on CPU-only machines.
"""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FXOPT_CACHE_DIR", tempfile.mkdtemp(prefix="fxopt-test-cache-"))

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

# Property tests draw the same examples on every run, so CI cannot turn red by luck;
# HYPOTHESIS_PROFILE=explore draws fresh ones when hunting bugs.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (dynamo's cache would otherwise hide recompiles)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
