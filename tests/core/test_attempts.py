"""The latest attempt of each step of a relaunched run's ``metrics.jsonl``: files written by real
Loggers (the same ``run_id`` and ``log_dir`` launched again), read back by
``otel_rl.core.attempts`` and by the test readers built on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.core.attempts import ResumePoint, Resumes, attempt_of, latest_attempt, resume_of
from otel_rl.core.records import StepBatch
from testkit.readers import jsonl_rows, metric_rows, rows_by_step

#: The fraction each launch adds to its step's value: which attempt a value came from.
MARKS = {1: 0.25, 2: 0.5, 3: 0.75}


def launch(log_dir: Path, steps: range, attempt: int, run_id: str = "x", gpu_at: range = range(0)):
    """One launch of ``run_id`` logging ``loss = step + MARKS[attempt]`` at each step; GPU-style
    rows (the Ray bridge's ``ray/ray_step`` axis) at ``gpu_at`` go through the run's own fan-out,
    as the bridge sends them."""
    with Logger({"log_dir": str(log_dir), "run_id": run_id}) as logger:
        assert logger.history.attempt == attempt
        for second in gpu_at:
            logger.fanout.send(
                StepBatch(step=second, values={"gpu/0/util": float(second)}, axis="ray/ray_step")
            )
        for step in steps:
            logger.log_metrics({"loss": step + MARKS[attempt]}, step=step)


def losses(rows: list[dict]) -> list[tuple[int, float]]:
    return [(r["step"], r["metrics"]["loss"]) for r in rows if "axis" not in r]


def test_a_resumed_run_reads_each_step_once_with_the_latest_attempts_values(log_dir):
    launch(log_dir, range(10), attempt=1)
    launch(log_dir, range(5, 13), attempt=2)
    path = log_dir / "metrics.jsonl"
    written = jsonl_rows(path)
    assert len(written) == 10 + 1 + 8  # every row of both, and one resume record

    latest = latest_attempt(written)
    assert losses(latest.rows) == [(s, s + 0.25) for s in range(5)] + [
        (s, s + 0.5) for s in range(5, 13)
    ]
    assert [attempt_of(r) for r in latest.rows] == [1] * 5 + [2] * 8
    assert latest.resumes == [ResumePoint(attempt=2, step=5, run_id="x")]
    assert latest.superseded == {("x", 1): 5}

    # The test readers take the latest attempt, and read every row when asked.
    assert metric_rows(path) == latest.rows
    assert rows_by_step(path) == {s: {"loss": s + (0.25 if s < 5 else 0.5)} for s in range(13)}
    every = metric_rows(path, every_attempt=True)
    assert losses(every) == [(s, s + 0.25) for s in range(10)] + [
        (s, s + 0.5) for s in range(5, 13)
    ]
    assert all("resume" not in r for r in every)
    # Read as a generator, once, the answer is the same.
    assert latest_attempt(iter(written)) == latest


def test_a_third_attempt_that_resumes_below_the_second_supersedes_both(log_dir):
    """Attempt 2 resumed at 5 and reached 12; attempt 3 went back to the checkpoint of step 3:
    attempt 2's steps 8-12 belong to a history that attempt 3 replaced, so they are gone too."""
    launch(log_dir, range(10), attempt=1)
    launch(log_dir, range(5, 13), attempt=2)
    launch(log_dir, range(3, 8), attempt=3)
    latest = latest_attempt(jsonl_rows(log_dir / "metrics.jsonl"))
    assert losses(latest.rows) == [(s, s + 0.25) for s in range(3)] + [
        (s, s + 0.75) for s in range(3, 8)
    ]
    assert latest.resumes == [ResumePoint(2, 5, "x"), ResumePoint(3, 3, "x")]
    assert latest.superseded == {("x", 1): 7, ("x", 2): 8}


def test_a_resume_record_with_no_row_after_it_still_supersedes(log_dir):
    """A relaunch killed between its resume record and its first row leaves the record last
    (cut here from a real relaunch's file, where the kill would have cut it): the first
    attempt's rows from the resume step on are superseded, and nothing replaces them."""
    launch(log_dir, range(10), attempt=1)
    launch(log_dir, range(5, 13), attempt=2)
    path = log_dir / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if '"resume":' in line) + 1
    path.write_text("".join(lines[:cut]))
    latest = latest_attempt(jsonl_rows(path))
    assert losses(latest.rows) == [(s, s + 0.25) for s in range(5)]
    assert latest.superseded == {("x", 1): 5}
    assert rows_by_step(path) == {s: {"loss": s + 0.25} for s in range(5)}


