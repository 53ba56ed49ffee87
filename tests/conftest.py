"""Settings for the whole suite."""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    """Under pytest-xdist the workers share the machine's cores: each computes on one torch
    thread, and so do the processes it starts (OMP_NUM_THREADS; servers also get
    --num-threads 1). Two threads per worker on two cores spin on each other's barriers
    whenever the other worker or a server runs: the cached-prefix Gemma test took 62 s
    that way instead of 11 s."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
