"""PD on one GPU: how fast D reads P's KV (device memory, NIXL, UCX) under UCX settings
given as environments: `bench compare`'s `pd` deployment per setting, 8 prompts of 1024
tokens, D's transfer metrics. Usage: kv_reads.py MODEL_DIR"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from benchmarks.deployments import deploy, scrape
from launch import pd_command

SETTINGS = {  # name -> environment added to P's and D's
    "ours": {},
    "no CUDA IPC get": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"},  # as before: UCX's choice without NVLink
    "ours, no emulated protocols": {"UCX_PROTO_EMULATION_ENABLE": "n"},  # fails where no direct path exists
}
ARGS = argparse.Namespace(model=sys.argv[1], dtype="bfloat16", prefill_kv_cache_memory=None, proxy_args="",
                          server_args="--device cuda --kv-cache-memory 4000000000 --num-threads 4")


def measure(name: str, env: dict[str, str], workdir: Path) -> None:
    try:
        with mock.patch.dict(os.environ, env), deploy("pd", ARGS, workdir) as pd:  # the servers inherit `env`
            t = time.time()
            run = subprocess.run(pd_command("bench", "serve", "--base-url", pd.base_url, "--num-prompts", "8",
                                            "--max-concurrency", "2", "--random-input-len", "1024",
                                            "--random-output-len", "8", "--ignore-eos", "--vocab-size", "4000"),
                                 capture_output=True, text=True, timeout=120)
            (decode,) = scrape(pd.decode_urls)
        reads, seconds = (decode[f"pd_kv_transfer_xfer_time_seconds_{s}"][()] for s in ("count", "sum"))
        moved = sum(decode["pd_kv_transfer_bytes_total"].values())
        ttft = next((line.split()[-1] for line in run.stdout.splitlines() if "Mean TTFT (ms)" in line), "-")
        print(f"{name}: {reads:.0f} reads, {seconds / max(reads, 1) * 1e3:.1f} ms a read, "
              f"{moved / max(seconds, 1e-9) / 1e9:.2f} GB/s, mean TTFT {ttft} ms ({time.time() - t:.0f} s)", flush=True)
    except Exception as exc:  # a setting UCX refuses: say so, go on with the next
        print(f"{name}: failed: {str(exc)[-600:]}", flush=True)


with tempfile.TemporaryDirectory(prefix="kv-reads-") as logs:
    for setting, environment in SETTINGS.items():
        measure(setting, environment, Path(logs))