def test_a_file_without_attempts_reads_as_before(log_dir):
    """A file written before attempts existed (the same real rows without ``"attempt"``, two
    runs in one file as they were then): every row, in file order, as written."""
    launch(log_dir, range(4), attempt=1, run_id="a")
    launch(log_dir, range(2, 6), attempt=1, run_id="b")
    path = log_dir / "metrics.jsonl"
    old = []
    for row in jsonl_rows(path):
        del row["attempt"]
        old.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    latest = latest_attempt(jsonl_rows(path))
    assert latest.rows == old
    assert latest.resumes == [] and latest.superseded == {}
    assert metric_rows(path) == metric_rows(path, every_attempt=True) == old
    assert rows_by_step(path) == {
        0: {"loss": 0.25}, 1: {"loss": 1.25}, 2: {"loss": 2.25}, 3: {"loss": 3.25},
        4: {"loss": 4.25}, 5: {"loss": 5.25},
    }  # fmt: skip  (steps 2 and 3 of both runs merged, the later line winning, as before)


def test_rows_without_attempt_are_the_first_attempts(log_dir):
    """The first attempt's rows with their ``"attempt"`` taken out read exactly as with it."""
    launch(log_dir, range(10), attempt=1)
    launch(log_dir, range(5, 13), attempt=2)
    path = log_dir / "metrics.jsonl"
    rows = jsonl_rows(path)
    stripped = [{k: v for k, v in r.items() if not (k == "attempt" and v == 1)} for r in rows]
    assert latest_attempt(stripped).superseded == latest_attempt(rows).superseded == {("x", 1): 5}
    assert losses(latest_attempt(stripped).rows) == losses(latest_attempt(rows).rows)


def test_another_runs_rows_and_axis_rows_are_never_superseded(log_dir):
    """Run ``y`` in the same file is not touched by run ``x``'s resume record, and the GPU
    rows of ``x``'s first attempt (seconds, not steps) stay."""
    launch(log_dir, range(10), attempt=1, run_id="y")
    launch(log_dir, range(10), attempt=1, gpu_at=range(6, 9))
    launch(log_dir, range(5, 8), attempt=2)
    latest = latest_attempt(jsonl_rows(log_dir / "metrics.jsonl"))
    kept = [(r["run_id"], r.get("axis"), r["step"]) for r in latest.rows]
    assert kept == (
        [("y", None, s) for s in range(10)]
        + [("x", "ray/ray_step", s) for s in range(6, 9)]
        + [("x", None, s) for s in range(5)]
        + [("x", None, s) for s in range(5, 8)]
    )
    assert [r["metrics"]["loss"] for r in latest.rows if r["run_id"] == "y"] == [
        s + 0.25 for s in range(10)
    ]
    assert latest.superseded == {("x", 1): 5}


def test_the_rule_does_not_depend_on_the_order_of_the_lines(log_dir):
    """A late replay of the first attempt's rows, after the resume record: still superseded."""
    launch(log_dir, range(10), attempt=1)
    launch(log_dir, range(5, 13), attempt=2)
    rows = jsonl_rows(log_dir / "metrics.jsonl")
    first = [r for r in rows if r["attempt"] == 1]
    rest = [r for r in rows if r["attempt"] == 2]
    late = latest_attempt(rest + first)
    assert losses(late.rows) == [(s, s + 0.5) for s in range(5, 13)] + [
        (s, s + 0.25) for s in range(5)
    ]
    assert late.superseded == {("x", 1): 5}


def test_resumes_cutoffs_and_the_same_attempt_announced_twice():
    resumes = Resumes()
    assert not resumes and resumes.cutoff("x", 1) == float("inf")
    resumes.add(ResumePoint(2, 500, "x"))
    resumes.add(ResumePoint(3, 720, "x"))
    assert (resumes.cutoff("x", 1), resumes.cutoff("x", 2), resumes.cutoff("x", 3)) == (
        500, 720, float("inf"),
    )  # fmt: skip
    assert resumes.supersedes("x", 1, 500) and not resumes.supersedes("x", 1, 499)
    assert not resumes.supersedes("y", 1, 900) and not resumes.supersedes(None, 1, 900)
    resumes.add(ResumePoint(2, 450, "x"))  # the lower step of the two counts
    resumes.add(ResumePoint(2, 480, "x"))
    assert resumes.cutoff("x", 1) == 450
    assert resumes.points() == [ResumePoint(2, 450, "x"), ResumePoint(3, 720, "x")]


@pytest.mark.parametrize("value", [None, "2", 0, -1, 2.0, True])
def test_an_attempt_that_is_not_a_whole_number_from_1_is_the_first(value):
    assert attempt_of({"step": 1, "attempt": value, "metrics": {}}) == 1
    assert attempt_of({"step": 1, "attempt": 3, "metrics": {}}) == 3


MALFORMED = [
    {"attempt": 1, "step": 5}, {"attempt": "2", "step": 5}, {"step": 5}, [2, 5],
    {"attempt": 2, "step": 5.0},
]  # fmt: skip


@pytest.mark.parametrize("resume", MALFORMED)
def test_a_malformed_resume_record_is_a_clear_error_naming_the_record(resume):
    with pytest.raises(ValueError, match="resume record needs"):
        resume_of({"step": 5, "resume": resume})
    rows = [{"step": 0, "metrics": {}}, {"step": 5, "resume": resume, "metrics": {}}]
    with pytest.raises(ValueError, match=r"^record 1: a resume record needs"):
        latest_attempt(rows)
