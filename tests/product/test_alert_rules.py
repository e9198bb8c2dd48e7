"""The shipped stall alerts: the Prometheus rule is evaluated by Prometheus' own rule engine
(``promtool test rules``, Debian package prometheus) on series shaped like a stalled run, and the
Grafana rule reads the gauge a real run serves."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
import urllib.request
from pathlib import Path

import pytest
import yaml

from otel_rl import Logger

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "docker" / "otel-rl.rules.yml"
GRAFANA_RULES = REPO / "docker" / "grafana" / "provisioning" / "alerting" / "otel-rl-stalls.yml"


def test_prometheus_fires_for_a_run_stalled_for_a_minute_and_only_that_run(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    shutil.copy(RULES, tmp_path / "otel-rl.rules.yml")
    # run r1 stalls at minute 2 for 4 minutes; r2 never does; r3 stalls 30 s only
    (tmp_path / "test.yml").write_text(textwrap.dedent("""
        rule_files: [otel-rl.rules.yml]
        evaluation_interval: 30s
        tests:
          - interval: 30s
            input_series:
              - series: 'otel_rl_stalled{run_id="r1"}'
                values: '0 0 0 0 1 1 1 1 1 1 1 1 0 0'
              - series: 'otel_rl_seconds_since_step{run_id="r1"}'
                values: '1 1 1 1 620 650 680 710 740 770 800 830 1 1'
              - series: 'otel_rl_stalled{run_id="r2"}'
                values: '0x13'
              - series: 'otel_rl_stalled{run_id="r3"}'
                values: '0 0 0 0 1 0 0 0 0 0 0 0 0 0'
            alert_rule_test:
              - eval_time: 2m30s
                alertname: RLRunStalled
                exp_alerts: []
              - eval_time: 3m30s
                alertname: RLRunStalled
                exp_alerts:
                  - exp_labels: {severity: warning, run_id: r1}
                    exp_annotations:
                      summary: RL run r1 has stopped logging steps
                      description: >-
                        No training step for 11m 50s. The stall report (open timers, stacks of
                        the driver and the Ray actors, last GPU readings) is in
                        <log_dir>/stalls/ of the run.
              - eval_time: 6m30s
                alertname: RLRunStalled
                exp_alerts: []
    """))
    out = subprocess.run([promtool, "test", "rules", "test.yml"], cwd=tmp_path,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_grafana_rule_reads_the_gauge_a_run_serves(tmp_path):
    rules = yaml.safe_load(GRAFANA_RULES.read_text())
    assert rules["apiVersion"] == 1
    (group,) = rules["groups"]
    (rule,) = group["rules"]
    query = next(d for d in rule["data"] if d["refId"] == "A")
    assert query["datasourceUid"] == "prometheus"  # the provisioned datasource's uid
    datasources = yaml.safe_load(
        (REPO / "docker/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert "prometheus" in {d.get("uid") for d in datasources["datasources"]}
    condition = next(d for d in rule["data"] if d["refId"] == rule["condition"])
    assert condition["model"]["expression"] == "A"
    assert condition["model"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0.5]}
    # the metric and the label the rule groups by are what a run serves
    with Logger({"log_dir": str(tmp_path), "prometheus": {"enabled": True, "port": 0}}) as lg:
        lg.log_metrics({"x": 1.0}, step=0)
        page = urllib.request.urlopen(lg.prometheus_url, timeout=10).read().decode()
        run_id = lg.run_id
    (line,) = [ln for ln in page.splitlines() if ln.startswith("otel_rl_stalled{")]
    assert f'run_id="{run_id}"' in line and line.endswith(" 0.0")
    assert query["model"]["expr"] == "max by (run_id) (otel_rl_stalled)"
