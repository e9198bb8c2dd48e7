"""OTLP output against real receivers on 127.0.0.1 that decode with opentelemetry-proto."""

from __future__ import annotations

import base64
import urllib.request

import pytest

from otel_rl import Logger
from otel_rl.core.errors import ConfigError
from otel_rl.telemetry.otlp import DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, resolve_otlp
from otel_rl.telemetry.timing import TIMING_BUCKETS
from testkit.otlp_receiver import OtlpGrpcReceiver, OtlpHttpReceiver, closed_port

TOKEN_BUCKETS = (10.0, 50.0, 100.0)


@pytest.fixture
def http_receiver():
    receiver = OtlpHttpReceiver()
    yield receiver
    receiver.close()


@pytest.fixture
def clean_otel_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("OTEL_"):
            monkeypatch.delenv(name)
    return monkeypatch


def _config(tmp_path, otlp, **extra):
    return {
        "log_dir": str(tmp_path),
        "jsonl_enabled": False,
        "capture_global_meters": False,
        "otlp": {"enabled": True, "interval": 60.0, "timeout": 2.0, **otlp},
        **extra,
    }


def _ten_steps(logger: Logger) -> None:
    """Known values at known steps: loss 1/(s+1), reward [s, -s, 2s], tokens 10*s, 4 samples."""
    meter = logger.meter_provider.get_meter("app")
    tokens = meter.create_histogram(
        "rollout.tokens", explicit_bucket_boundaries_advisory=TOKEN_BUCKETS
    )
    samples = meter.create_counter("rollout.samples")
    for step in range(10):
        with logger.timer("generation"):
            tokens.record(10.0 * step)
            samples.add(4)
        logger.log_metrics(
            {"loss": 1.0 / (step + 1), "reward": [float(step), -float(step), 2.0 * step]},
            step=step,
            prefix="train",
        )


def test_ten_step_run_arrives_with_exact_values_and_resource(
    tmp_path, http_receiver, clean_otel_env
):
    clean_otel_env.setenv("OTEL_SERVICE_NAME", "grpo-trainer")
    clean_otel_env.setenv(
        "OTEL_RESOURCE_ATTRIBUTES",
        "deployment.environment=ci,host.name=node-7,otel_rl.run_id=not-this-one",
    )
    cfg = _config(
        tmp_path,
        {"endpoint": http_receiver.endpoint},
        run_id="run-42",
        experiment="grpo-7b",
        role="actor",
        rank=3,
    )
    logger = Logger(cfg)
    _ten_steps(logger)
    logger.finish()

    assert http_receiver.received, "nothing arrived at the receiver"
    resources = {tuple(sorted(r.items())) for r, _, _, _ in http_receiver.points()}
    assert len(resources) == 1  # both providers push the same resource
    resource = dict(next(iter(resources)))
    assert resource["service.name"] == "grpo-trainer"
    assert resource["otel_rl.run_id"] == "run-42"  # the config's, never the env's
    assert resource["otel_rl.experiment"] == "grpo-7b"
    assert resource["otel_rl.role"] == "actor"
    assert resource["otel_rl.rank"] == 3
    assert resource["host.name"] == "node-7"
    assert resource["deployment.environment"] == "ci"

    # Gauges of logged keys carry the last step's values (step 9).
    assert http_receiver.last_point("train/loss").as_double == pytest.approx(0.1)
    assert http_receiver.last_point("train/reward/mean").as_double == 6.0  # (9 - 9 + 18) / 3
    assert http_receiver.last_point("train/reward/min").as_double == -9.0
    assert http_receiver.last_point("train/reward/max").as_double == 18.0
    assert http_receiver.last_point("otel_rl.step").as_int == 9
    assert http_receiver.last_point("otel_rl.steps").as_int == 10

    # Counters and histograms are cumulative over the whole run.
    assert http_receiver.last_point("rollout.samples").as_int == 40
    tokens = http_receiver.last_point("rollout.tokens")
    assert tokens.count == 10 and tokens.sum == 450.0
    assert tuple(tokens.explicit_bounds) == TOKEN_BUCKETS
    # 0 and 10 fall in (-inf, 10]; 20..50 in (10, 50]; 60..90 in (50, 100]
    assert list(tokens.bucket_counts) == [2, 4, 4, 0]
    assert (tokens.min, tokens.max) == (0.0, 90.0)
    timer = http_receiver.last_point("timing/generation")
    assert timer.count == 10 and tuple(timer.explicit_bounds) == TIMING_BUCKETS


