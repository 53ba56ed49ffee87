"""`pd bench compare` and `pd bench serve` against real servers: the table, the JSON and
the plot are written, every figure is present and consistent."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from benchmarks import compare, deployments, serve, serve_metrics
from launch import free_port, pd_command, running
from launch.process import exited, health_status
from pd.models.make_model import make_model

SMALL = ["--dataset", "prefix-repetition", "--prefix-repetition-prefix-len", "160",
         "--prefix-repetition-suffix-len", "16", "--prefix-repetition-output-len", "6",
         "--prefix-repetition-num-prefixes", "2", "--ignore-eos"]


def test_serve_args_carry_the_dataset_flags_and_the_repetitions_seed() -> None:
    args = compare.build_parser().parse_args(["--model", "m", "--seed", "5", *SMALL])
    run = compare.serve_args(args, compare.Deployment("http://a", "http://d/metrics"), seed=7, num_prompts=3,
                             label="x")
    assert (run.base_url, run.metrics_url, run.seed, run.num_prompts) == ("http://a", "http://d/metrics", 7, 3)
    assert (run.dataset, run.prefix_repetition_prefix_len, run.prefix_repetition_num_prefixes) == (
        "prefix-repetition", 160, 2)
    assert run.ignore_eos and run.max_concurrency == 8
    assert not run.trace_conversations
    trace = compare.build_parser().parse_args(["--model", "m", "--dataset", "trace", "--dataset-path", "t.jsonl",
                                               "--trace-conversations"])
    run = compare.serve_args(trace, compare.Deployment("http://a", "http://d/metrics"), seed=7, num_prompts=3,
                             label="x")
    assert run.trace_conversations and run.dataset_path == "t.jsonl"


def test_the_table_shows_medians_and_dashes_for_missing_figures() -> None:
    rows = [{"config": "colocated", "medians": {"output_throughput": 100.0, "mean_ttft_ms": 50.0,
                                                "p99_ttft_ms": 80.0, "mean_tpot_ms": 9.5, "p99_itl_ms": 30.0,
                                                "p_hit_rate": 0.5,
                                                "prefix_hit_rate": 0.25, "kv_mib": None, "on_d": None,
                                                "failed": 0}}]
    table = compare.format_table(rows)
    assert table.splitlines()[2] == "| colocated | 100.0 | 50.0 | 80.0 | 9.5 | 30.0 | 50.0% | 25.0% | - | - | 0 |"
    assert "turns >= 2" not in table  # not a multi-turn run: no such column
    rows.append({"config": "pd", "medians": {**rows[0]["medians"], "mean_ttft_later_ms": 20.0}})
    lines = compare.format_table(rows).splitlines()
    assert "| TTFT turns >= 2 (ms) |" in lines[0]
    assert lines[2:] == ["| colocated | 100.0 | 50.0 | - | 80.0 | 9.5 | 30.0 | 50.0% | 25.0% | - | - | 0 |",
                         "| pd | 100.0 | 50.0 | 20.0 | 80.0 | 9.5 | 30.0 | 50.0% | 25.0% | - | - | 0 |"]
    rows[1]["medians"]["reuse"] = 0.5  # a proxy's row: the share P read from D
    assert compare.format_table(rows).splitlines()[3].endswith("| - | 50.0% | 0 |")


def test_the_share_prefilled_on_d_is_read_from_the_proxys_paths() -> None:
    parse = serve_metrics.parse_prometheus
    paths = ('pd_proxy_requests_by_path_total{{path="local"}} {}\n'
             'pd_proxy_requests_by_path_total{{path="disaggregated"}} {}\n')
    before, after = parse(paths.format(5, 10)), parse(paths.format(8, 19))
    assert deployments.path_share(before, after, "local") == 0.25  # 3 of the 12 placed meanwhile
    assert deployments.path_share(before, before, "local") is None and deployments.path_share(None, None, "x") is None
    reused = parse(paths.format(8, 19) + 'pd_proxy_requests_by_path_total{path="disaggregated+reuse"} 4\n')
    assert deployments.path_share(before, reused, "disaggregated+reuse") == 0.25  # 4 of 16


def metrics_text(queries: float, hits: float, transferred: float | None = None) -> str:
    text = f"pd_prefix_cache_queries_total {queries}\npd_prefix_cache_hits_total {hits}\n"
    if transferred is not None:
        text += f'pd_kv_transfer_bytes_total{{direction="read"}} {transferred}\n'
    return text


def test_figures_over_several_servers_are_summed_before_the_rate() -> None:
    parse = serve_metrics.parse_prometheus
    before = [parse(metrics_text(100, 10, 0)), parse(metrics_text(0, 0))]
    after = [parse(metrics_text(300, 10, 4096)), parse(metrics_text(100, 90))]
    assert deployments.combined_deltas(before, after) == {"queries": 300, "hits": 90, "hit_rate": 0.3,
                                                          "tier_hit_rate": None, "kv_transfer_bytes": 4096}
    idle = deployments.combined_deltas(before[1:], before[1:])
    assert idle["hit_rate"] is None and idle["kv_transfer_bytes"] is None


def test_prompt_tokens_loaded_from_a_disk_tier_are_hits_and_shown_apart() -> None:
    parse = serve_metrics.parse_prometheus
    tier = 'pd_prompt_tokens_by_source_total{source="disk"} %d\n'
    before = [parse(metrics_text(0, 0) + tier % 0)]
    after = [parse(metrics_text(400, 100) + tier % 200)]
    assert deployments.combined_deltas(before, after) == {"queries": 400, "hits": 300, "hit_rate": 0.75,
                                                          "tier_hit_rate": 0.5, "kv_transfer_bytes": None}


def test_each_disk_tier_run_starts_in_a_directory_of_its_own(tmp_path) -> None:
    first = deployments._fresh_dir(tmp_path / "colocated-disk-tier-tier")
    first.mkdir()
    assert deployments._fresh_dir(tmp_path / "colocated-disk-tier-tier") != first


def test_the_all_cache_deployment_has_both_prefill_caches_in_one() -> None:
    args = compare.build_parser().parse_args(["--model", "m", "--prefill-kv-cache-memory", "1000"])
    assert deployments._server_flags("2p2d-kv_aware", args)[0] == ["--kv-cache-memory", "1000"]
    assert deployments._server_flags("1p1d-all-cache", args)[0] == ["--kv-cache-memory", "2000"]
    args.prefill_kv_cache_memory = None
    assert deployments._server_flags("pd-no-skip-partial", args) == ([], ["--no-skip-partial-groups-on-remote-prefill"])


def test_unknown_configurations_are_refused(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        compare.main(["--model", str(tmp_path), "--configs", "colocated,magic"])
    assert "magic" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bamba(tmp_path_factory) -> Path:
    return make_model("bamba", tmp_path_factory.mktemp("compare") / "bamba", seed=1)


def check_metrics(m: dict, num_prompts: int) -> None:
    assert m["completed"] == num_prompts and m["failed"] == 0
    assert m["output_throughput"] > 0 and m["request_throughput"] > 0
    for key, value in m.items():
        if isinstance(value, float):
            assert not math.isnan(value) and value >= 0, key
    assert m["mean_ttft_ms"] <= m["mean_e2el_ms"] and m["median_tpot_ms"] > 0


@pytest.mark.slow
def test_bench_serve_against_a_real_server_saves_every_figure(bamba, tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result_file = tmp_path / "result.json"
    with running(pd_command("serve", "--model", str(bamba), "--port", str(port), "--num-threads", "1"), url,
                 tmp_path / "server.log"):
        serve.main(["--base-url", url, "--num-prompts", "6", "--max-concurrency", "3", *SMALL,
                    "--result-file", str(result_file)])
    saved = json.loads(result_file.read_text())
    check_metrics(saved["metrics"], 6)
    assert saved["metrics"]["total_output_tokens"] == 6 * 6
    assert len(saved["requests"]) == 6
    for r in saved["requests"]:  # every per-request figure
        assert r["output_len"] == 6 and r["ttft"] > 0 and len(r["itl"]) >= 1 and r["error"] is None
    assert saved["server_metrics"]["prefix_cache"]["queries"] > 0


@pytest.mark.slow
def test_compare_writes_the_table_json_and_plot(bamba, tmp_path, capsys) -> None:
    """Four configurations up at once, their repetitions interleaved (ABBA)."""
    out = tmp_path / "out"
    configs = ["colocated", "pd", "2p2d-kv_aware", "pd-conditional"]
    rows = compare.main(["--model", str(bamba), "--configs", ",".join(configs), "--num-prompts", "4",
                         "--warmup-prompts", "1", "--repetitions", "2", *SMALL, "--output-dir", str(out),
                         "--proxy-args", "--local-prefill-max-tokens 1024"])
    ran = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " repetition " in line]
    assert ran == configs + configs[::-1]
    assert [r["config"] for r in rows] == configs
    for row in rows:
        assert len(row["runs"]) == 2 and row["medians"]["failed"] == 0
        for run in row["runs"]:
            check_metrics(run["metrics"], 4)
            assert run["servers"]["decode"]["queries"] > 0
            # pd-conditional: prompts of 176 tokens, within --local-prefill-max-tokens, prefilled on D
            assert (run["servers"]["prefill"]["queries"] > 0) == (row["config"] != "pd-conditional")
    assert rows[0]["medians"]["kv_mib"] is None and rows[1]["medians"]["kv_mib"] > 0  # only PD moves KV
    assert rows[2]["medians"]["kv_mib"] > 0  # read by two decode servers, summed
    assert rows[3]["medians"]["kv_mib"] == 0  # nothing prefilled on P, nothing read
    assert [row["medians"]["on_d"] for row in rows] == [None, 0.0, 0.0, 1.0]  # the proxy's paths, per run
    table = (out / "compare.md").read_text()
    assert "| colocated |" in table and "| pd |" in table and "| 2p2d-kv_aware |" in table
    assert "| prefilled on D |" in table and "| 100.0% |" in table
    assert len(json.loads((out / "compare.json").read_text())["rows"]) == 4
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_peer_is_measured_by_the_same_client_interleaved(bamba, tmp_path, capsys) -> None:
    """`--peer NAME=URL`: a server compare did not start (here one of ours, standing in for
    vLLM or llama.cpp) gets a row of its own, its runs alternating with ours; its
    server-side columns are empty, and it is still serving afterwards (not stopped)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running(pd_command("serve", "--model", str(bamba), "--port", str(port), "--num-threads", "1"), url,
                 tmp_path / "peer.log") as peer:
        rows = compare.main(["--model", str(bamba), "--configs", "colocated", "--peer", f"mine={url}",
                             "--num-prompts", "3", "--warmup-prompts", "1", "--repetitions", "2", *SMALL,
                             "--output-dir", str(tmp_path / "out")])
        assert not exited(peer.process)
    ran = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " repetition " in line]
    assert ran == ["colocated", "peer:mine", "peer:mine", "colocated"]
    assert [r["config"] for r in rows] == ["colocated", "peer:mine"]
    for row in rows:
        for run in row["runs"]:
            check_metrics(run["metrics"], 3)
    assert rows[0]["medians"]["prefix_hit_rate"] is not None and rows[1]["medians"]["prefix_hit_rate"] is None
    assert "| peer:mine |" in (tmp_path / "out" / "compare.md").read_text()


