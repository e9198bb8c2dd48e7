"""The shipped collector config, compose file, Prometheus config and Grafana provisioning.

No Docker engine, collector or Grafana runs here, so these are static checks: every file parses,
every component or service referenced exists, every mounted file is in the repository, and the
ports are the ones docs/grafana.md lists. ``docker/prometheus.yml`` is also checked by Debian's
``promtool`` when it is installed (it comes with the ``prometheus`` package).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import PurePosixPath

import pytest
import yaml

from testkit.dashboard import DASHBOARD, REPO

COLLECTOR = REPO / "collector-config" / "otel-collector.yaml"
TRACES_FROM_FILES = REPO / "collector-config" / "traces-from-files.yaml"
COMPOSE = REPO / "docker" / "docker-compose.yml"
PROMETHEUS = REPO / "docker" / "prometheus.yml"
GRAFANA = REPO / "docker" / "grafana"

#: Component types of the collector "contrib" distribution that this config may use.
CONTRIB_COMPONENTS = {
    "receivers": {"otlp", "prometheus", "otlpjsonfile"},
    "processors": {"memory_limiter", "batch", "resource", "attributes", "transform", "filter"},
    "exporters": {"prometheus", "prometheusremotewrite", "debug", "otlp", "otlphttp"},
    "extensions": {"health_check", "pprof", "zpages"},
}


def _collector(text: str | None = None) -> dict:
    return yaml.safe_load(text if text is not None else COLLECTOR.read_text())


def _component_type(name: str) -> str:
    return name.split("/", 1)[0]  # "otlp/2" is a second otlp receiver


def _check_collector(config: dict) -> None:
    for section, known in CONTRIB_COMPONENTS.items():
        for name in config.get(section) or {}:
            assert _component_type(name) in known, f"{section}.{name}: not a contrib component"
    service = config["service"]
    for name in service.get("extensions", []):
        assert name in config["extensions"], f"service.extensions: {name} is not defined"
    for pipeline_name, pipeline in service["pipelines"].items():
        assert _component_type(pipeline_name) in {"metrics", "traces", "logs"}
        for section in ("receivers", "processors", "exporters"):
            for name in pipeline.get(section, []):
                assert name in config[section], f"{pipeline_name}.{section}: {name} undefined"


def test_collector_config_references_only_defined_contrib_components():
    config = _collector()
    _check_collector(config)
    metrics = config["service"]["pipelines"]["metrics"]
    assert metrics["receivers"] == ["otlp"]
    # memory_limiter must see data first; batch groups what passed it.
    assert metrics["processors"] == ["memory_limiter", "batch"]
    assert metrics["exporters"] == ["prometheus"]
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"].endswith(":4317")
    assert protocols["http"]["endpoint"].endswith(":4318")
    assert config["exporters"]["prometheus"]["endpoint"].endswith(":8889")


def test_commented_alternatives_are_valid_when_uncommented():
    """The README tells users to uncomment the debug / remote-write exporters: doing exactly that
    must give a config whose references still resolve."""
    text = COLLECTOR.read_text()
    for block in ("# debug:", "# prometheusremotewrite:", "# - debug", "# - prometheusremotewrite"):
        assert block in text, block
    uncommented = re.sub(
        r"^(\s*)# (debug:|prometheusremotewrite:|- debug|- prometheusremotewrite|  \S.*)$",
        r"\1\2",
        text,
        flags=re.M,
    )
    config = _collector(uncommented)
    _check_collector(config)
    assert config["exporters"]["debug"] == {"verbosity": "detailed"}
    remote = config["exporters"]["prometheusremotewrite"]
    assert remote["endpoint"] == "http://prometheus:9090/api/v1/write"
    assert set(config["service"]["pipelines"]["metrics"]["exporters"]) == {
        "prometheus", "prometheusremotewrite", "debug",
    }  # fmt: skip


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_services_and_dependencies():
    services = _compose()["services"]
    assert set(services) == {"otel-collector", "prometheus", "tempo-init", "tempo", "grafana"}
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", service["image"]), "pin every image's tag"
    assert "contrib" in services["otel-collector"]["image"]  # prometheus exporters live there


def test_every_file_the_compose_mounts_exists_in_the_repo():
    compose = _compose()
    named_volumes = set(compose.get("volumes") or {})
    mounts = 0
    for name, service in compose["services"].items():
        for volume in service.get("volumes", []):
            if volume.startswith("${"):  # a host path of the run's own (discovery files)
                assert volume.endswith(":ro"), f"{name} mounts {volume} writable"
                continue
            source, _target = volume.split(":")[:2]
            if source in named_volumes:
                continue
            path = (COMPOSE.parent / source).resolve()
            assert path.exists(), f"{name} mounts {source} ({path}), which is not in the repo"
            assert REPO in path.parents, f"{name} mounts {source} from outside the repo"
            mounts += 1
    assert mounts >= 5


def _mount_target(service: dict, source_suffix: str) -> str:
    for volume in service["volumes"]:
        source, target = volume.split(":")[:2]
        if source.endswith(source_suffix) and not volume.startswith("${"):
            return target
    raise AssertionError(f"no mount of *{source_suffix}")


def test_mounted_paths_match_what_each_service_reads():
    services = _compose()["services"]
    collector = services["otel-collector"]
    target = _mount_target(collector, "collector-config/otel-collector.yaml")
    assert f"--config={target}" in collector["command"]

    prometheus = services["prometheus"]
    target = _mount_target(prometheus, "prometheus.yml")
    assert f"--config.file={target}" in prometheus["command"]

    grafana = services["grafana"]
    dashboards_dir = _mount_target(grafana, "grafana/dashboards")
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/otel-rl.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == dashboards_dir
    home = PurePosixPath(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert str(home.parent) == dashboards_dir and home.name == DASHBOARD.name
    provisioning = {
        _mount_target(grafana, "provisioning/datasources"),
        _mount_target(grafana, "provisioning/dashboards"),
    }
    assert provisioning == {
        "/etc/grafana/provisioning/datasources",
        "/etc/grafana/provisioning/dashboards",
    }


def test_scrape_targets_and_datasource_point_at_real_services_and_ports():
    services = _compose()["services"]
    collector = _collector()
    collector_ports = {
        int(collector["exporters"]["prometheus"]["endpoint"].rsplit(":", 1)[1]),
        collector["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"][
            "prometheus"
        ]["port"],
    }
    prometheus = yaml.safe_load(PROMETHEUS.read_text())
    targets = [
        target
        for job in prometheus["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    ]
    assert targets
    for target in targets:
        host, port = target.rsplit(":", 1)
        assert host in services, f"scrape target {target}: no such service"
        assert host == "otel-collector" and int(port) in collector_ports, target
    by_job = {job["job_name"]: job for job in prometheus["scrape_configs"]}
    # job/instance must stay the exporter's (service.name / service.instance.id) for the join.
    assert by_job["otel-collector"]["honor_labels"] is True

    datasource = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    url = datasource["datasources"][0]["url"]
    host, port = url.removeprefix("http://").split(":")
    assert host in services and int(port) == 9090
    # $__rate_interval is derived from the datasource's interval: it must be the scrape interval.
    assert (
        datasource["datasources"][0]["jsonData"]["timeInterval"]
        == prometheus["global"]["scrape_interval"]
    )


def _documented_ports() -> set[tuple[str, int]]:
    text = (REPO / "docs" / "grafana.md").read_text()
    section = text.split("### Ports", 1)[1].split("\n## ", 1)[0]
    return {
        (service, int(port))
        for service, port in re.findall(r"^\| `([\w-]+)` \| `(\d+)` \|", section, flags=re.M)
    }


def test_published_ports_are_the_documented_ones_and_loopback_only():
    published = set()
    for name, service in _compose()["services"].items():
        for mapping in service.get("ports", []):
            address, host_port, container_port = mapping.split(":")
            assert address == "127.0.0.1", f"{name} publishes {mapping} beyond loopback"
            assert host_port == container_port
            published.add((name, int(host_port)))
    assert published == _documented_ports()


def test_prometheus_config_passes_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    out = subprocess.run(
        [promtool, "check", "config", str(PROMETHEUS)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ---- the trace backend (Tempo) and its Grafana datasource (docs/tracing.md) ------------------

TEMPO = REPO / "docker" / "tempo" / "tempo.yaml"
#: Top-level blocks of a Tempo 2.x single-binary config (a misspelt block would be refused).
TEMPO_BLOCKS = {
    "server", "distributor", "ingester", "compactor", "storage", "querier", "query_frontend",
    "metrics_generator", "overrides", "stream_over_http_enabled", "usage_report", "target",
}  # fmt: skip


def _datasources() -> dict[str, dict]:
    found = {}
    for path in sorted((GRAFANA / "provisioning" / "datasources").glob("*.yml")):
        for source in yaml.safe_load(path.read_text())["datasources"]:
            assert source["uid"] not in found, f"{path.name}: uid {source['uid']} used twice"
            found[source["uid"]] = source
    return found


def test_tempo_reads_its_mounted_config_and_stores_in_the_volume_init_prepares():
    services = _compose()["services"]
    tempo, init = services["tempo"], services["tempo-init"]
    assert tempo["image"] == init["image"]  # the chown runs with the uid the image runs as
    target = _mount_target(tempo, "tempo/tempo.yaml")
    assert f"-config.file={target}" in tempo["command"]
    config = yaml.safe_load(TEMPO.read_text())
    assert set(config) <= TEMPO_BLOCKS, set(config) - TEMPO_BLOCKS
    data = {v.split(":")[1] for v in tempo["volumes"] if v.startswith("tempo-data:")}
    assert data == {v.split(":")[1] for v in init["volumes"]} == {"/var/tempo"}
    assert init["entrypoint"] == ["chown", "10001:10001", "/var/tempo"]
    assert tempo["depends_on"]["tempo-init"]["condition"] == "service_completed_successfully"
    storage = config["storage"]["trace"]
    assert storage["backend"] == "local"
    for path in (storage["wal"]["path"], storage["local"]["path"]):
        assert PurePosixPath("/var/tempo") in PurePosixPath(path).parents, path
    # reachable from the collector's container: not the localhost-only default
    protocols = config["distributor"]["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert "ports" not in tempo  # read through Grafana; the published-ports table stays as is


def test_grafana_has_a_tempo_datasource_on_the_tempo_service():
    services = _compose()["services"]
    sources = _datasources()
    tempo = sources["tempo"]
    assert tempo["type"] == "tempo" and tempo["access"] == "proxy"
    host, port = tempo["url"].removeprefix("http://").split(":")
    config = yaml.safe_load(TEMPO.read_text())
    assert host == "tempo" and int(port) == config["server"]["http_listen_port"]
    assert "tempo" in services["grafana"]["depends_on"]
    # links from traces to metrics go to a datasource that exists
    assert tempo["jsonData"]["serviceMap"]["datasourceUid"] in sources
    assert [uid for uid, source in sources.items() if source.get("isDefault")] == ["prometheus"]


def test_the_collector_forwards_traces_to_tempo():
    config = _collector()
    _check_collector(config)
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    (exporter,) = traces["exporters"]
    endpoint = config["exporters"][exporter]["endpoint"]
    tempo = yaml.safe_load(TEMPO.read_text())["distributor"]["receivers"]["otlp"]["protocols"]
    port = {"otlp": tempo["grpc"]["endpoint"], "otlphttp": tempo["http"]["endpoint"]}[
        _component_type(exporter)
    ].rsplit(":", 1)[1]
    assert endpoint.removeprefix("http://").split("/")[0] == f"tempo:{port}"


def test_the_file_collector_reads_every_trace_file_a_run_writes_and_sends_it_to_tempo(tmp_path):
    """The receiver's globs, with the mount point ``/logs`` made the folder a real run wrote
    to, find both its trace files (the rotated one too) and nothing else; the pipeline ends at
    the same Tempo port as the main config's."""
    import glob

    from otel_rl import Logger

    config = yaml.safe_load(TRACES_FROM_FILES.read_text())
    _check_collector(config)
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlpjsonfile"]
    main = _collector()
    (tempo,) = main["service"]["pipelines"]["traces"]["exporters"]
    (exporter,) = traces["exporters"]
    assert config["exporters"][exporter]["endpoint"] == main["exporters"][tempo]["endpoint"]

    log_dir = tmp_path / "project" / "exp_001"
    cfg = {"log_dir": str(log_dir),
           "tracing": {"enabled": True, "file_max_mb": 1, "picture": False}}  # fmt: skip
    with Logger(cfg) as logger:
        for step in range(4000):  # enough spans to rotate once
            with logger.timer("generation"):
                pass
            logger.log_metrics({"x": 1.0}, step=step)
    written = sorted(str(p) for p in log_dir.glob("traces*.jsonl"))
    assert [p.rsplit("/", 1)[1] for p in written] == ["traces.1.jsonl", "traces.jsonl"]
    found = sorted(
        path
        for pattern in config["receivers"]["otlpjsonfile"]["include"]
        for path in glob.glob(str(tmp_path) + pattern.removeprefix("/logs"), recursive=True)
    )
    assert found == written
