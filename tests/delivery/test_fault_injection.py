"""Fault injection: a real training process killed at random points, then ``otel-rl replay``.

Each iteration starts a training child (JSONL, TensorBoard, a test tracker that is made slow or
down through a control file, and in the slow tier a real MLflow server that is stopped and
restarted), kills it with SIGKILL, SIGTERM or SIGINT at a seeded point (a paced loop with long
steps, a tight ``log_metrics`` loop, or inside ``finish()``), replays (the replay itself killed
part-way in some iterations, then run again until it exits 0), reads each tracker back with its
own reader and checks the one invariant (:mod:`tests.faults.invariant`): every step whose
``log_metrics`` returned at least ``export.fsync_interval`` before the kill is delivered exactly
once to every tracker, in step order; no step is ever delivered twice.

Environment:
- ``OTEL_RL_FAULT_SEED``: the base seed (default 12); iteration ``i`` uses ``"<seed>:<i>"``.
- ``OTEL_RL_FAULT_ITERATIONS``: iterations of both tiers together (default 96, about 8
  minutes alone): the first tier runs the first ``DEFAULT_ITERATIONS``, the slow tier the rest,
  in ``SLOW_PARTS`` tests that a parallel run spreads over its workers. Each iteration is a few
  CPU-seconds of processes starting (the run, its delivery process, replays): the default keeps
  the suite within its time on 2 cores; a campaign of thousands is this variable.
- ``OTEL_RL_FAULT_MLFLOW_EVERY``: the slow tier adds MLflow to one iteration in N (default 8).
- ``OTEL_RL_FAULT_ITERATION``: run only this iteration (to reproduce a failure).
- ``OTEL_RL_FAULT_GRACE``: scheduling slack in seconds added to ``fsync_interval`` (default 0.3).
- ``OTEL_RL_FAULT_REPORT``: also write the summary JSON there.

The summary (kills injected, rows expected, rows delivered, duplicates, every failure with its
seed and kill point) is written to ``fault-summary.json`` in the test's tmp dir (path printed,
and attached with ``record_property``).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.delivered import Delivered
from tests.faults.driver import Harness, RunSummary, run_iteration
from tests.faults.invariant import check
from tests.faults.plan import DEFAULT_GRACE, keys_of, make_plan, value_of

SEED = os.environ.get("OTEL_RL_FAULT_SEED", "12")
DEFAULT_ITERATIONS = 32
SLOW_ITERATIONS = int(os.environ.get("OTEL_RL_FAULT_ITERATIONS", "96"))
# MLflow costs ~20 s an iteration (the SDK's import in the child and in each replay, a restart
# when planned down), so the slow tier adds it to one iteration in this many.
MLFLOW_EVERY = int(os.environ.get("OTEL_RL_FAULT_MLFLOW_EVERY", "8"))
ONLY = os.environ.get("OTEL_RL_FAULT_ITERATION")
GRACE = float(os.environ.get("OTEL_RL_FAULT_GRACE", DEFAULT_GRACE))


def _run(tmp_path: Path, harness: Harness, iterations: range, record_property) -> None:
    mlflow = harness.mlflow
    summary = RunSummary(SEED)
    indices = [int(ONLY)] if ONLY is not None else iterations
    try:
        for index in indices:
            with_mlflow = mlflow is not None and index % MLFLOW_EVERY == 0
            plan = make_plan(SEED, index, harness.shutdown_timeout, mlflow=with_mlflow)
            summary.add(run_iteration(harness, index, plan))
    finally:
        report = summary.to_dict()
        path = tmp_path / "fault-summary.json"
        summary.write(path)
        if os.environ.get("OTEL_RL_FAULT_REPORT"):
            summary.write(Path(os.environ["OTEL_RL_FAULT_REPORT"]))
        numbers = {k: v for k, v in report.items()
                   if k not in ("per_tracker", "failures", "iterations_log")}
        for key, value in numbers.items():
            record_property(key, value)
        print(f"\nfault injection summary ({path}): {numbers}")
    assert not summary.failures, (
        f"{len(summary.failures)} invariant violation(s), seed {SEED} "
        f"(summary in {path}):\n" + "\n".join(summary.failures)
    )
    # No violation means something only if the campaign did what it claims: rows were
    # expected and checked, and its faults were injected.
    assert summary.iterations == len(indices)
    assert summary.total.expected > 0 and summary.total.expected_delivered > 0
    if ONLY is None:
        assert summary.kills > 0 and summary.replay_kills > 0, "no kill reached a process"
        assert summary.damaged_spools > 0 and summary.replays_during_run > 0
        assert summary.delivery_process > 0 and summary.overloads


def test_checker_finds_missing_duplicate_out_of_order_and_wrong_rows():
    """The checker itself: each kind of wrong delivery is found and counted."""
    returned = {s: float(s) for s in range(10)}  # step s returned at t = s
    good = Delivered("t")
    for s in range(10):
        for key in keys_of(s):
            good.add(s, key, value_of(s, key))
    assert check(good, returned, cutoff=9.0)[0] == []

    bad = Delivered("t")
    for s in [0, 1, 2, 4, 5, 3, 6, 6, 8, 11]:  # 3 late, 6 twice, 7 missing, 11 never logged
        for key in keys_of(s):
            bad.add(s, key, 99.0 if (s, key) == (8, "f/a") else value_of(s, key))
    findings, counts = check(bad, returned, cutoff=7.5)
    kinds = {f.kind: f.steps for f in findings}
    assert kinds["missing"] == [7]
    assert kinds["duplicate"] == [6]
    assert kinds["order"] == [3]
    assert kinds["phantom"] == [11]
    assert "f/a@8=99.0" in next(f.detail for f in findings if f.kind == "value")
    assert (counts.expected, counts.missing, counts.duplicates) == (8, 1, 1)


@pytest.mark.slow
@pytest.mark.long
def test_killed_training_and_replay_deliver_each_step_exactly_once(tmp_path, record_property):
    """A few dozen kills (JSONL, TensorBoard, the test tracker slow/down); about a minute."""
    iterations = range(DEFAULT_ITERATIONS)
    _run(tmp_path, Harness(tmp_path / "runs", grace=GRACE), iterations, record_property)


#: The slow tier's iterations run in this many tests (each with its own MLflow server), so that
#: a parallel run spreads them over its workers; together they are the same iterations.
SLOW_PARTS = 3


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("part", range(SLOW_PARTS))
def test_killed_training_and_replay_deliver_each_step_exactly_once_with_mlflow(
    tmp_path, record_property, part
):
    """The slow tier: more kills, and a real MLflow server that is sometimes stopped mid-run
    and restarted before the replay."""
    from testkit.servers import start_mlflow_server, stop_mlflow_server

    if ONLY is not None and part:
        pytest.skip("OTEL_RL_FAULT_ITERATION runs its one iteration in part 0")
    # After the first tier's iterations: their plans (MLflow aside) are the same, run once.
    first = DEFAULT_ITERATIONS
    size = -(-(SLOW_ITERATIONS - first) // SLOW_PARTS)
    iterations = range(first + part * size, min(SLOW_ITERATIONS, first + (part + 1) * size))
    server = start_mlflow_server(tmp_path / "mlflow")
    harness = Harness(tmp_path / "runs", grace=GRACE, mlflow=server)
    try:
        _run(tmp_path, harness, iterations, record_property)
    finally:
        stop_mlflow_server(harness.mlflow)  # the server of the last restart
