"""deploy/grafana/pd-dashboard.json and deploy/prometheus.yml: the dashboard is one
Grafana imports, each of its queries names the job it reads, those jobs are scraped, and
every series it queries exists on the /metrics of a live prefill server, decode server
and proxy of that job (after a few requests through the proxy)."""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from launch import http_client
from tests.support.promql import labelled_selectors, sample_labels, selectors
from tests.support.server_harness import running_proxy, running_server

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pd-dashboard.json"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
def targets(dashboard: dict) -> list[dict]:
    return [t for panel in dashboard["panels"] if panel["type"] != "row" for t in panel["targets"]]


def missing_series(dashboard: dict, series: dict[str, dict[str, set[str]]]) -> list[tuple[str, str]]:
    """(metric, job) of each series the dashboard queries that is not among that job's
    samples, or lacks a label it asks for (`series`: job -> sample_labels of its /metrics)."""
    return sorted({(name, job) for target in targets(dashboard) for name, jobs, labels in
                   labelled_selectors(target["expr"]) for job in jobs
                   if name not in series[job] or not labels <= series[job][name]})


def test_selectors_are_read_out_of_promql() -> None:
    expr = ('histogram_quantile(0.9, sum by (job, le) (rate(a_seconds_bucket{job="pd-decode", x!=""}[5m]))) '
            '/ on (instance) group_left (policy) b_total{job=~"pd-prefill|pd-decode"} > bool 0 or c')
    assert selectors(expr) == [("a_seconds_bucket", {"pd-decode"}), ("b_total", {"pd-prefill", "pd-decode"}),
                               ("c", set())]
    assert labelled_selectors('x{job="a", group!="", y=""}') == [("x", {"a"}, {"group"})]


def test_the_dashboard_is_one_grafana_imports() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    assert [v["type"] for v in dashboard["templating"]["list"]] == ["datasource"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        assert all(t["expr"] and t["refId"] for t in panel["targets"]), panel["title"]


def test_every_query_names_a_job_that_prometheus_scrapes() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text())
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    used = {name: found for t in targets(json.loads(DASHBOARD.read_text())) for name, found in selectors(t["expr"])}
    assert [name for name, found in used.items() if not found] == []
    assert set().union(*used.values()) == jobs == {"pd-proxy", "pd-prefill", "pd-decode"}


def test_the_scrape_targets_are_the_deploy_scripts_default_ports() -> None:
    script = (ROOT / "deploy" / "xpyd.sh").read_text()
    defaults = {name: re.search(rf"\b{name}=(\d+)", script).group(1) for name in ("PORT", "P_BASE", "D_BASE")}
    config = yaml.safe_load(PROMETHEUS.read_text())
    scraped = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert scraped == {"pd-proxy": [f"127.0.0.1:{defaults['PORT']}"], "pd-prefill": [f"127.0.0.1:{defaults['P_BASE']}"],
                       "pd-decode": [f"127.0.0.1:{defaults['D_BASE']}"]}


@pytest.mark.slow
def test_every_series_the_dashboard_queries_is_on_a_live_deployment(tiny_models, tmp_path) -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    with contextlib.ExitStack() as stack:
        start = lambda name, *args: stack.enter_context(  # noqa: E731
            running_server(tiny_models["qwen3"], tmp_path / f"{name}.log", *args))
        p, d = start("p", "--role", "prefill"), start("d", "--role", "decode")
        proxy = stack.enter_context(running_proxy(tmp_path / "proxy.log", "--prefill", p.url, "--decode", d.url))
        for _ in range(2):  # the same prompt twice: the second finds it in the prefix cache
            response = http_client().post(f"{proxy.url}/v1/completions", timeout=120, json={
                "prompt": "The keeper counted ships until the lamp went out. " * 4, "max_tokens": 4})
            assert response.status_code == 200, response.text
        series = {job: sample_labels(http_client().get(f"{server.url}/metrics", timeout=10).text)
                  for job, server in (("pd-prefill", p), ("pd-decode", d), ("pd-proxy", proxy))}
    dashboard = json.loads(DASHBOARD.read_text())
    assert missing_series(dashboard, series) == []
    # the check sees a series that is not there: a query renamed, a job swapped, a label absent
    text = DASHBOARD.read_text().replace("pd_generation_tokens_total", "pd_generated_tokens_total")
    text = text.replace('pd_proxy_queue_waiting{job=\\"pd-proxy\\"}', 'pd_proxy_queue_waiting{job=\\"pd-decode\\"}')
    text = text.replace('pd_prefix_cache_hits_total{job=~\\"pd-prefill|pd-decode\\", group!=\\"\\"}',
                        'pd_prefix_cache_hits_total{job=~\\"pd-prefill|pd-decode\\", tier!=\\"\\"}')
    assert missing_series(json.loads(text), series) == [
        ("pd_generated_tokens_total", "pd-decode"), ("pd_prefix_cache_hits_total", "pd-decode"),
        ("pd_prefix_cache_hits_total", "pd-prefill"), ("pd_proxy_queue_waiting", "pd-decode")]
