"""PD on one GPU: how fast D reads P's KV (device memory, NIXL, UCX) under UCX settings
given as environments: a P/D pair and a proxy per setting, 8 prompts of 1024 tokens, D's
transfer metrics. Usage: kv_reads.py MODEL_DIR"""

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

import launch
from launch import free_port, pd_command, stop_process

SETTINGS = {  # name -> environment added to P's and D's
    "ours": {},
    "no CUDA IPC get": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"},  # as before: UCX's choice without NVLink
    "ours, no emulated protocols": {"UCX_PROTO_EMULATION_ENABLE": "n"},  # fails where no direct path exists
}
SERVER = ["--model", sys.argv[1], "--dtype", "bfloat16", "--device", "cuda", "--kv-cache-memory", "4000000000",
          "--host", "127.0.0.1", "--num-threads", "4"]


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def measure(name: str, env: dict[str, str]) -> None:
    procs = []

    def start(role: str, *args: str, command: str = "serve", shared: list[str] = SERVER) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(f"/tmp/kv-reads-{len(procs)}-{role}.log")
        procs.append(launch.start(pd_command(command, *shared, "--port", str(port), *args), url, log,
                                  env=dict(os.environ, **env)).process)
        return url

    try:
        p, d = start("prefill", "--role", "prefill"), start("decode", "--role", "decode")
        proxy = start("proxy", "--prefill", p, "--decode", d, command="proxy", shared=["--host", "127.0.0.1"])
        t = time.time()
        run = subprocess.run(pd_command("bench", "serve", "--base-url", proxy, "--num-prompts", "8",
                                        "--max-concurrency", "2", "--random-input-len", "1024",
                                        "--random-output-len", "8", "--ignore-eos", "--vocab-size", "4000"),
                             capture_output=True, text=True, timeout=120)
        reads, seconds = (metric(d, f"pd_kv_transfer_xfer_time_seconds_{s}") for s in ("count", "sum"))
        moved = metric(d, "pd_kv_transfer_bytes_total")
        ttft = next((line.split()[-1] for line in run.stdout.splitlines() if "Mean TTFT (ms)" in line), "-")
        print(f"{name}: {reads:.0f} reads, {seconds / max(reads, 1) * 1e3:.1f} ms a read, "
              f"{moved / max(seconds, 1e-9) / 1e9:.2f} GB/s, mean TTFT {ttft} ms ({time.time() - t:.0f} s)", flush=True)
    except Exception as exc:  # a setting UCX refuses: say so, go on with the next
        print(f"{name}: failed: {str(exc)[-600:]}", flush=True)
    finally:
        for process in procs:
            stop_process(process)


launch.deployment_secret()
for name, env in SETTINGS.items():
    measure(name, env)
