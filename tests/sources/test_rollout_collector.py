"""The collector side of rollout monitoring: the scrape configs of the collector's
``prometheus/engines`` receiver, fed the service-discovery file that RolloutMonitor writes, make
a real Prometheus (Debian's ``prometheus``) scrape the engines. The receiver embeds Prometheus'
own scrape and file-SD code, and no collector binary runs here, so Prometheus itself stands in
for it: same ``scrape_configs``, only the SD path pointed at a temporary directory."""

from __future__ import annotations

import contextlib
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from otel_rl.rollout.monitor import RolloutMonitor
from testkit.dashboard import REPO
from testkit.prometheus_server import PrometheusServer
from testkit.rollout_pages import SG_FIRST, V1_FIRST, PageServer

COLLECTOR = REPO / "collector-config" / "otel-collector.yaml"


def _engine_scrape_configs() -> list[dict]:
    config = yaml.safe_load(COLLECTOR.read_text())
    return config["receivers"]["prometheus/engines"]["config"]["scrape_configs"]


def test_the_engines_receiver_has_both_file_sd_jobs_in_its_own_pipeline():
    jobs = {job["job_name"]: job for job in _engine_scrape_configs()}
    assert jobs["rollout-engines"]["file_sd_configs"][0]["files"] == [
        "/etc/otelcol-contrib/sd/rollout/*.json"
    ]
    assert jobs["ray-nodes"]["file_sd_configs"][0]["files"] == [
        "/tmp/ray/prom_metrics_service_discovery.json"  # written by Ray's head node
    ]
    pipelines = yaml.safe_load(COLLECTOR.read_text())["service"]["pipelines"]
    assert pipelines["metrics/engines"]["receivers"] == ["prometheus/engines"]
    assert pipelines["metrics/engines"]["exporters"] == ["prometheus"]


@contextlib.contextmanager
def _prometheus(tmp_path: Path, jobs: list[dict]) -> Iterator[PrometheusServer]:
    """A real Prometheus scraping ``jobs`` every second."""
    server = PrometheusServer(tmp_path / "prometheus", scrape_configs=jobs)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def _engine_jobs(tmp_path: Path, sd_dir: Path) -> list[dict]:
    """The collector's engine jobs, scraping every second, their SD files under ``tmp_path``."""
    jobs = []
    for job in _engine_scrape_configs():
        job = dict(job, scrape_interval="1s", scrape_timeout="1s")
        if job["job_name"] == "rollout-engines":
            job["file_sd_configs"] = [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]
        else:  # no Ray here: its SD file is absent, which must be harmless
            job["file_sd_configs"] = [{"files": [str(tmp_path / "ray" / "sd.json")]}]
        jobs.append(job)
    return jobs


@pytest.mark.slow
def test_prometheus_scrapes_the_engines_listed_in_the_monitors_sd_file(tmp_path):
    vllm, sglang = PageServer(V1_FIRST), PageServer(SG_FIRST)
    monitor = RolloutMonitor([vllm.url, sglang.url], emit=lambda s, v: None, start=False)
    sd_dir = tmp_path / "sd" / "rollout"
    monitor.write_sd_file(sd_dir / "run-1.json", labels={"otel_rl_run_id": "run-1"})
    try:
        with _prometheus(tmp_path, _engine_jobs(tmp_path, sd_dir)) as prometheus:
            result = prometheus.wait_for(
                'vllm:num_requests_running{otel_rl_run_id="run-1"} '
                'or sglang:num_running_reqs{otel_rl_run_id="run-1"}',
                lambda r: len(r) == 2, timeout=60,
            )
        values = {r["metric"]["__name__"]: float(r["value"][1]) for r in result}
        assert values == {"vllm:num_requests_running": 64.0, "sglang:num_running_reqs": 256.0}
        for r in result:
            assert r["metric"]["job"] == "rollout-engines"
            assert r["metric"]["otel_rl_role"] == "rollout"
    finally:
        vllm.close()
        sglang.close()
        monitor.close()


def _security_doc_job() -> dict:
    """The ``rollout-engines`` job with ``basic_auth`` exactly as docs/security.md gives it."""
    text = (REPO / "docs" / "security.md").read_text()
    [block] = [b for b in text.split("```yaml\n")[1:] if "basic_auth:" in b.split("```")[0]]
    return yaml.safe_load(textwrap.dedent(block.split("```")[0]))[0]


@pytest.mark.slow
def test_an_engine_behind_basic_auth_is_scraped_through_the_jobs_basic_auth(tmp_path):
    """An engine URL with credentials: the monitor's SD file lists ``host:port`` without them
    (no secret in the file), the shipped job then gets 401s, and the job with ``basic_auth`` as
    docs/security.md writes it (password from a file) scrapes the engine."""
    engine = PageServer(V1_FIRST, basic_auth=("rollout", "s3cret-pw"))
    host_port = engine.url.split("//", 1)[1].split("/", 1)[0]
    monitor = RolloutMonitor([f"http://rollout:s3cret-pw@{host_port}/metrics"],
                             emit=lambda s, v: None, start=False)  # fmt: skip
    sd_dir = tmp_path / "sd" / "rollout"
    sd_file = sd_dir / "run-1.json"
    monitor.write_sd_file(sd_file, labels={"otel_rl_run_id": "run-1"})
    assert "s3cret-pw" not in sd_file.read_text()
    assert json.loads(sd_file.read_text())[0]["targets"] == [host_port]
    password = tmp_path / "rollout-password"
    password.write_text("s3cret-pw\n")
    shipped = next(j for j in _engine_jobs(tmp_path, sd_dir) if j["job_name"] == "rollout-engines")
    documented = _security_doc_job()
    assert documented["basic_auth"]["username"] == "rollout"
    with_auth = {**shipped, "job_name": "rollout-engines-auth",
                 "basic_auth": {**documented["basic_auth"], "password_file": str(password)}}
    try:
        with _prometheus(tmp_path, [shipped, with_auth]) as prometheus:
            up = prometheus.wait_for("up", lambda r: len(r) == 2, timeout=60)
            running = prometheus.wait_for(
                'vllm:num_requests_running{otel_rl_run_id="run-1"}', bool, timeout=60
            )
        assert {r["metric"]["job"]: float(r["value"][1]) for r in up} == {
            "rollout-engines": 0.0, "rollout-engines-auth": 1.0,
        }  # fmt: skip
        assert [(r["metric"]["job"], float(r["value"][1])) for r in running] == [
            ("rollout-engines-auth", 64.0)
        ]
        assert engine.authorizations.count(None) >= 1  # the shipped job asked without them
    finally:
        engine.close()
        monitor.close()
