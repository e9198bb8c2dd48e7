"""The verdict's whole sentence for each kind of wait, pinned: the training thread (this test's
main thread, inside a timer) really waits on a real queue, event, future, thread, lock, asyncio
task, subprocess, HTTP server that never answers, ``torch.distributed`` rendezvous or line of
busy code, and the verdict is built on another thread as the stall watchdog builds it. Times,
line numbers, ports and pids are replaced by placeholders; every other word is compared.

A Ray wait is pinned by the real two-node cluster tests of ``test_verdict.py`` (the task, its
actor, what it runs), a collective's odd rank by ``test_job_verdict.py`` (real gloo ranks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import pytest

from otel_rl.telemetry.timing import PhaseTimer
from otel_rl.watch.stalls import StallReport
from otel_rl.watch.verdict import build_verdict
from testkit.servers import free_port
from tests.sources.test_verdict import SilentServer

#: Placeholders for what changes from run to run.
_VARIABLE = [
    (re.compile(r"\d+(\.\d+)? (ms|s|min|h)\b"), "<t>"),
    (re.compile(r"\.py:\d+"), ".py:<n>"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:<port>"),
    (re.compile(r"pid \d+"), "pid <pid>"),
    (re.compile(re.escape(sys.executable)), "<python>"),
    (re.compile(r"Task-\d+"), "Task-<n>"),  # asyncio numbers the tasks of the process
]


def _said(text: str) -> str:
    for pattern, placeholder in _VARIABLE:
        text = pattern.sub(placeholder, text)
    return text


def _verdict_of(
    name: str,
    wait: Callable[[], Any],
    release: Callable[[], None],
    engines: Callable[[], Sequence[dict[str, Any]]] | None = None,
    after: float = 0.6,
) -> str:
    """The verdict's text while this thread runs ``wait()`` inside a timer ``name`` (a name of
    its own: the phase history is the process's), built ``after`` seconds in; then
    ``release()``."""
    made: list[Any] = []

    def judge() -> None:
        try:
            time.sleep(after)
            report = StallReport(run_id="golden", step=3, began=time.time(), since_step=12.0,
                                 threshold=10.0, threshold_reason="10 x p95")  # fmt: skip
            made.append(build_verdict(report, engines=engines, skip=threading.get_ident()))
        finally:
            release()

    judging = threading.Thread(target=judge, name="judge")
    judging.start()
    with PhaseTimer(lambda _: None, f"timing/{name}", name), contextlib.suppress(Exception):
        wait()
    judging.join(60)
    assert made, "no verdict made"
    return _said(made[0].text)


def test_a_queue():
    waiting: queue.Queue[int] = queue.Queue()
    said = _verdict_of("golden_queue", lambda: waiting.get(timeout=30), lambda: waiting.put(1))
    assert said == (
        "the training process waits in golden_queue (<t>; never completed before) on Queue.get "
        "(0 items queued)"
    )


def test_an_event_a_future_and_a_thread():
    event = threading.Event()
    said = _verdict_of("golden_event", lambda: event.wait(30), event.set)
    assert said == "the training process waits in golden_event (<t>; never completed before) " \
                   "on Event.wait"  # fmt: skip
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    said = _verdict_of("golden_future", lambda: future.result(30), lambda: future.set_result(1))
    assert said == "the training process waits in golden_future (<t>; never completed before) " \
                   "on concurrent.futures Future.result"  # fmt: skip
    done = threading.Event()
    worker = threading.Thread(target=done.wait, args=(30,), name="loader")
    worker.start()
    said = _verdict_of("golden_join", lambda: worker.join(30), done.set)
    assert said == "the training process waits in golden_join (<t>; never completed before) " \
                   "on Thread.join of thread 'loader'"  # fmt: skip


def _hold(guard: threading.Lock, until: threading.Event) -> threading.Thread:
    held = threading.Event()

    def sync_weights() -> None:
        with guard:
            held.set()
            until.wait(30)

    holder = threading.Thread(target=sync_weights, name="weight-sync")
    holder.start()
    held.wait(10)
    return holder


def test_a_lock_and_the_thread_that_holds_it():
    guard, release = threading.Lock(), threading.Event()
    holder = _hold(guard, release)

    def take() -> None:
        with guard:
            pass

    said = _verdict_of("golden_lock", take, release.set)
    holder.join(30)
    assert said == (
        "the training process waits in golden_lock (<t>; never completed before) on a lock at "
        "take (test_verdict_golden.py:<n>): with guard: → thread 'weight-sync' holds it (with "
        "guard: at sync_weights (test_verdict_golden.py:<n>)) and waits on Event.wait"
    )


def test_an_asyncio_task():
    stop = threading.Event()

    async def score_the_rollouts() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.05)

    said = _verdict_of("golden_asyncio", lambda: asyncio.run(score_the_rollouts()), stop.set)
    assert said == (
        "the training process waits in golden_asyncio (<t>; never completed before) on sleep in "
        "asyncio task 'Task-<n>' at score_the_rollouts (test_verdict_golden.py:<n>): await "
        "asyncio.sleep(0.05)"
    )


def test_a_subprocess():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    said = _verdict_of("golden_child", lambda: child.wait(30), child.kill)
    assert said == (
        "the training process waits in golden_child (<t>; never completed before) on "
        "subprocess <python> -c 'import time; time.sleep(60)' (pid <pid>)"
    )


@pytest.mark.slow  # a request that never gets an answer, and the server's threads
def test_an_http_server_that_never_answers_and_its_engine():
    import requests

    server = SilentServer()
    url = f"http://127.0.0.1:{server.port}/v1/completions"

    def engines() -> list[dict[str, Any]]:
        return [{"url": f"http://127.0.0.1:{server.port}", "label": "engine-0", "running": 7.0,
                 "finished": 0.0, "window_seconds": 30.0, "seconds_ago": 1.5}]  # fmt: skip

    said = _verdict_of("golden_http", lambda: requests.post(url, json={}, timeout=30),
                       server.hang_up, engines=engines)  # fmt: skip
    assert said == (
        "the training process waits in golden_http (<t>; never completed before) on HTTP POST "
        "http://127.0.0.1:<port>/v1/completions → engine http://127.0.0.1:<port> engine=engine-0: "
        "7 running, 0 finished in <t>"
    )


def test_busy_code():
    stop = threading.Event()

    def compute_the_reward() -> None:
        while not stop.is_set():
            sum(range(1_000))

    said = _verdict_of("golden_code", compute_the_reward, stop.set)
    assert re.fullmatch(
        r"the training process is in golden_code \(<t>; never completed before\) at "
        r"compute_the_reward \(test_verdict_golden\.py:<n>\): "
        r"(while not stop\.is_set\(\):|sum\(range\(1_000\)\))",
        said,
    ), said


@pytest.mark.slow  # importing torch takes seconds
def test_a_collective_rendezvous_with_no_job_verdict():
    """The one rank of two that came: it waits in ``init_process_group`` for the other."""
    dist = pytest.importorskip("torch.distributed")
    port = free_port()

    def join() -> None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=2, timeout=timedelta(seconds=3))  # fmt: skip

    said = _verdict_of("golden_collective", join, lambda: None)
    assert said == (
        "the training process waits in golden_collective (<t>; never completed before) on "
        "torch.distributed.init_process_group; not known: which rank has not joined it (each "
        "rank's own stall report says where that rank is)"
    )
