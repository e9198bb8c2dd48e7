"""Regressions of the delivery, spool and replay promises, each reproduced as a user hit it.

The small exporters here stand for trackers that are slow, raising or refusing on demand, which
no real tracker SDK does when asked; JSONL and TensorBoard are real and read back.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from otel_rl import Logger
from otel_rl.core.records import StepBatch
from otel_rl.delivery.spool import Spool, read_acks, spool_root, undelivered
from otel_rl.exporters.base import TrackerExporter
from testkit.readers import jsonl_rows, tensorboard_scalars

REPLAY = [sys.executable, "-m", "otel_rl.cli", "replay"]


class Recording(TrackerExporter):
    """Keeps what it was given; ``fail`` decides per call (stands for a tracker misbehaving)."""

    name = "recording"

    def __init__(self, fail=None, max_batch: int = 1, **kwargs):
        self.steps: list[int] = []
        self.calls = 0
        self.opened = 0
        self.fail = fail
        self.max_batch = max_batch
        super().__init__(**kwargs)

    def open(self):
        self.opened += 1

    def write_step(self, step, rows, batch):
        self.calls += 1
        if self.fail is not None:
            self.fail(step)
        self.steps.append(step)


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_the_step_being_logged_survives_a_kill_during_the_next_long_step(tmp_path):
    """Item 1: log steps 0-9, stay in step 10's work for 3 s, SIGKILL; replay gives 0-9 and the
    calls already made for step 10 (checkpointed within export.fsync_interval)."""
    log_dir = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import time
        from otel_rl import Logger
        logger = Logger({{"log_dir": {str(log_dir)!r}, "tensorboard_enabled": True,
                          "export": {{"fsync_interval": 0.2}}}})
        for step in range(10):
            logger.log_metrics({{"loss": step / 10}}, step=step)
        logger.log_metrics({{"reward": 7.0}}, step=10)  # step 10 has begun
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # well beyond fsync_interval
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    out = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(11))
    assert rows[10]["metrics"] == {"reward": 7.0}
    assert [s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["loss"]] == list(range(10))
    assert tensorboard_scalars(log_dir / "tensorboard")["reward"] == [(10, 7.0)]
    again = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == list(range(11))


def test_a_sealed_step_supersedes_its_checkpoint(tmp_path):
    """A checkpoint of step 3 followed by the sealed step 3 (more keys): replay sends the
    sealed one only."""
    tracker = Recording(spool_dir=tmp_path / "spool", fsync_interval=0.05)
    logger = Logger({"log_dir": str(tmp_path / "logs"), "jsonl_enabled": True,
                     "export": {"fsync_interval": 0.05}}, exporters=[tracker])
    logger.log_metrics({"a": 1.0}, step=3)
    time.sleep(0.3)  # a checkpoint of step 3 is taken
    logger.log_metrics({"b": 2.0}, step=3)
    logger.finish()
    assert tracker.steps == [3]
    spool = next(spool_root(tmp_path / "logs").glob("jsonl/*"))
    lines = [json.loads(line) for p in sorted(spool.glob("wal-*")) for line in p.open()]
    assert any(line.get("provisional") for line in lines)  # the checkpoint reached the spool
    assert undelivered(spool) == []  # and is done once the sealed step is delivered
    assert [r["metrics"] for r in jsonl_rows(tmp_path / "logs" / "metrics.jsonl")] == [
        {"a": 1.0, "b": 2.0}
    ]


def test_worker_survives_a_spool_segment_vanishing_under_a_backlog(tmp_path, otel_rl_warnings):
    """Item 2: the worker reads a backlog back from disk; a segment it reads is deleted under
    it. The worker reports once and goes on: later records still arrive."""
    gate = threading.Event()
    tracker = Recording(fail=lambda step: gate.wait(), spool_dir=tmp_path / "spool",
                        queue_size=5, fsync_interval=0.05)
    tracker.delivery.start()
    for step in range(50):
        tracker.delivery.submit(StepBatch(step=step, values={"x": float(step)}))
    _wait(lambda: tracker.delivery.stats["spilled"] > 0 and tracker.delivery.pending >= 49)
    for segment in (tmp_path / "spool").glob("wal-*"):
        segment.unlink()  # what a concurrent deletion did to the worker
    gate.set()
    _wait(lambda: len(tracker.steps) >= 5)
    for step in range(50, 60):
        tracker.delivery.submit(StepBatch(step=step, values={"x": float(step)}))
    _wait(lambda: tracker.steps[-1:] == [59])
    tracker.shutdown(timeout_millis=5_000)
    assert tracker.steps[:5] == [0, 1, 2, 3, 4]
    assert tracker.steps[-10:] == list(range(50, 60))
    # what vanished (the records that lived on disk only) is counted and named
    assert tracker.delivery.stats["dropped"] == 60 - len(tracker.steps) > 0
    assert any("vanished" in m for m in otel_rl_warnings.messages)
    assert threading.active_count() < 50


def test_worker_thread_never_dies(tmp_path, otel_rl_warnings):
    """Item 2: an error of ours inside the delivery loop is reported once; delivery goes on.
    The bug is injected into the delivery's own loop: nothing public can break it."""
    tracker = Recording()
    tracker.delivery.start()
    queue = tracker.delivery._records
    original = queue.take_locked
    broken = {"left": 3}

    def take_locked():
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("bug in the loop")
        return original()

    queue.take_locked = take_locked
    for step in range(5):
        tracker.delivery.submit(StepBatch(step=step, values={"x": 1.0}))
    assert tracker.force_flush(10_000)
    tracker.shutdown()
    assert tracker.steps == [0, 1, 2, 3, 4]
    messages = [r.getMessage() for r in otel_rl_warnings.records]
    assert sum("internal error in the delivery loop" in m for m in messages) == 1


