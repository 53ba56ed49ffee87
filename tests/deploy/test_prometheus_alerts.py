"""deploy/prometheus-alerts.yml: Prometheus loads it (deploy/prometheus.yml names it), each
alert fires on the series that should fire it and not on steady ones (promtool's own unit
tests, tests/deploy/data/alerts_test.yml), and every series an alert reads is on a live
deployment's /metrics with the features it watches on (digests, a disk tier, the canary)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launch import http_client
from tests.support.promql import labelled_selectors, sample_labels
from tests.support.server_harness import running_proxy, running_server

ROOT = Path(__file__).parents[2]
ALERTS = ROOT / "deploy" / "prometheus-alerts.yml"
UNIT_TESTS = Path(__file__).parent / "data" / "alerts_test.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus: "
                                                            ".ci/run does where it runs as root)")


def rules() -> list[dict]:
    return [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_prometheus_loads_the_rules_with_the_scrape_config() -> None:
    for args in (["check", "rules", str(ALERTS)], ["check", "config", str(ROOT / "deploy" / "prometheus.yml")]):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 1 rule files found" in done.stdout + done.stderr


@needs_promtool
def test_each_alert_fires_on_what_should_fire_it(tmp_path) -> None:
    done = subprocess.run([PROMTOOL, "test", "rules", str(UNIT_TESTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr
    tested = {t["alertname"] for test in yaml.safe_load(UNIT_TESTS.read_text())["tests"]
              for t in test["alert_rule_test"]}
    assert tested == {rule["alert"] for rule in rules()}  # every alert has its case
    broken = tmp_path / "alerts.yml"  # the unit tests catch an alert that no longer fires
    broken.write_text(ALERTS.read_text().replace('result="mismatch"', 'result="tie"'))
    cases = tmp_path / "alerts_test.yml"
    cases.write_text(UNIT_TESTS.read_text().replace("../../../deploy/prometheus-alerts.yml", str(broken)))
    assert subprocess.run([PROMTOOL, "test", "rules", str(cases)], capture_output=True, timeout=60).returncode != 0


def test_the_alerts_watch_what_looks_fine_to_a_client() -> None:
    names = {rule["alert"] for rule in rules()}
    assert {"PDDecodeRecomputingPrompts", "PDKVDigestMismatch", "PDCanaryMismatch", "PDEngineRestarting"} <= names
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], rule["alert"]


@pytest.mark.slow
def test_every_series_an_alert_reads_is_on_a_live_deployment(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(running_server(  # noqa: E731
            tiny_models["qwen3"], tmp_path / f"{name}.log", "--kv-digest", "--kv-offload-disk-path",
            str(tmp_path / name), *args))
        p, d = start("p", "--role", "prefill"), start("d", "--role", "decode")
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url,
                                                  "--canary-fraction", "1"))
        response = http_client().post(f"{proxy.url}/v1/completions", timeout=120, json={
            "prompt": "The keeper counted ships until the lamp went out.", "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        series = {job: sample_labels(http_client().get(f"{server.url}/metrics", timeout=10).text)
                  for job, server in (("pd-prefill", p), ("pd-decode", d), ("pd-proxy", proxy))}
    read = {(name, job) for rule in rules() for name, jobs, _ in labelled_selectors(rule["expr"]) for job in jobs}
    assert all(jobs for rule in rules() for _, jobs, _ in labelled_selectors(rule["expr"]))  # each names its jobs
    assert sorted((name, job) for name, job in read if name not in series[job]) == []