def test_exponential_histograms_go_to_otlp_only(tmp_path, http_receiver, clean_otel_env):
    cfg = _config(
        tmp_path,
        {"endpoint": http_receiver.endpoint, "histogram": "exponential"},
        prometheus={"enabled": True, "port": 0},
    )
    logger = Logger(cfg)
    _ten_steps(logger)
    url = logger.prometheus_url
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    logger.finish()

    # Prometheus keeps the explicit buckets of each histogram...
    assert 'rollout_tokens_bucket{le="50.0"' in text
    assert 'timing_generation_seconds_bucket{le="0.005"' in text
    # ...while OTLP gets base-2 exponential histograms with the same count and sum.
    kinds = {name: metric.WhichOneof("data") for _, name, metric, _ in http_receiver.points()}
    assert kinds["rollout.tokens"] == "exponential_histogram"
    assert kinds["timing/generation"] == "exponential_histogram"
    assert kinds["train/loss"] == "gauge"
    tokens = http_receiver.last_point("rollout.tokens")
    assert tokens.count == 10 and tokens.sum == 450.0 and tokens.zero_count == 1
    assert sum(tokens.positive.bucket_counts) == 9


def test_env_endpoint_and_merged_headers(tmp_path, http_receiver, clean_otel_env):
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", http_receiver.endpoint)
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=rl,x-token=from-env")
    logger = Logger(_config(tmp_path, {"headers": {"X-Token": "from-config"}}))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.finish()

    assert http_receiver.last_point("loss").as_double == 0.5
    headers = http_receiver.received[0].headers
    assert headers["x-team"] == "rl"
    assert headers["x-token"] == "from-config"


def test_spans_and_log_records_carry_the_same_auth_and_headers_as_metrics(
    tmp_path, http_receiver, clean_otel_env
):
    """Metrics, the timers' spans and the run's events go to one collector with one set of
    credentials: the endpoint's ``user:password@`` (sent as Basic auth) and the config's headers
    merged over the env's, each signal's own variable before the generic one. One resolution
    (``resolve_otlp(signal=...)``) serves the three, so they cannot drift apart."""
    from otel_rl.core.records import Event
    from otel_rl.watch.run_watch import OtlpLogRecords

    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=rl,x-tenant=from-env")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-signal=traces")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_LOGS_HEADERS", "x-signal=logs")
    endpoint = http_receiver.endpoint.replace("http://", "http://bob:p%40ss@")
    otlp = {"endpoint": endpoint, "headers": {"X-Tenant": "from-config"}}
    logger = Logger(_config(tmp_path, otlp, tracing={"enabled": True}))
    with logger.timer("generation"):
        pass
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.finish()
    records = OtlpLogRecords({**_config(tmp_path, otlp)["otlp"]}, logger._run.pipeline.resource)
    records.emit(Event(name="otel_rl/stall", step=3, title="stalled", text="no step"), {})
    records.shutdown(5.0)

    basic = "Basic " + base64.b64encode(b"bob:p@ss").decode()
    assert http_receiver.last_point("loss").as_double == 0.5
    assert {s.name for _, s in http_receiver.wait_for_spans(2)} >= {"generation", "rl.step"}
    assert http_receiver.logs[0][1].body.string_value == "no step"
    signals = {
        "metrics": http_receiver.received[0].headers,
        "traces": http_receiver.span_headers[0],
        "logs": http_receiver.log_headers[0],
    }
    for signal, headers in signals.items():
        assert headers["authorization"] == basic, signal
        assert headers["x-tenant"] == "from-config", signal
    # A signal's own variable replaces the generic one (the spec's order), as for metrics.
    assert signals["metrics"]["x-team"] == "rl" and "x-signal" not in signals["metrics"]
    assert signals["traces"]["x-signal"] == "traces" and "x-team" not in signals["traces"]
    assert signals["logs"]["x-signal"] == "logs" and "x-team" not in signals["logs"]


def test_each_signal_reads_its_own_variables_before_the_generic_ones():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://traces:9999/custom",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7",
        "OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "2",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
    }
    metrics = resolve_otlp({}, environ=env)
    traces = resolve_otlp({}, environ=env, signal="traces")
    logs = resolve_otlp({}, environ=env, signal="logs")
    assert (metrics.protocol, metrics.endpoint, metrics.timeout_s) == (
        "http/protobuf", "http://collector:4318/v1/metrics", 7.0,
    )  # fmt: skip
    assert (traces.protocol, traces.endpoint) == ("grpc", "http://traces:9999/custom")
    assert (logs.endpoint, logs.timeout_s) == ("http://collector:4318/v1/logs", 2.0)
    # A configured endpoint is the collector's base, whichever signal's path it names.
    for given in ("http://c:4318", "http://c:4318/", "http://c:4318/v1/metrics"):
        assert resolve_otlp({"endpoint": given}, environ={}, signal="traces").endpoint == (
            "http://c:4318/v1/traces"
        )
    with pytest.raises(ConfigError, match=r"OTEL_EXPORTER_OTLP_\[TRACES_\]PROTOCOL"):
        resolve_otlp({}, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "json"}, signal="traces")


