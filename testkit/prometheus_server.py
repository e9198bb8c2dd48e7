"""A real Prometheus server (Debian's ``prometheus`` package) on 127.0.0.1, for tests.

It scrapes the given targets every second and answers PromQL over its HTTP API. Outside CI a
machine without the binary skips the tests that need it; in CI (``CI=true``) that is a failure,
because .ci/run installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest


def prometheus_binary() -> str:
    """The path of ``prometheus``; skips (or fails in CI) when it is not installed."""
    path = shutil.which("prometheus")
    if path:
        return path
    reason = "the prometheus binary is not installed (apt-get install prometheus)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason}; .ci/run must install it")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """``prometheus`` as a subprocess with a temp config, TSDB and log."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[str] = (),
        job: str = "otel-rl",
        file_sd: Sequence[Path] = (),
        scrape_configs: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        """``file_sd``: Prometheus ``file_sd`` files (e.g. the one a Logger keeps for its
        inference engines), scraped by a second job. ``scrape_configs``: jobs as they are (the
        collector's own), instead of the two above."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        text = (
            "global:\n"
            "  scrape_interval: 1s\n"
            "  evaluation_interval: 1s\n"
            "scrape_configs:\n"
            f"  - job_name: {job}\n"
            "    static_configs:\n"
            f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
        )
        if file_sd:
            text += (
                "  - job_name: file-sd\n"
                "    file_sd_configs:\n"
                f"      - files: [{', '.join(repr(str(f)) for f in file_sd)}]\n"
                "        refresh_interval: 1s\n"
            )
        if scrape_configs is not None:
            import yaml

            text = yaml.safe_dump({"global": {"scrape_interval": "1s"},
                                   "scrape_configs": list(scrape_configs)})  # fmt: skip
        config.write_text(text)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as log:
            self.process = subprocess.Popen(
                [
                    prometheus_binary(),
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--web.enable-lifecycle",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
            )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready in {timeout}s: {self.log.read_text()[-2000:]}")

    def wait_scraped(self, timeout: float = 30.0) -> None:
        """Wait for the first successful scrape of every target (Prometheus applies new targets
        on a 5 s tick, so the first scrape comes a few seconds after it is ready)."""
        self.wait_for("up", lambda r: r and all(s["value"][1] == "1" for s in r), timeout)

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query; returns the result vector (raises if Prometheus reports an error)."""
        params = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{params}", timeout=5) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise AssertionError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(self, promql: str, predicate: Any, timeout: float = 20.0) -> list[dict]:
        """Poll ``promql`` until ``predicate(result)`` holds; returns that result."""
        deadline = time.monotonic() + timeout
        result: list[dict] = []
        while time.monotonic() < deadline:
            result = self.query(promql)
            if predicate(result):
                return result
            time.sleep(0.25)
        raise AssertionError(f"{promql!r} never satisfied the condition; last result {result}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
