"""Engine endpoints: what ``add_endpoints()`` accepts (the config's rule, item for item), and
credentials in engine URLs (``http://user:secret@host/metrics``), which are used to scrape and
never shown: not in log lines, not in errors, not in the ``file_sd`` file.

The engines are real HTTP servers on 127.0.0.1 (``testkit/rollout_pages.py``), one of which
demands Basic auth.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest

from otel_rl.config.loading import resolve_config
from otel_rl.core.errors import ConfigError
from otel_rl.rollout.monitor import RolloutMonitor
from testkit.otlp_receiver import closed_port
from testkit.rollout_pages import V1_FIRST, V1_LATER, PageServer

SECRET = "s3cr3t-Pa55word"

#: Endpoints to decide on: good ones, and each way of being bad.
CANDIDATES: list[Any] = [
    "10.0.0.5:8000",
    "gen-0.cluster.local:30000",
    "http://10.0.0.6:30000/metrics",
    "https://engines.example/metrics",
    "http://gen-1",  # a URL may leave the port to its scheme
    "[::1]:8000",
    f"http://user:{SECRET}@10.0.0.7:8000/metrics",
    "gen-1",  # a bare host without its port
    "ftp://10.0.0.5:21/metrics",
    "http://",
    "http://10.0.0.5:notaport/metrics",
    "10.0.0.5:99999",
    "",
    "   ",
    8000,
    None,
]


def _config_accepts(endpoint: Any) -> bool:
    try:
        resolve_config({"rollout_monitoring": {"endpoints": [endpoint]}})
    except ConfigError:
        return False
    return True


def _monitor_accepts(endpoint: Any) -> bool:
    monitor = RolloutMonitor([], emit=lambda s, v: None, start=False)
    try:
        monitor.add_endpoints([endpoint])
    except (ValueError, TypeError):
        assert monitor.endpoints == []
        return False
    return True


@pytest.mark.parametrize("endpoint", CANDIDATES, ids=repr)
def test_add_endpoints_accepts_exactly_what_the_config_accepts(endpoint):
    assert _monitor_accepts(endpoint) == _config_accepts(endpoint)


def test_the_verdicts_themselves():
    accepted = [e for e in CANDIDATES if _config_accepts(e)]
    assert accepted == CANDIDATES[:7]


def test_a_refused_endpoint_is_named_without_its_credentials_and_nothing_is_added():
    monitor = RolloutMonitor([], emit=lambda s, v: None, start=False)
    with pytest.raises(ValueError) as refused:
        monitor.add_endpoints(["10.0.0.5:8000", f"ftp://user:{SECRET}@10.0.0.5:21/metrics"])
    assert SECRET not in str(refused.value)
    assert "ftp://***@10.0.0.5:21/metrics" in str(refused.value)
    assert monitor.endpoints == []


# ---- credentials ---------------------------------------------------------------------------------


class Rows:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []
        self.lock = threading.Lock()

    def __call__(self, step: int, values: dict[str, float]) -> None:
        with self.lock:
            self.rows.append((step, values))


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_credentials_are_used_to_scrape_and_never_shown(tmp_path, caplog):
    """Engine 0 wants Basic auth and gets it from its URL (its rows arrive); the same server
    under a wrong password answers 401; a third endpoint with credentials refuses connections.
    Every log line (info included), every error, the engines list and the ``file_sd`` file are
    free of both passwords; the file lists ``host:port``, and one warning says the collector's
    scrape job must bring the credentials."""
    server = PageServer(V1_FIRST, basic_auth=("rollout", SECRET))
    port = server.url.split(":")[2].split("/")[0]
    good = f"http://rollout:{SECRET}@127.0.0.1:{port}/metrics"
    wrong = f"http://rollout:{SECRET}-wrong@127.0.0.1:{port}/other"
    dead = f"http://rollout:{SECRET}@127.0.0.1:{closed_port()}/metrics"
    caplog.set_level(logging.DEBUG, logger="otel_rl")
    clock, rows = Clock(), Rows()
    sd_file = tmp_path / "sd" / "rollout.json"
    monitor = RolloutMonitor([good, wrong], emit=rows, collection_interval=3600, clock=clock)
    try:
        monitor.keep_sd_file(sd_file, {"otel_rl_run_id": "r1"})
        monitor.add_endpoints(dead)
        assert monitor.wait_rounds(1)
        server.page = V1_LATER
        clock.now = 10.0
        monitor.mark_step(3)
        assert monitor.flush()
    finally:
        monitor.close()
        server.close()
    ((step, values),) = rows.rows
    assert step == 3
    assert values["rollout/engine.0.requests_finished"] == 48.0  # scraped with its credentials
    assert values["rollout/engines_reporting"] == 1.0
    import base64

    assert f"Basic {base64.b64encode(f'rollout:{SECRET}'.encode()).decode()}" in (
        server.authorizations
    )
    assert [e.url for e in monitor.engines] == [f"http://***@127.0.0.1:{port}/metrics"]
    assert SECRET not in repr(monitor.endpoints) and len(monitor.endpoints) == 3

    text = sd_file.read_text()
    assert SECRET not in text and "rollout:" not in text
    groups = json.loads(text)
    targets = sorted(t for g in groups for t in g["targets"])
    assert targets == sorted([f"127.0.0.1:{port}", f"127.0.0.1:{port}",
                              dead.split("@")[1].split("/")[0]])  # fmt: skip

    messages = [r.getMessage() for r in caplog.records]
    assert messages, "the failures should have been reported"
    assert not [m for m in messages if SECRET in m], messages
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("HTTP 401" in w and f"http://***@127.0.0.1:{port}/other" in w for w in warnings)
    assert any("connection refused" in w and "***@127.0.0.1" in w for w in warnings)
    assert sum("basic_auth" in w for w in warnings) == 3, warnings  # one per endpoint, once


def test_a_refused_endpoint_in_the_config_is_named_without_its_password():
    from otel_rl import ConfigError
    from otel_rl.config.loading import resolve_config

    with pytest.raises(ConfigError) as refused:
        resolve_config({"rollout_monitoring": {"endpoints": [f"ftp://user:{SECRET}@host:1/x"]}})
    assert SECRET not in str(refused.value) and "ftp://***@host:1/x" in str(refused.value)