def test_config_endpoint_wins_over_env(tmp_path, http_receiver, clean_otel_env):
    dead = f"http://127.0.0.1:{closed_port()}/v1/metrics"
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", dead)
    logger = Logger(_config(tmp_path, {"endpoint": http_receiver.endpoint}))
    logger.log_metrics({"loss": 0.25}, step=0)
    logger.finish()
    assert http_receiver.last_point("loss").as_double == 0.25


@pytest.mark.slow
def test_periodic_exports_while_training(tmp_path, http_receiver, clean_otel_env):
    """With a short interval the collector sees the run while it is going, not only at the end."""
    logger = Logger(_config(tmp_path, {"endpoint": http_receiver.endpoint, "interval": 0.2}))
    logger.log_metrics({"loss": 0.75}, step=0)
    assert http_receiver.wait_for(2, timeout=10)  # one request per provider, before finish()
    assert http_receiver.last_point("loss").as_double == 0.75
    logger.finish()


def test_grpc_receiver_gets_the_run(tmp_path, clean_otel_env):
    receiver = OtlpGrpcReceiver()
    try:
        cfg = _config(
            tmp_path, {"endpoint": receiver.endpoint, "protocol": "grpc"}, run_id="grpc-run"
        )
        logger = Logger(cfg)
        _ten_steps(logger)
        logger.finish()
    finally:
        receiver.close()
    assert receiver.last_point("train/loss").as_double == pytest.approx(0.1)
    assert receiver.last_point("rollout.tokens").sum == 450.0
    resource = next(r for r, _, _, _ in receiver.points())
    assert resource["otel_rl.run_id"] == "grpc-run"


# ---- how settings are resolved (config > signal env > generic env > default) -----------------


def test_defaults_without_config_or_env():
    s = resolve_otlp({}, environ={})
    assert s.protocol == "http/protobuf"
    assert s.endpoint == "http://127.0.0.1:4318/v1/metrics"
    assert (s.timeout_s, s.interval_s) == (DEFAULT_TIMEOUT_S, DEFAULT_INTERVAL_S)
    assert s.headers == {} and s.insecure is None and s.histogram is None


def test_env_fills_what_config_leaves_unset():
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "7",
        "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT": "3",
        "OTEL_METRIC_EXPORT_INTERVAL": "2500",
    }
    s = resolve_otlp({}, environ=env)
    assert s.endpoint == "http://collector:4318/v1/metrics"  # generic: a base URL
    assert s.timeout_s == 3.0  # the metrics-specific variable first; seconds, as Python reads it
    assert s.interval_s == 2.5  # milliseconds in the env var
    env["OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"] = "http://gw:9999/custom/path"
    assert resolve_otlp({}, environ=env).endpoint == "http://gw:9999/custom/path"  # as-is


def test_config_wins_over_env():
    env = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://env:4318/v1/metrics",
        "OTEL_EXPORTER_OTLP_TIMEOUT": "9",
        "OTEL_METRIC_EXPORT_INTERVAL": "1000",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
    }
    cfg = {
        "protocol": "http/protobuf",
        "endpoint": "http://cfg:4318",
        "timeout": 1.5,
        "interval": 30,
        "insecure": False,
    }
    s = resolve_otlp(cfg, environ=env)
    assert (s.protocol, s.endpoint) == ("http/protobuf", "http://cfg:4318/v1/metrics")
    assert (s.timeout_s, s.interval_s, s.insecure) == (1.5, 30.0, False)
    grpc = resolve_otlp({}, environ=env)
    assert grpc.protocol == "grpc" and grpc.endpoint == "http://env:4318/v1/metrics"
    assert grpc.insecure is None  # the gRPC exporter reads OTEL_EXPORTER_OTLP_INSECURE itself