@pytest.mark.slow
def test_a_peer_started_by_compare_is_up_only_while_it_is_measured(bamba, tmp_path, capsys, monkeypatch) -> None:
    """`--peer-start NAME=COMMAND`: compare starts the peer (here one of ours, standing in
    for vLLM or llama.cpp) for each of its runs and stops it after, and deploys ours per
    run too: while one is measured the other does not answer; ABBA order is kept."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = shlex.join(pd_command("serve", "--model", str(bamba), "--port", str(port), "--num-threads", "1"))
    measured, others_up = [], []
    run_once = compare.run_once

    def watched(config, deployment, args, rep):
        others = [u for u in measured if u != deployment.base_url] + ([url] if deployment.base_url != url else [])
        others_up.append([u for u in others if health_status(u) is not None])
        measured.append(deployment.base_url)
        return run_once(config, deployment, args, rep)

    monkeypatch.setattr(compare, "run_once", watched)
    rows = compare.main(["--model", str(bamba), "--configs", "colocated", "--peer", f"mine={url}",
                         "--peer-start", f"mine={command}", "--num-prompts", "3", "--warmup-prompts", "1",
                         "--repetitions", "2", *SMALL, "--output-dir", str(tmp_path / "out")])
    ran = [line.split()[0] for line in capsys.readouterr().out.splitlines() if " repetition " in line
           and not line.startswith("==")]
    assert ran == ["colocated", "peer:mine", "peer:mine", "colocated"]
    assert others_up == [[], [], [], []]
    assert measured.count(url) == 2 and len(measured) == 4
    assert health_status(url) is None  # the peer is stopped
    for row in rows:
        for run in row["runs"]:
            check_metrics(run["metrics"], 3)
    assert "mine started as" in (tmp_path / "out" / "compare.md").read_text()


def test_a_peer_start_names_a_peer(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit):
        compare.main(["--model", str(tmp_path), "--configs", "colocated", "--peer", "a=http://127.0.0.1:1",
                      "--peer-start", "b=true"])
    assert "--peer-start takes NAME=COMMAND" in capsys.readouterr().err


def test_a_peer_must_be_named_with_an_http_url(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text("{}")
    for bad in ("http://127.0.0.1:1", "x=ftp://127.0.0.1:1", "=http://127.0.0.1:1"):
        with pytest.raises(SystemExit):
            compare.main(["--model", str(tmp_path), "--configs", "colocated", "--peer", bad])
        assert "NAME=URL" in capsys.readouterr().err


def children(pid: int) -> set[int]:
    """The PIDs `pid` started that are still its children (Linux /proc)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.update(int(c) for c in (task / "children").read_text().split())
    return found


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]) != "Z"
    except OSError:
        return False


def test_a_terminated_compare_stops_the_deployment_it_launched(bamba, tmp_path) -> None:
    """SIGTERM (what a supervisor or `timeout` sends) unwinds `pd bench compare` through
    its teardown: the servers it started in sessions of their own do not outlive it."""
    bench = subprocess.Popen(pd_command("bench", "compare", "--model", str(bamba), "--configs", "colocated",
                                        "--num-prompts", "400", "--warmup-prompts", "0", "--output-dir",
                                        str(tmp_path / "out"), *SMALL),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (started := children(bench.pid)) and time.monotonic() < deadline and bench.poll() is None:
            time.sleep(0.2)
        assert started, "the benchmark started no deployment"
        time.sleep(2)  # well into its start (or its run)
        started |= children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        bench.wait(timeout=60)
        assert not (tmp_path / "out" / "compare.md").exists()  # cut short: no table
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in started if alive(pid)] == []
    finally:  # whatever is left (each in a session of its own)
        for pid in started | children(bench.pid) | {bench.pid}:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
