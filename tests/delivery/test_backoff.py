"""A failing tracker is retried on its backoff, a deadline that records arriving meanwhile do not
cut short, and a server's ``Retry-After`` is honoured.

The trackers here are real ``Tracker`` subclasses: one raises ``ConnectionError`` for its first
seconds (no tracker SDK fails on demand), the other POSTs each step to a real HTTP server on
127.0.0.1 that answers its first request 503 with ``Retry-After``.
"""

from __future__ import annotations

import email.message
import email.utils
import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from otel_rl import Logger
from otel_rl.core.failures import RETRY_AFTER_CAP, Failure, classify, retry_after_of, retry_wait
from otel_rl.delivery.tracker import Tracker


class DownThenUp(Tracker):
    """Raises ``ConnectionError`` until ``down_for`` seconds after its first attempt, keeping the
    monotonic time of every attempt."""

    name = "down_then_up"

    def __init__(self, down_for: float) -> None:
        self.down_for = down_for
        self.up_at: float | None = None
        self.attempts: list[float] = []
        self.failed = 0
        self.steps: list[int] = []

    def write_step(self, step, rows, batch):
        now = time.monotonic()
        self.attempts.append(now)
        if self.up_at is None:
            self.up_at = now + self.down_for
        if now < self.up_at:
            self.failed += 1
            raise ConnectionError("the tracker's server is down")
        self.steps.append(step)


@pytest.mark.slow
def test_a_failing_tracker_is_retried_on_its_backoff_while_the_loop_keeps_logging(tmp_path):
    """Down for 2 s while the loop logs a step every 10 ms: the k-th retry comes no sooner than
    the lower bound of its jittered backoff (half of min(0.05 s x 2^(k-1),
    retry_max_backoff)), whatever the records arriving meanwhile; then every step arrives once,
    in order."""
    tracker = DownThenUp(down_for=2.0)
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": False,
                     "export": {"retry_max_backoff": 1.0}}, exporters=[tracker])  # fmt: skip
    steps = 300
    for step in range(steps):
        logger.log_metrics({"x": float(step)}, step=step)
        time.sleep(0.01)
    assert tracker.up_at is not None and time.monotonic() > tracker.up_at  # down while logging
    assert logger.flush(timeout=60)
    logger.finish()

    retried = tracker.attempts[: tracker.failed + 1]  # every failed attempt and the one after
    gaps = [later - earlier for earlier, later in itertools.pairwise(retried)]
    floors = [0.5 * min(0.05 * 2**k, 1.0) for k in range(len(gaps))]
    assert all(gap >= floor for gap, floor in zip(gaps, floors, strict=True)), (gaps, floors)
    # Down for 2 s, the shortest jittered waits (25, 50, 100, 200, 400 ms, then 500 ms) allow 8
    # attempts; the loop logged some 200 records meanwhile.
    assert 2 <= tracker.failed <= 9, tracker.failed
    assert tracker.steps == list(range(steps))
    stats = logger.exporters[0].stats
    assert stats["retries"] == tracker.failed and stats["delivered"] == steps


class _Throttled(ConnectionError):
    """A tracker's own error that says when to come back (seconds)."""

    retry_after = 30.0


class BusyUntilUp(Tracker):
    """Asks to be left alone for 30 s at every write until ``up`` is set."""

    name = "busy_until_up"

    def __init__(self) -> None:
        self.up = threading.Event()
        self.failed = 0
        self.steps: list[int] = []

    def write_step(self, step, rows, batch):
        if not self.up.is_set():
            self.failed += 1
            raise _Throttled("slow down")
        self.steps.append(step)


def test_the_shutdown_brings_one_retry_forward_for_a_tracker_back_by_then(tmp_path):
    """The tracker asks for 30 s at its first write; records keep coming meanwhile and bring
    no retry forward. It is back when ``finish()`` begins (deadline 20 s): the shutdown's start
    ends the wait, and every step arrives before the deadline."""
    tracker = BusyUntilUp()
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": False,
                     "export": {"shutdown_timeout": 20}}, exporters=[tracker])  # fmt: skip
    logger.log_metrics({"x": 0.0}, step=0)
    logger.log_metrics({"x": 1.0}, step=1)  # step 0 is sealed and sent
    deadline = time.monotonic() + 60
    while tracker.failed == 0:
        assert time.monotonic() < deadline, "the tracker was never tried"
        time.sleep(0.01)
    for step in range(2, 40):
        logger.log_metrics({"x": float(step)}, step=step)
        time.sleep(0.01)
    tracker.up.set()
    logger.finish()
    assert tracker.failed == 1
    assert tracker.steps == list(range(40))
    assert logger.exporters[0].undelivered == 0


