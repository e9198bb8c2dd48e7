"""The collector side of rollout monitoring: the scrape configs of the collector's
``prometheus/engines`` receiver, fed the service-discovery file that RolloutMonitor writes, make
a real Prometheus (Debian's ``prometheus``) scrape the engines. The receiver embeds Prometheus'
own scrape and file-SD code, and no collector binary runs here, so Prometheus itself stands in
for it: same ``scrape_configs``, only the SD path pointed at a temporary directory."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml

from otel_rl.rollout.monitor import RolloutMonitor
from testkit.dashboard import REPO
from testkit.prometheus_server import free_port, prometheus_binary
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


def _query(url: str, promql: str) -> list[dict]:
    params = urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(f"{url}/api/v1/query?{params}", timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.slow
def test_prometheus_scrapes_the_engines_listed_in_the_monitors_sd_file(tmp_path):
    binary = prometheus_binary()
    vllm, sglang = PageServer(V1_FIRST), PageServer(SG_FIRST)
    monitor = RolloutMonitor([vllm.url, sglang.url], emit=lambda s, v: None, start=False)
    sd_dir = tmp_path / "sd" / "rollout"
    monitor.write_sd_file(sd_dir / "run-1.json", labels={"otel_rl_run_id": "run-1"})
    jobs = []
    for job in _engine_scrape_configs():
        job = dict(job, scrape_interval="1s", scrape_timeout="1s")
        if job["job_name"] == "rollout-engines":
            job["file_sd_configs"] = [{"files": [str(sd_dir / "*.json")], "refresh_interval": "1s"}]
        else:  # no Ray here: its SD file is absent, which must be harmless
            job["file_sd_configs"] = [{"files": [str(tmp_path / "ray" / "sd.json")]}]
        jobs.append(job)
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}, "scrape_configs": jobs}))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "prometheus.log").open("wb")
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        result: list[dict] = []
        while time.monotonic() < deadline:
            assert process.poll() is None, (tmp_path / "prometheus.log").read_text()[-2000:]
            try:
                result = _query(
                    url,
                    'vllm:num_requests_running{otel_rl_run_id="run-1"} '
                    'or sglang:num_running_reqs{otel_rl_run_id="run-1"}',
                )
            except OSError:
                result = []
            if len(result) == 2:
                break
            time.sleep(0.25)
        values = {r["metric"]["__name__"]: float(r["value"][1]) for r in result}
        assert values == {"vllm:num_requests_running": 64.0, "sglang:num_running_reqs": 256.0}
        for r in result:
            assert r["metric"]["job"] == "rollout-engines"
            assert r["metric"]["otel_rl_role"] == "rollout"
    finally:
        process.terminate()
        process.wait(10)
        log.close()
        vllm.close()
        sglang.close()
        monitor.close()
