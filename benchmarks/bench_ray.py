"""The benchmarks' Ray driver start (imported by the scripts beside it, as they import each other)."""

from __future__ import annotations

import os
from typing import Any


def init_ray(num_cpus: int, **kwargs: Any) -> None:
    """Join the cluster RAY_ADDRESS names (a node started apart with `ray start --head`, as gpu_session.sh and
    gpu_jobs.sh do, one per job: it has its own CPUs, and Ray refuses resource counts for a cluster it did not
    start), or start a local one of `num_cpus` logical CPUs. `kwargs` go to `ray.init` (a runtime_env)."""
    import ray

    if os.environ.get("RAY_ADDRESS", "local") != "local":
        ray.init(log_to_driver=False, **kwargs)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, **kwargs)