def test_finish_cut_by_the_timeout_then_replay_sends_nothing_twice(tmp_path):
    """Item 3a: a slow tracker, finish() cut by export.shutdown_timeout, then replay: every
    step exactly once."""
    from tests.faults.fault_tracker import env_with_faultfile, read_rows, set_mode

    log_dir = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import logging
        from otel_rl import Logger
        from tests.faults.fault_tracker import set_mode
        logging.basicConfig()
        cfg = {{"log_dir": {str(log_dir)!r}, "jsonl_enabled": True,
               "trackers": {{"faultfile": {{"path": {str(tmp_path / "rows.jsonl")!r},
                                            "control": {str(tmp_path / "control")!r}}}}},
               "export": {{"shutdown_timeout": 1.0, "fsync_interval": 0.1}}}}
        set_mode({str(tmp_path / "control")!r}, "slow 0.2")
        with Logger(cfg) as logger:
            for step in range(300):
                logger.log_metrics({{"x": float(step)}}, step=step)
    """)
    env = env_with_faultfile(tmp_path)
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "not delivered before the shutdown timeout" in done.stderr
    set_mode(tmp_path / "control", "ok")
    out = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [step for step, _ in read_rows(tmp_path / "rows.jsonl")] == list(range(300))


def test_a_replay_killed_part_way_converges_to_exactly_once(tmp_path):
    """Item 3b: replay of 3,000 steps killed part-way (SIGKILL), run again: each step once."""
    log_dir = tmp_path / "logs"
    spool_dir = spool_root(log_dir) / "jsonl" / "run1"
    spool = Spool(spool_dir)
    spool.append([StepBatch(step=s, values={"x": float(s)}, seal=s) for s in range(3000)])
    spool.close()
    spool.write_meta({"tracker": "jsonl", "run_id": "run1", "log_dir": str(log_dir),
                      "config": {"log_dir": str(log_dir)}})
    proc = subprocess.Popen([*REPLAY, str(log_dir), "--no-progress"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    jsonl = log_dir / "metrics.jsonl"
    _wait(lambda: jsonl.exists() and jsonl.stat().st_size > 20_000, timeout=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    first = len(jsonl_rows(jsonl, torn_tail=True))  # killed in a write: its line may be torn
    assert 0 < first < 3000
    out = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert [r["step"] for r in jsonl_rows(jsonl)] == list(range(3000))


def test_a_corrupt_spool_is_reported_and_the_others_still_replay(tmp_path):
    """Item 4: garbled bytes and a line of the wrong shape in one tracker's spool: replay names
    each skipped line, exits non-zero, and still replays every other record and tracker."""
    log_dir = tmp_path / "logs"
    for tracker in ("jsonl", "tensorboard"):
        spool = Spool(spool_root(log_dir) / tracker / "run1")
        spool.append([StepBatch(step=s, values={"x": float(s)}, seal=s) for s in range(10)])
        spool.close()
        spool.write_meta({"tracker": tracker, "run_id": "run1", "log_dir": str(log_dir),
                          "config": {"log_dir": str(log_dir), "tensorboard_enabled": True}})
    segment = next((spool_root(log_dir) / "jsonl" / "run1").glob("wal-*"))
    lines = segment.read_bytes().splitlines(keepends=True)
    lines[3] = b'{"seq": 4, "kind": "step", "step": null, "rows": {}}\n'
    lines[5] = b"\x00\xff garbled \xfe\n"
    segment.write_bytes(b"".join(lines))
    out = subprocess.run([*REPLAY, str(log_dir), "--no-progress"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1
    assert "8/8 record(s) delivered" in out.stdout  # jsonl: all but the two bad lines
    assert "10/10 record(s) delivered" in out.stdout  # tensorboard untouched
    assert out.stdout.count("skipped an unreadable spool line") == 2
    assert str(segment) in out.stdout
    assert [r["step"] for r in jsonl_rows(log_dir / "metrics.jsonl")] == [0, 1, 2, 4, 6, 7, 8, 9]
    assert [s for s, _ in tensorboard_scalars(log_dir / "tensorboard")["x"]] == list(range(10))


def test_a_full_disk_never_tears_the_spool_or_reuses_a_sequence_number(tmp_path):
    """Item 5: the spool write fails half-way (a real EFBIG: a file-size limit, RLIMIT_FSIZE, in
    a process of its own, lets half of the write through); the segment is cut back to its last
    whole line, the numbers go on from there, and the next write works once there is room."""
    child = textwrap.dedent(f"""
        import resource, signal
        from otel_rl.core.records import StepBatch
        from otel_rl.delivery.spool import Spool
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        spool = Spool({str(tmp_path / "spool")!r})
        assert spool.append([StepBatch(step=0, values={{"x": 0.0}})]) == [1]
        size = spool._segment.tell()
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 150, hard))  # half of what follows
        try:
            spool.append([StepBatch(step=s, values={{"x": 1.0, "pad": "p" * 100}}) for s in (1, 2)])
        except OSError as exc:
            print("refused", exc.errno, flush=True)
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
        print("next", spool.append([StepBatch(step=3, values={{"x": 3.0}})]), flush=True)
        spool.close()
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"refused {errno.EFBIG}", "next [2]"]
    text = next((tmp_path / "spool").glob("wal-*")).read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["seq"] for line in text.splitlines()] == [1, 2]
    assert [json.loads(line)["step"] for line in text.splitlines()] == [0, 3]