class _Busy(BaseHTTPRequestHandler):
    """Answers its server's first POST 503 with ``Retry-After: 2``, the others 200; keeps the
    time and body of each."""

    server: _Recording

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        server = self.server
        with server.lock:
            server.times.append(time.monotonic())
            first = len(server.times) == 1
            if not first:
                server.bodies.append(json.loads(body))
        self.send_response(503 if first else 200)
        if first:
            self.send_header("Retry-After", "2")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format, *args):
        pass


class _Recording(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Busy)
        self.lock = threading.Lock()
        self.times: list[float] = []
        self.bodies: list[dict] = []


class Posting(Tracker):
    """POSTs each step to ``url`` (urllib: a 503 raises ``HTTPError`` with the headers)."""

    name = "posting"

    def __init__(self, url: str) -> None:
        self.url = url

    def write_step(self, step, rows, batch):
        data = json.dumps({"step": step, "rows": dict(rows)}).encode()
        request = urllib.request.Request(self.url, data=data, method="POST")
        with urllib.request.urlopen(request, timeout=30):
            pass


@pytest.mark.slow
def test_a_servers_retry_after_is_honoured_while_records_keep_arriving(tmp_path):
    """The server answers 503 with ``Retry-After: 2``: the next request comes 2 s later or more,
    though ``retry_max_backoff`` is 0.2 s and the loop logs a step every 10 ms meanwhile; then
    every step arrives once, in order."""
    server = _Recording()
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        tracker = Posting(f"http://127.0.0.1:{server.server_address[1]}/log")
        logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": False,
                         "export": {"retry_max_backoff": 0.2}}, exporters=[tracker])  # fmt: skip
        steps = 250
        for step in range(steps):
            logger.log_metrics({"x": float(step)}, step=step)
            time.sleep(0.01)
        assert logger.flush(timeout=60)
        logger.finish()
    finally:
        server.shutdown()
        server.server_close()
    assert server.times[1] - server.times[0] >= 2.0, server.times[:3]
    assert [body["step"] for body in server.bodies] == list(range(steps))
    assert server.bodies[7]["rows"] == {"x": 7.0}


def _http_error(status: int, retry_after: str | None) -> urllib.error.HTTPError:
    headers = email.message.Message()
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return urllib.error.HTTPError("http://127.0.0.1/x", status, "busy", headers, None)


def test_retry_after_is_read_in_seconds_or_as_a_date_from_the_errors_of_common_clients():
    """urllib's ``HTTPError`` carries the headers itself, requests' error its response; a
    tracker's own error may carry ``retry_after`` in seconds. A date is counted from now (one
    in the past: at once); a value that is neither is ignored."""
    assert retry_after_of(_http_error(503, "2")) == 2.0
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 28.0 <= (retry_after_of(_http_error(429, later)) or 0.0) <= 30.0
    earlier = email.utils.formatdate(time.time() - 30, usegmt=True)
    assert retry_after_of(_http_error(503, earlier)) == 0.0
    for bad in ("soon", "-5", "nan", "inf", ""):
        assert retry_after_of(_http_error(503, bad)) is None, bad
    assert retry_after_of(_http_error(503, None)) is None

    response = requests.Response()
    response.status_code = 429
    response.headers["retry-after"] = "7"
    failure = classify(requests.HTTPError("429 Too Many Requests", response=response),
                       "write", "t")  # fmt: skip
    assert failure.kind == "transient" and failure.retry_after == 7.0

    class Throttled(ConnectionError):
        retry_after = 1.5

    assert classify(Throttled("slow down"), "write", "t").retry_after == 1.5
    assert classify(ConnectionRefusedError("down"), "write", "t").retry_after is None
    # Only a retry waits: a permanent failure keeps none.
    assert classify(_http_error(403, "5"), "write", "t").retry_after is None


def test_the_wait_before_a_retry_honours_retry_after_up_to_its_cap():
    """The jittered backoff, or the server's ``Retry-After`` when longer, up to one minute (or
    ``retry_max_backoff`` when that is longer)."""
    plain = Failure("transient", ConnectionError("down"))
    waits = [retry_wait(0.4, plain, 10.0) for _ in range(200)]
    assert all(0.2 <= w <= 0.4 for w in waits) and len(set(waits)) > 1
    two = Failure("transient", ConnectionError("busy"), retry_after=2.0)
    assert retry_wait(0.05, two, 0.2) == 2.0
    assert retry_wait(8.0, Failure("transient", ConnectionError("busy"), retry_after=0.1),
                      10.0) >= 4.0  # fmt: skip
    hour = Failure("transient", ConnectionError("busy"), retry_after=3600.0)
    assert RETRY_AFTER_CAP == 60.0
    assert retry_wait(0.05, hour, 10.0) == 60.0
    assert retry_wait(0.05, hour, 300.0) == 300.0