def test_grpc_insecure_from_the_env_reaches_a_plaintext_receiver(tmp_path, clean_otel_env):
    """``otlp.insecure`` unset: the SDK's gRPC exporter resolves OTEL_EXPORTER_OTLP_INSECURE, so
    an endpoint without a scheme (TLS unless told otherwise) speaks plaintext to a receiver
    without TLS."""
    receiver = OtlpGrpcReceiver()
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    try:
        endpoint = receiver.endpoint.removeprefix("http://")
        logger = Logger(_config(tmp_path, {"endpoint": endpoint, "protocol": "grpc"}))
        logger.log_metrics({"train/loss": 0.5}, step=0)
        logger.finish()
    finally:
        receiver.close()
    assert receiver.last_point("train/loss").as_double == 0.5


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="protocol"):
        resolve_otlp({}, environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    with pytest.raises(ConfigError, match="OTEL_METRIC_EXPORT_INTERVAL"):
        resolve_otlp({}, environ={"OTEL_METRIC_EXPORT_INTERVAL": "soon"})
    with pytest.raises(ConfigError, match="histogram"):
        Logger({"otlp": {"histogram": "log-linear"}})


def test_a_variable_the_sdk_would_drop_or_misread_is_a_config_error():
    """The SDK drops a header without a value (``Header format invalid!``), takes any word but
    ``true`` for an insecure false, and warns and goes on with explicit buckets for an unknown
    histogram aggregation: each is refused here, naming the variable (a header's value never
    shown), and a valid one still reads (the config's own value wins)."""
    bad = {
        "OTEL_EXPORTER_OTLP_HEADERS": ("authorization", r"HEADERS: the header 'authorization'"),
        "OTEL_EXPORTER_OTLP_INSECURE": ("maybe", r"\]INSECURE must be true or false"),
        "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": (
            "bogus", "DEFAULT_HISTOGRAM_AGGREGATION must be one of"),
    }  # fmt: skip
    for name, (value, said) in bad.items():
        with pytest.raises(ConfigError, match=said):
            resolve_otlp({}, environ={name: value})
    env = {"OTEL_EXPORTER_OTLP_HEADERS": "a=1,b=secret=x", "OTEL_EXPORTER_OTLP_INSECURE": "TRUE",
           "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION":
               "base2_exponential_bucket_histogram"}  # fmt: skip
    settings = resolve_otlp({}, environ=env)
    assert settings.headers == {"a": "1", "b": "secret=x"}
    with pytest.raises(ConfigError) as refused:
        resolve_otlp({}, environ={"OTEL_EXPORTER_OTLP_HEADERS": "a=s3cr3t,token"})
    assert "s3cr3t" not in str(refused.value) and "'token'" in str(refused.value)
    insecure = {"OTEL_EXPORTER_OTLP_INSECURE": "x"}
    assert resolve_otlp({"insecure": False}, environ=insecure).insecure is False
    histogram = {"OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION": "x"}
    assert resolve_otlp({"histogram": "explicit"}, environ=histogram).histogram == "explicit"


def test_demo_flags_push_to_a_collector_and_serve_prometheus(tmp_path, http_receiver, capsys):
    """`otel-rl demo --prometheus-port ... --otlp-endpoint ...`, as docs/grafana.md runs it."""
    from otel_rl.cli.main import main

    argv = ["demo", "--steps", "3", "--log-dir", str(tmp_path), "--backends", "jsonl"]
    argv += ["--prometheus-port", "0", "--otlp-endpoint", http_receiver.endpoint]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"pushed to {http_receiver.endpoint}/v1/metrics" in out
    assert "Prometheus:       http://127.0.0.1:" in out
    assert http_receiver.last_point("otel_rl.step").as_int == 2
    assert http_receiver.last_point("train/reward/count").as_double == 16.0
    resource = next(r for r, _, _, _ in http_receiver.points())
    assert resource["otel_rl.experiment"] == "otel-rl-demo"


# ---- endpoints without a usable scheme are refused at start, with the URL meant ----------------

BAD_HTTP_ENDPOINTS = [
    ("localhost:4318", "http://localhost:4318"),
    ("notaurl", "http://notaurl:4318"),
    ("ftp://x:1", "http://x:1"),
    ("grpc://collector:4317", "http://collector:4317"),
]


@pytest.mark.parametrize(("given", "meant"), BAD_HTTP_ENDPOINTS)
def test_an_endpoint_without_a_usable_scheme_is_refused_with_the_url_meant(
    tmp_path, given, meant, clean_otel_env
):
    """Such an endpoint used to pass and be retried every 10 s as if the collector were down;
    now the Logger refuses it before anything starts, naming the config key and the fix."""
    with pytest.raises(ConfigError) as refused:
        Logger(_config(tmp_path, {"endpoint": given}))
    message = str(refused.value)
    assert message.startswith(f"otlp.endpoint {given!r}: OTLP/HTTP needs a URL starting with")
    assert message.endswith(f"did you mean {meant!r}?")
    assert not any(tmp_path.iterdir())  # refused before anything was written


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_ENDPOINT",
                                      "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT",
                                      "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"])  # fmt: skip
