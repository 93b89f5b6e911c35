import os
import sys

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, stateful_step_count=30, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=1000, stateful_step_count=80, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# The tests move tiny tensors: torch's intra-op threads only add synchronization (and, on a loaded 2-core
# machine, ~10x slower indexing).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _device_survives(request):
    """After a GPU test, a sticky CUDA error (a fault in a kernel) would fail every later test of this process
    with the same message. Under pytest-xdist the worker leaves instead, so the test is reported as the one that
    crashed and a fresh worker (a fresh CUDA context) runs the rest."""
    yield
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:  # torch.AcceleratorError, or RuntimeError on older torch
        if os.environ.get("PYTEST_XDIST_WORKER"):
            sys.stderr.write(f"{request.node.nodeid} left the CUDA context broken: {e}\n")
            os._exit(3)
        raise