def test_records_the_spool_could_not_hold_are_counted_and_still_delivered(tmp_path):
    """Item 5: with the spool unwritable, records go on from memory and are counted. The disk
    fills for real: a file-size limit (RLIMIT_FSIZE) in the training process makes the spool's
    appends fail with EFBIG once its segment reaches it (the tracker keeps rows in memory)."""
    child = textwrap.dedent(f"""
        import json, resource, signal
        from otel_rl.core.records import StepBatch
        from tests.delivery.test_delivery_faults import Recording
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of killing us
        tracker = Recording(spool_dir={str(tmp_path / "spool")!r}, fsync_interval=0.05)
        tracker.delivery.start()
        tracker.delivery.submit(StepBatch(step=0, values={{"x": 0.0}}))
        assert tracker.force_flush(10_000)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # the spool fills at once
        for step in range(1, 60):
            batch = StepBatch(step=step, values={{"x": float(step), "pad": "p" * 200}})
            tracker.delivery.submit(batch)
        assert tracker.force_flush(10_000)
        tracker.shutdown()
        print(json.dumps({{"steps": tracker.steps, **tracker.delivery.stats}}), flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["steps"] == list(range(60))
    assert 0 < result["unspooled"] < 60  # what the full spool could not hold, counted
    assert "cannot write the spool" in out.stderr and "File too large" in out.stderr


def test_records_in_memory_only_at_the_deadline_are_counted_lost(tmp_path):
    """The spool full (a file-size limit, as above) and the tracker down (its writes fail as a
    full disk would fail them: a transient error, retried): at the shutdown's deadline the
    records only memory held are lost, and counted so (``exit_timeout``), in the one warning at
    the end; the spooled ones wait for replay (they were lost unsaid: ``lost`` was empty)."""
    child = textwrap.dedent(f"""
        import json, resource, signal
        from otel_rl.core.records import StepBatch
        from tests.delivery.test_delivery_faults import Recording
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        def down(step):
            if step > 0:
                raise ConnectionError("no space left on the tracker's disk")
        tracker = Recording(fail=down, spool_dir={str(tmp_path / "spool")!r},
                            fsync_interval=0.05)
        tracker.delivery.start()
        tracker.delivery.submit(StepBatch(step=0, values={{"x": 0.0}}))
        assert tracker.force_flush(10_000)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
        for step in range(1, 60):
            batch = StepBatch(step=step, values={{"x": float(step), "pad": "p" * 200}})
            tracker.delivery.submit(batch)
        tracker.shutdown(timeout_millis=1_000)
        print(json.dumps({{"steps": tracker.steps, "lost": tracker.delivery.lost,
                          "left": tracker.delivery.undelivered, **tracker.delivery.stats}}))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["steps"] == [0]
    assert 0 < result["unspooled"] <= 59
    # every record is delivered, waiting in the spool, or counted lost: none unsaid
    assert result["lost"] == {"exit_timeout": result["unspooled"]}
    assert 1 + result["left"] + result["unspooled"] == 60
    assert f"exit_timeout: {result['unspooled']}" in out.stderr or (
        str(result["unspooled"]) in out.stderr and "lost" in out.stderr
    ), out.stderr


def test_a_record_the_tracker_refuses_is_set_aside_and_never_rewritten_in_part(tmp_path):
    """Item 6: TensorBoard gets a batch whose third step cannot be stored (beyond int64): that
    record is set aside and counted; the others are written exactly once."""
    from otel_rl.exporters.tensorboard import TensorBoardExporter

    tracker = TensorBoardExporter(tmp_path / "tb")
    gate = threading.Event()
    original_open = tracker.open

    def slow_open():
        gate.wait()
        original_open()

    tracker.open = slow_open
    for step in (0, 1, 2**63, 3, 4):
        tracker.delivery.submit(StepBatch(step=step, values={"x": float(step % 1000)}))
    gate.set()  # all five are queued: they go as one batch
    assert tracker.force_flush(10_000)
    tracker.shutdown()
    assert tracker.delivery.stats["rejected"] == 1
    assert tracker.delivery.stats["retries"] == 0
    assert [s for s, _ in tensorboard_scalars(tmp_path / "tb")["x"]] == [0, 1, 3, 4]


def test_a_typo_in_a_trackers_settings_stops_it_at_once_and_exit_is_fast(
    tmp_path, otel_rl_warnings
):
    """Item 7: a tracker whose open() raises TypeError (a typo in its settings) is not retried:
    one message names the cause and the fix, finish() returns in seconds, the rows wait in the
    spool."""

    class Typo(Recording):
        name = "typo"

        def open(self):
            raise TypeError("init() got an unexpected keyword argument 'projcet'")

    typo = Typo()
    started = time.monotonic()
    with Logger({"log_dir": str(tmp_path), "export": {"shutdown_timeout": 30}},
                exporters=[typo]) as logger:
        for step in range(20):
            logger.log_metrics({"x": 1.0}, step=step)
    assert time.monotonic() - started < 10
    assert typo.calls == 0
    assert len(jsonl_rows(tmp_path / "metrics.jsonl")) == 20
    errors = [r.getMessage() for r in otel_rl_warnings.records if "typo stopped" in r.getMessage()]
    assert len(errors) == 1 and "projcet" in errors[0] and "settings" in errors[0]
    spool = next(spool_root(tmp_path).glob("typo/*"))
    assert len(undelivered(spool)) == 20


def test_a_connection_error_is_retried_until_the_tracker_is_back(tmp_path):
    """Item 7: transient errors are retried (jittered backoff) and each record arrives once."""
    down_until = time.monotonic() + 1.0

    def fail(step):
        if time.monotonic() < down_until:
            raise ConnectionRefusedError("connection refused")

    tracker = Recording(fail=fail, retry_max_backoff=0.2)
    logger = Logger({"log_dir": str(tmp_path), "jsonl_enabled": False}, exporters=[tracker])
    for step in range(10):
        logger.log_metrics({"x": 1.0}, step=step)
    logger.finish()
    assert tracker.steps == list(range(10))
    assert tracker.delivery.stats["retries"] >= 1


def test_an_exporter_given_as_an_instance_gets_the_spool_and_export_options(tmp_path):
    """Item 10: ``Logger(cfg, exporters=[...])`` exporters follow export.* like built ones."""
    tracker = Recording()
    cfg = {"log_dir": str(tmp_path), "jsonl_enabled": False,
           "export": {"queue_size": 7, "on_full": "spool", "fsync_interval": 0.3}}
    logger = Logger(cfg, exporters=[tracker])
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finish()
    assert tracker.delivery.spool_dir is not None
    assert tracker.delivery.spool_dir.parent == spool_root(tmp_path) / "recording"
    options = tracker.delivery.options
    assert options.queue_size == 7 and options.fsync_interval == 0.3
    assert read_acks(tracker.delivery.spool_dir).upto == 1


def test_drop_oldest_never_drops_a_record_being_written(tmp_path):
    """Item 12: max_batch=3, queue_size=3, all three in flight: the newcomer is what is dropped
    and counted; the three in flight arrive. It waits on the delivery's in-flight count: only
    that says the worker took all three records in one batch."""
    gate = threading.Event()
    tracker = Recording(fail=lambda step: gate.wait(), max_batch=3, queue_size=3,
                        on_full="drop_oldest")
    tracker.delivery.start()
    for step in range(3):
        tracker.delivery.submit(StepBatch(step=step, values={"x": 1.0}))
    _wait(lambda: tracker.delivery._records.inflight == 3)
    tracker.delivery.submit(StepBatch(step=3, values={"x": 1.0}))
    gate.set()
    assert tracker.force_flush(5_000)
    tracker.shutdown()
    assert tracker.steps == [0, 1, 2]
    assert tracker.delivery.stats["dropped"] == 1


@pytest.mark.slow
def test_replay_into_wandb_continues_the_same_run(tmp_path):
    """Item 13: the W&B run id is saved with the spool; replay reopens that run (offline)."""
    log_dir = tmp_path / "logs"
    cfg = {"log_dir": str(log_dir), "jsonl_enabled": False, "wandb_enabled": True,
           "wandb": {"project": "p", "mode": "offline"}}
    with Logger(cfg) as logger:
        logger.log_metrics({"x": 1.0}, step=0)
    meta = json.loads(next(spool_root(log_dir).glob("wandb/*/meta.json")).read_text())
    run_id = meta["resume"]["wandb"]["id"]
    assert meta["resume"]["wandb"]["resume"] == "allow"
    assert list((log_dir / "wandb").glob(f"offline-run-*-{run_id}"))


def test_the_sdks_shutdown_timeout_keyword_is_honoured():
    """Under the SDK's own periodic reader (``OTEL_METRICS_EXPORTER=...``), shutdown passes
    ``timeout=`` (milliseconds): a tracker that stays down is given up on within it, not after
    the 30 s default."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    def down(step):
        raise ConnectionRefusedError("connection refused")

    tracker = Recording(fail=down, retry_max_backoff=0.1)
    reader = PeriodicExportingMetricReader(tracker, export_interval_millis=60_000)
    provider = MeterProvider(metric_readers=[reader])
    provider.get_meter("lib").create_counter("lib.requests").add(1)
    started = time.monotonic()
    provider.shutdown(timeout_millis=2_000)
    assert time.monotonic() - started < 15  # well before the 30 s default
    assert tracker.delivery.undelivered == 1


def test_jsonl_never_holds_a_torn_line(tmp_path):
    """Item 5: a line torn by a crash is cut before appending; a write that fills the disk
    half-way is cut back and retried whole (RLIMIT_FSIZE gives a real EFBIG mid-write)."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step":0,"time":1,"metrics":{"x":0.0}}\n{"step":1,"time":1,"metr')
    child = textwrap.dedent(f"""
        import resource, signal, sys
        from otel_rl.exporters.jsonl import JsonlExporter
        from otel_rl.core.records import StepBatch
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        exporter = JsonlExporter({str(path)!r})
        writer = exporter.delivery.writer()
        limit = {path.stat().st_size} + 300
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        batches = [(s, StepBatch(step=s, values={{"x": float(s)}})) for s in range(1, 20)]
        done, failure = writer.write(batches)
        print(done, failure.kind if failure else None, flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.split() == ["0", "transient"], out.stderr
    lines = path.read_bytes().splitlines(keepends=True)
    assert lines == [b'{"step":0,"time":1,"metrics":{"x":0.0}}\n']


def test_a_step_beyond_int64_is_refused_at_log_metrics(tmp_path, otel_rl_warnings):
    """Item 6: lenient mode warns and drops that call; strict mode raises MetricError; the
    steps around it arrive."""
    from otel_rl import MetricError

    with Logger({"log_dir": str(tmp_path / "lenient")}) as logger:
        logger.log_metrics({"x": 1.0}, step=0)
        logger.log_metrics({"x": 2.0}, step=2**63)
        logger.log_metrics({"x": 3.0}, step=1)
    rows = jsonl_rows(tmp_path / "lenient" / "metrics.jsonl")
    assert [(r["step"], r["metrics"]["x"]) for r in rows] == [(0, 1.0), (1, 3.0)]
    assert any("64-bit" in r.getMessage() for r in otel_rl_warnings.records)
    strict = Logger({"log_dir": str(tmp_path / "strict"), "strict": True})
    with pytest.raises(MetricError, match="64-bit"):
        strict.log_metrics({"x": 2.0}, step=-(2**63) - 1)
    strict.finish()


def test_a_jsonl_write_cut_short_by_a_kill_is_completed_by_replay_without_repeating_a_line(
    tmp_path,
):
    """A SIGKILL can land inside one write call: the kernel stops copying at a page and the file
    keeps the write's first lines whole. The killed process here writes the first half of a
    batch and half a line, then SIGKILLs itself (a kill cannot be timed to land inside a
    write call, so the cut is injected); its tracker is JSONL's own. Replay counts the whole
    lines the cut write left, sends only the rest, and every step is in the file once."""
    logs = tmp_path / "logs"
    child = textwrap.dedent(f"""
        import os, signal, threading
        from otel_rl import Logger
        from otel_rl.exporters.jsonl import JsonlExporter

        go = threading.Event()

        class CutByAKill(JsonlExporter):
            def write_batches(self, batches):
                if batches[0].step >= 5:
                    go.wait()  # until every step is logged: the next write takes many
                    if len(batches) > 1:
                        data = b"".join(map(self.format_line, batches))
                        whole = len(batches) // 2
                        cut = sum(map(len, map(self.format_line, batches[:whole]))) + 20
                        print(len(batches), whole, flush=True)
                        os.write(self._file.fileno(), data[:cut])
                        os.kill(os.getpid(), signal.SIGKILL)
                super().write_batches(batches)

        logger = Logger({{"log_dir": {str(logs)!r}, "jsonl_enabled": False}},
                        exporters=[CutByAKill({str(logs / "metrics.jsonl")!r})])
        for step in range(5):
            logger.log_metrics({{"x": float(step)}}, step=step, step_finished=True)
        assert logger.flush(30)
        for step in range(5, 60):
            logger.log_metrics({{"x": float(step)}}, step=step, step_finished=True)
        go.set()
        logger.flush(30)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stdout + out.stderr
    batch, whole = map(int, out.stdout.split())
    assert batch > 1 and whole >= 1, out.stdout
    rows = (logs / "metrics.jsonl").read_bytes().split(b"\n")
    assert len(rows) - 1 >= 5 + whole and rows[-1], "the first lines whole, then a torn one"
    replayed = subprocess.run([*REPLAY, str(logs), "--no-progress"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert [(r["step"], r["metrics"]["x"]) for r in jsonl_rows(logs / "metrics.jsonl")] == [
        (step, float(step)) for step in range(60)
    ]
