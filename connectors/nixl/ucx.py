"""UCX's environment for a NIXL agent, chosen per deployment (`--kv-ucx-transports`)."""

from __future__ import annotations

import ipaddress
import os

from launch.interfaces import interface_of, rdma_ports

ONE_HOST_UCX_TLS = "sm,self,tcp"  # shared memory (cma: one process_vm_readv per run); tcp for wire-up
# On a host with CUDA devices: NIXL's UCX backend refuses to start without a CUDA
# transport there, even for KV in host memory ("NVIDIA GPU(s) are present, but this
# setting does not enable CUDA memory support"); KV in GPU memory moves by CUDA IPC.
ONE_HOST_CUDA_UCX_TLS = ONE_HOST_UCX_TLS + ",cuda_copy,cuda_ipc"
# Between hosts: every transport but shared memory (UCX's `sm` alias: posix, sysv, cma,
# knem, xpmem). UCX would otherwise pick CMA or shared memory for a peer it finds on the
# same machine (separate network namespaces, or two servers of one node addressed by its
# network address), so that what is tested as "across hosts" would not cross a network;
# TCP, RDMA (rc, ud, dc) and the CUDA transports stay.
BETWEEN_HOSTS_UCX_TLS = "^sm"
# Between hosts over TCP: UCX's TCP transport moves an emulated GET (NIXL's READ) in
# segments of UCX_TCP_{TX,RX}_SEG_SIZE, 8 KiB by default. On two network namespaces of
# this machine (`python -m benchmarks.transfer_hosts`, reads of 32 MiB) READs reached
# 0.46-0.51x a plain TCP stream between the same hosts with 8 KiB, 0.85-1.04x with
# 256 KiB and 0.95-1.19x with 1 MiB, at blocks of 64 KiB-4 MiB; the reader's peak memory
# was the same (479 MiB either way). RDMA transports do not read these.
BETWEEN_HOSTS_TCP = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}
# KV in host memory: NIXL hands UCX the registered memory handle of every transfer, so
# UCX's registration cache, and the malloc and mmap hooks that keep that cache true,
# serve nothing (ai-dynamo/nixl#1762 turns the caches off for the same reason). Installing
# the hooks took 0.4 s of CPU at every agent's creation (0.02 s without) on the CPU
# machine, and the READ speed of `benchmarks/transfer.py` is the same either way.
# KV in GPU memory keeps UCX's defaults: on one H200 (nixl-cu13 1.5.1, P and D on one
# device) a 117 MB read took 1.76 s without them and 0.45 s with them.
NO_MEMORY_HOOKS = {"UCX_MEM_EVENTS": "no", "UCX_RCACHE_ENABLE": "n"}
# KV in GPU memory: D READs P's blocks, and UCX's cuda_ipc turns its GET off where it
# finds no NVLink ("cuda-ipc get zcopy disabled as no nvlinks detected", UCX's
# cuda_ipc_iface.c), so a read between two GPUs over PCIe, or two processes on one GPU,
# went through host memory and TCP (~260 MB/s on the H200 above; vllm#52607 saw the
# same; ai-dynamo/nixl#2208 turns it on in later NIXL). Not yet measured here.
CUDA_IPC_GET = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}


def configure_ucx(host: str, transports: str = "auto", cuda: bool = False, kv_on_gpu: bool = False) -> None:
    """Set UCX's environment for this process, before the first agent starts UCX.

    - Transports: `transports` is a UCX_TLS list, or "auto". Auto, for a loopback
      `host` (one machine), is ONE_HOST_UCX_TLS: a READ is then one CMA copy per run
      (`benchmarks/transfer.py` measures it against a bare process_vm_readv), and
      ONE_HOST_CUDA_UCX_TLS where the host has CUDA devices (`cuda`); for any other
      `host`, BETWEEN_HOSTS_UCX_TLS (UCX's choice less shared memory: TCP, and RDMA and
      CUDA IPC where they exist). An operator's own UCX_TLS wins over auto, not over an
      explicit list.
    - Listening: UCX's TCP transport listens on every network interface unless told
      otherwise (loopback included); for a loopback `host` it stays on loopback
      (`UCX_NET_DEVICES=lo`, unless the operator set it), for any other on the
      interface that holds `host` and the machine's RDMA ports (`network_devices`: no
      TCP listener on another address, no RDMA device left out); where no interface
      holds `host`, UCX's choice. Other hosts get TCP segments of 1 MiB
      (BETWEEN_HOSTS_TCP), unless the operator set them.
    - No memory hooks nor registration cache (NO_MEMORY_HOOKS) for KV in host memory;
      for KV on a GPU (`kv_on_gpu`) UCX's defaults, and CUDA IPC reads on with or
      without NVLink (CUDA_IPC_GET). An operator's own values of these win."""
    for name, value in (CUDA_IPC_GET if kv_on_gpu else NO_MEMORY_HOOKS).items():
        os.environ.setdefault(name, value)
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    else:
        devices = network_devices(host)
        if devices is not None:
            os.environ.setdefault("UCX_NET_DEVICES", devices)
        for name, value in BETWEEN_HOSTS_TCP.items():
            os.environ.setdefault(name, value)
    if transports != "auto":
        os.environ["UCX_TLS"] = transports
    elif loopback:
        os.environ.setdefault("UCX_TLS", ONE_HOST_CUDA_UCX_TLS if cuda else ONE_HOST_UCX_TLS)
    else:
        os.environ.setdefault("UCX_TLS", BETWEEN_HOSTS_UCX_TLS)


def network_devices(host: str) -> str | None:
    """UCX_NET_DEVICES for KV on `host`: the interface that holds it, and every RDMA port
    (UCX's rc, ud and dc run over those; they listen on no TCP port); None where no
    interface holds `host` (a wildcard, a name)."""
    interface = interface_of(host)
    return None if interface is None else ",".join([interface, *rdma_ports()])


def path() -> str:
    """What KV crosses between this server and its peers, as UCX is configured: "cma"
    (one host: shared memory, one process_vm_readv copy per run), "rdma" (between hosts,
    where this host has RDMA ports: UCX prefers them), "tcp" (between hosts, none), or
    "ucx" (an operator's own transports: UCX's choice)."""
    tls = os.environ.get("UCX_TLS")
    if tls in (ONE_HOST_UCX_TLS, ONE_HOST_CUDA_UCX_TLS):
        return "cma"
    if tls == BETWEEN_HOSTS_UCX_TLS:
        return "rdma" if rdma_ports() else "tcp"
    return "ucx"


def describe() -> str:
    """The UCX transports and devices this process's agents may use, as configured."""
    tls = os.environ.get("UCX_TLS", "UCX's choice")
    meaning = {ONE_HOST_UCX_TLS: " (one host: shared memory, one CMA copy a run)",
               ONE_HOST_CUDA_UCX_TLS: " (one host: shared memory and CUDA IPC)",
               BETWEEN_HOSTS_UCX_TLS: " (between hosts: every transport but shared memory; TCP here, RDMA where "
                                      "present)"}.get(tls, "")
    segments = os.environ.get("UCX_TCP_TX_SEG_SIZE")
    return (f"UCX transports {tls}{meaning}, devices {os.environ.get('UCX_NET_DEVICES', 'all')}"
            + (f", TCP segments {segments}" if segments else ""))
