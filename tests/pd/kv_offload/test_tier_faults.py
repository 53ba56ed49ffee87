"""The disk tier in a real `pd serve` when its disk misbehaves: full, made read-only,
its file deleted, truncated or corrupted underneath. Each time the same process goes on
answering what a server without a tier answers, with its KV back to 0; a tier that can
no longer be trusted turns itself off (pd_kv_offload_on 0, a warning in the log). And a
server restarted on its directory loads what the last one left there.

Disk full and read-only need a file system of their own: the server runs in a user and
mount namespace (`unshare`) on a small tmpfs, and the test acts on it with `nsenter`."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch import free_port, pd_command, running
from tests.support.pd_client import complete
from tests.support.server_harness import ServerProcess, running_server, wait_until

ON = 'pd_kv_offload_on{tier="disk"}'
FROM_DISK = 'pd_prompt_tokens_by_source_total{source="disk"}'
CACHE = ("--max-model-len", "512", "--kv-cache-memory", "2400000")  # qwen3 tiny: 36 blocks of 16 tokens

def namespaces_work() -> bool:
    """Whether this machine lets a process mount a tmpfs of its own (util-linux's unshare and
    nsenter, user namespaces allowed)."""
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        return False
    probe = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=64k none /mnt"]
    return subprocess.run(probe, capture_output=True).returncode == 0


needs_namespaces = pytest.mark.skipif(not namespaces_work(), reason="no user and mount namespaces here "
                                      "(util-linux's unshare and nsenter, user namespaces allowed) for a private tmpfs")


def prompts(seed: int, count: int = 6) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 200) for _ in range(200)] for _ in range(count)]


def answers(server: ServerProcess, batch: list[list[int]]) -> list[list[int]]:
    return [complete(server, {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}).token_ids
            for p in batch]


@pytest.fixture(scope="module")
def expected(colocated):
    """Answers of a server without a tier, per seed of `prompts`."""
    return {seed: answers(colocated["qwen3"], prompts(seed)) for seed in range(3)}


def tier_server(model: Path, log: Path, directory: Path, *args: str) -> contextlib.AbstractContextManager:
    return running_server(model, log, *CACHE, "--kv-offload-disk-path", str(directory), *args)


@contextlib.contextmanager
def server_on_tmpfs(model: Path, log: Path, directory: Path, size: int) -> Iterator[ServerProcess]:
    """A tier server in its own user and mount namespaces, `directory` a tmpfs of `size` bytes there."""
    directory.mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = pd_command("serve", "--host", "127.0.0.1", "--port", str(port), "--model", str(model), "--num-threads",
                       "1", *CACHE, "--kv-offload-disk-path", str(directory), "--kv-offload-disk-bytes", str(64 << 20))
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
           f'mount -t tmpfs -o size={size} none "$0" && exec "$@"', str(directory), *serve]
    with running(cmd, url, log, ready=lambda status: status == 200) as launched:
        yield ServerProcess(launched.url, launched.process, launched.log_path, launched.readiness)


def in_namespace(server: ServerProcess, *cmd: str) -> None:
    subprocess.run(["nsenter", "-t", str(server.process.pid), "--user", "--mount", "--preserve-credentials", *cmd],
                   check=True, capture_output=True)


def still_serving(server: ServerProcess, pid: int, expected, seed: int) -> None:
    assert answers(server, prompts(seed)) == expected[seed]
    assert server.process.pid == pid and server.process.poll() is None
    assert server.wait_for_metric("pd_kv_cache_usage", lambda v: v == 0) == 0


def turned_off(server: ServerProcess, expected, seed: int) -> bool:
    """Send prompts until the tier reports itself off (each round is answered right)."""
    def off() -> bool:
        assert answers(server, prompts(seed)) == expected[seed]
        return server.metrics()[ON] == 0
    return wait_until(off, timeout=60)


@needs_namespaces
def test_a_full_disk_turns_the_tier_off_and_serving_goes_on(tiny_models, expected, tmp_path):
    with server_on_tmpfs(tiny_models["qwen3"], tmp_path / "s.log", tmp_path / "tier", 16 << 20) as server:
        pid = server.process.pid
        assert answers(server, prompts(0)) == expected[0] and server.metrics()[ON] == 1
        in_namespace(server, "sh", "-c", f"dd if=/dev/zero of={tmp_path / 'tier' / 'fill'} bs=64k || true")
        assert turned_off(server, expected, 1)
        still_serving(server, pid, expected, 0)
    assert "KV disk tier turned off" in (tmp_path / "s.log").read_text()


@needs_namespaces
def test_a_directory_made_read_only_turns_the_tier_off_and_serving_goes_on(tiny_models, expected, tmp_path):
    tier = tmp_path / "tier"
    with server_on_tmpfs(tiny_models["qwen3"], tmp_path / "s.log", tier, 32 << 20) as server:
        pid = server.process.pid
        assert answers(server, prompts(0)) == expected[0]
        in_namespace(server, "sh", "-c", f"mount --bind {tier} {tier} && mount -o remount,bind,ro {tier}")
        assert turned_off(server, expected, 1)
        still_serving(server, pid, expected, 2)
    assert "Read-only file system" in (tmp_path / "s.log").read_text()


def test_the_tier_file_deleted_underneath_turns_the_tier_off(tiny_models, expected, tmp_path):
    with tier_server(tiny_models["qwen3"], tmp_path / "s.log", tmp_path / "tier") as server:
        pid = server.process.pid
        assert answers(server, prompts(0)) == expected[0]
        os.unlink(tmp_path / "tier" / "pd-kv.blocks")
        assert turned_off(server, expected, 1)
        still_serving(server, pid, expected, 0)
    assert "was deleted" in (tmp_path / "s.log").read_text()


def test_a_truncated_tier_file_fails_its_loads_and_they_are_computed(tiny_models, expected, tmp_path):
    with tier_server(tiny_models["qwen3"], tmp_path / "s.log", tmp_path / "tier") as server:
        pid = server.process.pid
        assert answers(server, prompts(0)) == expected[0]
        os.truncate(tmp_path / "tier" / "pd-kv.blocks", 0)
        still_serving(server, pid, expected, 0)  # their blocks were on disk: every load fails
        assert server.metrics()[ON] == 0
        assert server.metrics()['pd_kv_load_failures_total{policy="recompute"}'] > 0
        still_serving(server, pid, expected, 1)


def test_a_corrupted_tier_file_is_a_miss_per_block_and_the_tier_goes_on(tiny_models, expected, tmp_path):
    with tier_server(tiny_models["qwen3"], tmp_path / "s.log", tmp_path / "tier") as server:
        pid = server.process.pid
        assert answers(server, prompts(0)) == expected[0]
        data = tmp_path / "tier" / "pd-kv.blocks"
        size = data.stat().st_size
        with open(data, "r+b") as f:  # a byte in every 64 KiB (a block of this model)
            for offset in range(100, size, 65536):
                f.seek(offset)
                f.write(b"\xa5")
        still_serving(server, pid, expected, 0)
        metrics = server.metrics()
        assert metrics['pd_kv_offload_corrupt_blocks_total{tier="disk"}'] > 0 and metrics[ON] == 1
        assert "its KV could not be loaded from the disk tier (" in server.log_tail(50000)  # with the request's id
        still_serving(server, pid, expected, 0)  # stored again, loaded again
        assert server.metrics()[FROM_DISK] > 0


def test_a_restarted_server_loads_its_prompts_from_the_tier_the_last_one_left(tiny_models, expected, tmp_path):
    with tier_server(tiny_models["qwen3"], tmp_path / "a.log", tmp_path / "tier") as server:
        assert answers(server, prompts(0)) == expected[0]
        assert server.metrics()[FROM_DISK] == 0
    with tier_server(tiny_models["qwen3"], tmp_path / "b.log", tmp_path / "tier") as server:
        pid = server.process.pid
        still_serving(server, pid, expected, 0)
        assert server.metrics()[FROM_DISK] == 6 * 192  # every prompt's full blocks but the last token's
    assert "blocks of 65536 bytes" in (tmp_path / "b.log").read_text()
    assert "0 restored from before" not in (tmp_path / "b.log").read_text()
