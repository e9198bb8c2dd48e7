"""What the Logger's own ``/metrics`` page serves of logged keys, read over real HTTP: which of
two keys that make one Prometheus name it is, a key whose first value was text, and the page's
address on an IPv6 host."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import urllib.request

import pytest

from otel_rl import Logger

_COLLIDING = textwrap.dedent("""
    import json, logging, sys, urllib.request
    from otel_rl import Logger
    said = []
    logging.getLogger("otel_rl").addHandler(type("H", (logging.Handler,), {
        "emit": lambda self, record: said.append(record.getMessage())})())
    logger = Logger({"log_dir": sys.argv[1], "prometheus": {"enabled": True, "port": 0}})
    logger.log_metrics({"train/loss": 1.0, "train.loss": 2.0, "Train_Loss": 3.0}, step=0)
    page = urllib.request.urlopen(logger.prometheus_url, timeout=10).read().decode()
    logger.finish()
    served = [line for line in page.splitlines() if line.startswith("train_loss")]
    print(json.dumps({"served": served, "said": [m for m in said if "collides" in m]}))
""")


def _page(logger: Logger) -> list[str]:
    with urllib.request.urlopen(logger.prometheus_url, timeout=10) as response:
        return response.read().decode().splitlines()


def test_of_keys_that_make_one_prometheus_name_the_first_in_the_call_is_served(tmp_path):
    """Whatever the interpreter's hash seed (which key won changed from launch to launch, and
    between the ranks of one job): the first key of the call is the series, the others are
    said and reach the trackers only."""
    seen = set()
    for seed in ("1", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": os.pathsep.join(sys.path)}
        done = subprocess.run([sys.executable, "-c", _COLLIDING, str(tmp_path / seed)], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert [line.split()[-1] for line in out["served"]] == ["1.0"], out
        assert len(out["said"]) == 2 and all("'train/loss'" in m for m in out["said"]), out
        seen.add(tuple(out["said"]))
    assert len(seen) == 1  # the same words at every seed


def test_a_key_whose_first_value_was_text_is_served_once_it_is_a_number(tmp_path):
    """``status`` is text at step 0, then a number: the page serves the latest number (it
    served nothing, unsaid, for the whole run)."""
    cfg = {"log_dir": str(tmp_path), "prometheus": {"enabled": True, "port": 0}}
    with Logger(cfg) as logger:
        logger.log_metrics({"status": "warming up", "loss": 1.0}, step=0)
        assert not [line for line in _page(logger) if line.startswith("status")]
        for step in range(1, 4):
            logger.log_metrics({"status": float(step), "loss": 1.0 / step}, step=step)
        served = [line for line in _page(logger) if line.startswith("status")]
    assert [line.split()[-1] for line in served] == ["3.0"]


def test_the_page_s_address_on_an_ipv6_host_is_a_url(tmp_path):
    """``prometheus.host: ::1``: ``Logger.prometheus_url`` brackets the address, so that HTTP
    clients read it (``http://::1:PORT/metrics`` was no URL)."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("::1 cannot be bound here")
    cfg = {"log_dir": str(tmp_path), "prometheus": {"enabled": True, "port": 0, "host": "::1"}}
    with Logger(cfg) as logger:
        logger.log_metrics({"loss": 0.5}, step=0)
        assert logger.prometheus_url.startswith("http://[::1]:")
        served = [line for line in _page(logger) if line.startswith("loss")]
    assert [line.split()[-1] for line in served] == ["0.5"]
