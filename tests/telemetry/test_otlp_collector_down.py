"""An OTLP collector that is down costs one warning and a counter, not the SDK's error lines at
every export; when it comes back, one line says so and the data arrives.

Each run is a real training process (a subprocess whose stderr is read line by line) pushing to
a port nothing listens on; the collector coming back is a real OTLP/HTTP receiver started on
that port. The application's own OTLP exporters keep the SDK's lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.otlp_receiver import OtlpHttpReceiver, closed_port
from testkit.otlp_trace_receiver import OtlpTraceReceiver

pytestmark = pytest.mark.slow

#: Generous: a loaded 2-core machine, a Python process starting, retries of 1 s and 2 s.
DEADLINE_S = 120.0

CHILD = r"""
import json, sys, threading, time

from otel_rl import Logger

cfg = json.loads(sys.argv[1])
run_for = float(sys.argv[2])
theirs = sys.argv[3]
if theirs:  # the application's own OTLP exporter, to a collector that is down too
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    app = MeterProvider([PeriodicExportingMetricReader(
        OTLPMetricExporter(endpoint=theirs, timeout=5), export_interval_millis=500)])
    app.get_meter("app").create_counter("app.requests").add(1)
logger = Logger(cfg)
print(json.dumps({"prometheus": logger.prometheus_url}), flush=True)
told = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), told.set()), daemon=True).start()
start, step, said = time.monotonic(), 0, False
while not told.is_set():
    with logger.timer("generation"):
        time.sleep(0.02)
    logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    step += 1
    if not said and time.monotonic() - start >= run_for:
        print("ran", flush=True)
        said = True
logger.finish()
if theirs:
    app.shutdown()
print("finished", flush=True)
"""


class Run:
    """The training process; its stdout and stderr lines as they come."""

    def __init__(self, tmp_path: Path, cfg: dict[str, Any], run_for: float, theirs: str = ""):
        script = tmp_path / "train.py"
        script.write_text(CHILD)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(cfg), str(run_for), theirs],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=env,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._cond = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(stream, lines), daemon=True)
            for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: Any, lines: list[str]) -> None:
        for line in stream:
            with self._cond:
                lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:  # the process is gone: a wait for a line stops waiting
            self._cond.notify_all()

    def wait(self, lines: list[str], found: Callable[[str], bool]) -> str:
        with self._cond:
            self._cond.wait_for(
                lambda: any(found(x) for x in lines) or self.proc.poll() is not None, DEADLINE_S
            )
            hits = [x for x in lines if found(x)]
        assert hits, f"not seen; stdout {self.out}, stderr {self.err}"
        return hits[0]

    def prometheus_url(self) -> str:
        return str(json.loads(self.wait(self.out, lambda x: x.startswith("{")))["prometheus"])

    def finish(self) -> list[str]:
        """Tell the loop to stop, wait for ``finish()`` and the exit; the stderr lines."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("finish\n")
        self.proc.stdin.flush()
        assert self.proc.wait(DEADLINE_S) == 0, self.err
        for reader in self._readers:
            reader.join(DEADLINE_S)
        assert self.out[-1] == "finished", (self.out, self.err)
        return [x for x in self.err if x.strip()]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(DEADLINE_S)


def _config(tmp_path: Path, endpoint: str, **otlp: Any) -> dict[str, Any]:
    return {
        "log_dir": str(tmp_path / "logs"),
        "jsonl_enabled": False,
        "prometheus": {"enabled": True, "port": 0},
        "otlp": {"enabled": True, "endpoint": endpoint, "interval": 1, **otlp},
    }


def _failures_counted(prometheus_url: str) -> float:
    with urllib.request.urlopen(prometheus_url, timeout=30) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "otel_rl_otlp_export_failures_total":
                return float(sample.value)
    raise AssertionError(f"no otel_rl_otlp_export_failures_total in\n{text}")


