import os

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