def test_an_endpoint_variable_without_a_scheme_is_refused_naming_the_variable(
    tmp_path, variable, clean_otel_env
):
    clean_otel_env.setenv(variable, "collector:4318")
    with pytest.raises(ConfigError) as refused:
        Logger(_config(tmp_path, {}))
    assert str(refused.value) == (
        f"{variable} 'collector:4318': OTLP/HTTP needs a URL starting with http:// (or https:// "
        "for TLS); did you mean 'http://collector:4318'?"
    )


def test_the_refusal_never_shows_the_endpoints_password(tmp_path, clean_otel_env):
    with pytest.raises(ConfigError) as refused:
        Logger(_config(tmp_path, {"endpoint": "bob:hunter22@collector:4318"}))
    assert "hunter22" not in str(refused.value)
    assert "did you mean 'http://***@collector:4318'?" in str(refused.value)


def test_grpc_refuses_what_its_exporter_cannot_reach_and_keeps_its_own_forms():
    """The SDK's gRPC exporter takes ``http(s)://host:port``, ``host:port`` (TLS unless told
    otherwise) and gRPC's targets (``unix:///path``); ``notaurl`` (no port: gRPC would dial
    443) and ``ftp://`` are refused."""
    for good in ("http://c:4317", "https://c:4317", "c:4317", "[::1]:4317",
                 "unix:///run/otel.sock", "dns:///c:4317"):  # fmt: skip
        s = resolve_otlp({"endpoint": good, "protocol": "grpc"}, environ={})
        assert s.endpoint == good
    for bad, meant in (("notaurl", "http://notaurl:4317"), ("ftp://x:1", "http://x:1")):
        with pytest.raises(ConfigError, match=rf"did you mean '{meant}'\?$"):
            resolve_otlp({"endpoint": bad, "protocol": "grpc"}, environ={})
    with pytest.raises(ConfigError, match="OTEL_EXPORTER_OTLP_ENDPOINT 'notaurl'"):
        resolve_otlp({"protocol": "grpc"}, environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "notaurl"})


def test_a_grpc_endpoint_passes_the_config_when_the_protocol_comes_from_the_env(
    tmp_path, clean_otel_env
):
    """``otlp.endpoint: collector:4317`` with ``OTEL_EXPORTER_OTLP_PROTOCOL=grpc``: the config
    check cannot know the protocol yet and lets it pass; the start checks it with the real one."""
    receiver = OtlpGrpcReceiver()
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    clean_otel_env.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    try:
        endpoint = receiver.endpoint.removeprefix("http://")
        logger = Logger(_config(tmp_path, {"endpoint": endpoint}))
        logger.log_metrics({"loss": 0.125}, step=0)
        logger.finish()
    finally:
        receiver.close()
    assert receiver.last_point("loss").as_double == 0.125


@pytest.mark.parametrize("form", ["{base}", "{base}/", "{base}/v1/metrics", "{localhost}"])
def test_good_http_endpoints_still_deliver(tmp_path, http_receiver, clean_otel_env, form):
    localhost = http_receiver.endpoint.replace("127.0.0.1", "localhost")
    endpoint = form.format(base=http_receiver.endpoint, localhost=localhost)
    logger = Logger(_config(tmp_path, {"endpoint": endpoint}))
    logger.log_metrics({"loss": 0.5}, step=0)
    logger.log_metrics({"loss": 0.25}, step=1)
    logger.finish()
    assert http_receiver.last_point("loss").as_double == 0.25
    assert http_receiver.last_point("otel_rl.step").as_int == 1  # the receiver's /v1/metrics


def test_https_endpoint_is_accepted_and_keeps_its_path():
    s = resolve_otlp({"endpoint": "https://otlp.example.com/otlp"}, environ={})
    assert s.endpoint == "https://otlp.example.com/otlp/v1/metrics"
    env = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://gw.example.com/custom"}
    assert resolve_otlp({}, environ=env).endpoint == "https://gw.example.com/custom"


def test_demo_refuses_an_otlp_endpoint_without_a_scheme(tmp_path, capsys):
    from otel_rl.cli.main import main

    argv = ["demo", "--steps", "2", "--log-dir", str(tmp_path), "--backends", "jsonl",
            "--otlp-endpoint", "localhost:4318"]  # fmt: skip
    assert main(argv) == 2
    assert "did you mean 'http://localhost:4318'?" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