def _serve_on(port: int, server: ThreadingHTTPServer) -> ThreadingHTTPServer:
    """The receiver behind ``server`` listening on ``port`` too: the collector comes back."""
    back = ThreadingHTTPServer(("127.0.0.1", port), server.RequestHandlerClass)
    threading.Thread(target=back.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return back


def _warning_pattern(endpoint: str, signal: str = "metrics") -> str:
    return (
        rf"otel-rl: OTLP export of {signal} to {re.escape(endpoint)}\S* failed: .*[Cc]onnection "
        r"refused.*\. Training goes on; otel-rl keeps retrying \(every 1 s\) without a line per "
        r"failure, counts the failures in otel_rl_otlp_export_failures_total, and says when the "
        r"collector is reachable again"
    )


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_a_collector_down_for_the_whole_run_costs_one_warning_and_a_counter(tmp_path, protocol):
    endpoint = f"http://127.0.0.1:{closed_port()}"
    run = Run(tmp_path, _config(tmp_path, endpoint, protocol=protocol), run_for=10)
    try:
        url = run.prometheus_url()
        run.wait(run.out, lambda x: x == "ran")
        failures = _failures_counted(url)
        lines = run.finish()  # finish() exports once more, to the same dead collector
    finally:
        run.kill()
    assert len(lines) == 1, lines
    assert re.fullmatch(_warning_pattern(endpoint), lines[0]), lines[0]
    # Both providers' readers export every second; each failed export is counted.
    assert failures >= 2


def test_when_the_collector_comes_back_one_line_says_so_and_the_data_arrives(tmp_path):
    port = closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    run = Run(tmp_path, _config(tmp_path, endpoint), run_for=0)
    receiver = OtlpHttpReceiver()
    back = None
    try:
        run.wait(run.err, lambda x: "OTLP export of metrics" in x)
        back = _serve_on(port, receiver.server)
        run.wait(run.err, lambda x: "reachable again" in x)
        deadline = time.monotonic() + DEADLINE_S
        wanted = {"loss", "otel_rl.otlp.export.failures"}
        while not wanted <= receiver.names() and time.monotonic() < deadline:
            time.sleep(0.1)
        lines = run.finish()
    finally:
        run.kill()
        if back is not None:
            back.shutdown()
            back.server_close()
        receiver.close()
    assert wanted <= receiver.names(), receiver.names()
    assert receiver.last_point("otel_rl.otlp.export.failures").as_int >= 1
    assert len(lines) == 2, lines
    assert re.fullmatch(_warning_pattern(endpoint), lines[0]), lines[0]
    assert re.fullmatch(
        rf"otel-rl: OTLP collector at {re.escape(endpoint)}/v1/metrics reachable again "
        r"\([1-9][0-9]* exports had failed\)",
        lines[1],
    ), lines[1]


def test_spans_to_a_collector_that_is_down_add_no_line_of_their_own(tmp_path):
    """With tracing, the run's spans go to the same collector: still one warning, and one line
    when it is back (spans and metrics both delivered again)."""
    port = closed_port()
    endpoint = f"http://127.0.0.1:{port}"
    cfg = {**_config(tmp_path, endpoint), "tracing": {"enabled": True}}
    run = Run(tmp_path, cfg, run_for=10)  # the span processor exports every 5 s
    receiver = OtlpTraceReceiver()  # takes /v1/traces, accepts /v1/metrics
    back = None
    try:
        run.wait(run.out, lambda x: x == "ran")
        back = _serve_on(port, receiver.server)
        assert receiver.wait_for(1, DEADLINE_S)
        run.wait(run.err, lambda x: "reachable again" in x)
        lines = run.finish()
    finally:
        run.kill()
        if back is not None:
            back.shutdown()
            back.server_close()
        receiver.close()
    assert {span.name for _, span in receiver.spans} >= {"rl.step", "generation"}
    assert len(lines) == 2, lines
    assert lines[0].startswith("otel-rl: OTLP export of ") and f"to {endpoint}/v1/" in lines[0]
    assert "reachable again" in lines[1] and lines[1].startswith(
        f"otel-rl: OTLP collector at {endpoint}/v1/"
    )


def test_the_applications_own_otlp_exporter_keeps_its_sdk_lines(tmp_path):
    ours = closed_port()
    theirs = closed_port()
    while theirs == ours:
        theirs = closed_port()
    endpoint = f"http://127.0.0.1:{ours}"
    run = Run(
        tmp_path,
        _config(tmp_path, endpoint),
        run_for=0,
        theirs=f"http://127.0.0.1:{theirs}/v1/metrics",
    )
    try:
        run.wait(run.err, lambda x: x.startswith("otel-rl: OTLP export of metrics"))
        run.wait(run.err, lambda x: x.startswith("Transient error") and f"port={theirs}" in x)
        lines = run.finish()
    finally:
        run.kill()
    about_ours = [x for x in lines if str(ours) in x]
    assert len(about_ours) == 1 and re.fullmatch(_warning_pattern(endpoint), about_ours[0])
    # the SDK still speaks for the application's exporter, on the same logger
    assert [x for x in lines if x.startswith("Transient error") and f"port={theirs}" in x]


@pytest.mark.slow
def test_spans_failing_after_the_metrics_shut_down_add_no_warning(tmp_path):
    """With tracing, the spans are sent at finish(), after the metric exporters shut down while
    failing: the collector is still the one already said to be down."""
    script = textwrap.dedent(f"""
        import time
        from otel_rl import Logger
        logger = Logger({{"log_dir": {str(tmp_path)!r}, "tracing": {{"enabled": True}},
                         "otlp": {{"enabled": True, "endpoint": "http://127.0.0.1:{closed_port()}",
                                  "interval": 1, "timeout": 1}}}})
        for step in range(3):
            with logger.timer("gen"):
                time.sleep(0.3)
            logger.log_metrics({{"x": 1.0}}, step=step)
        time.sleep(2)
        logger.finish()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "OTLP export of metrics" in lines[0], lines
