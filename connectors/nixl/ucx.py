"""UCX's environment for a NIXL agent, chosen per deployment (`--kv-ucx-transports`)."""

from __future__ import annotations

import ipaddress
import os

ONE_HOST_UCX_TLS = "sm,self,tcp"  # shared memory (cma: one process_vm_readv per run); tcp for wire-up
# On a host with CUDA devices: NIXL's UCX backend refuses to start without a CUDA
# transport there, even for KV in host memory ("NVIDIA GPU(s) are present, but this
# setting does not enable CUDA memory support"); KV in GPU memory moves by CUDA IPC.
ONE_HOST_CUDA_UCX_TLS = ONE_HOST_UCX_TLS + ",cuda_copy,cuda_ipc"
# KV in host memory: NIXL hands UCX the registered memory handle of every transfer, so
# UCX's registration cache, and the malloc and mmap hooks that keep that cache true,
# serve nothing (ai-dynamo/nixl#1762 turns the caches off for the same reason). Installing
# the hooks took 0.4 s of CPU at every agent's creation (0.02 s without) on the CPU
# machine, and the READ speed of `benchmarks/transfer.py` is the same either way.
# KV in GPU memory keeps UCX's defaults: on one H200 (nixl-cu13 1.5.1, P and D on one
# device) a 117 MB read took 1.76 s without them and 0.45 s with them.
NO_MEMORY_HOOKS = {"UCX_MEM_EVENTS": "no", "UCX_RCACHE_ENABLE": "n"}


def configure_ucx(host: str, transports: str = "auto", cuda: bool = False, kv_on_gpu: bool = False) -> None:
    """Set UCX's environment for this process, before the first agent starts UCX.

    - Transports: `transports` is a UCX_TLS list, or "auto". Auto, for a loopback
      `host` (one machine), is ONE_HOST_UCX_TLS: a READ is then one CMA copy per run
      (`benchmarks/transfer.py` measures it against a bare process_vm_readv), and
      ONE_HOST_CUDA_UCX_TLS where the host has CUDA devices (`cuda`); elsewhere
      auto keeps UCX's choice (rc/ud/cuda_ipc where they exist). An operator's own
      UCX_TLS wins over auto, not over an explicit list.
    - Listening: UCX's TCP transport listens on every network interface unless told
      otherwise; for a loopback `host` it stays on loopback (`UCX_NET_DEVICES=lo`, unless
      the operator set it). Other hosts keep UCX's choice: narrowing it there could
      exclude the RDMA devices.
    - No memory hooks nor registration cache (NO_MEMORY_HOOKS) for KV in host memory,
      unless the operator set those variables; UCX's defaults for KV on a GPU
      (`kv_on_gpu`)."""
    if not kv_on_gpu:
        for name, value in NO_MEMORY_HOOKS.items():
            os.environ.setdefault(name, value)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if transports != "auto":
        os.environ["UCX_TLS"] = transports
    elif loopback:
        os.environ.setdefault("UCX_TLS", ONE_HOST_CUDA_UCX_TLS if cuda else ONE_HOST_UCX_TLS)
