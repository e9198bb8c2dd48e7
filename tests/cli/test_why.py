"""``otel-rl why``: runs made by a real Logger (JSONL on, real timers around real sleeps, workers
on their own threads, the real stall watchdog and straggler watch) and the real ``otel-rl demo``,
read back by the command in a subprocess; every number it prints is checked against the rows the
run wrote (read here with ``json``), and the slow step is the one the sleeps made slow."""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from otel_rl import Logger
from otel_rl.analysis.why import duration, explain, percent, step_ranges, times
from otel_rl.distributed.worker import WorkerMetrics
from otel_rl.timeline.run_picture import load_run
from otel_rl.watch.stalls import StallFile
from testkit.readers import anatomy_phases, jsonl_rows, rows_by_step

CLI = [sys.executable, "-m", "otel_rl.cli"]


def why(*args: str | Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*CLI, "why", *map(str, args)], capture_output=True, text=True, timeout=120
    )
    if check:
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
    return done


def one_clear_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


def median_of(rows: dict[int, dict], key: str) -> float:
    return statistics.median(row[key] for row in rows.values() if key in row)


def slow_step_run(log_dir: Path, steps: int = 6, slow: int = 3, **cfg: object) -> None:
    """Nested timers around known sleeps; ``slow``'s generation takes 0.25 s, the others 0.03."""
    with Logger({"log_dir": str(log_dir), **cfg}) as logger:
        for step in range(steps):
            with logger.timer("step"):
                with logger.timer("generation"):
                    time.sleep(0.25 if step == slow else 0.03)
                with logger.timer("reward"):
                    time.sleep(0.02)
            time.sleep(0.01)  # no timer: untimed
            logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)


def test_numbers_are_written_as_a_reader_reads_them():
    assert [duration(v) for v in (48.04, 2.0, 1.0, 0.0121, 0.001, 2.72e-5, 0.0)] == [
        "48.0 s", "2.0 s", "1.0 s", "12.1 ms", "1 ms", "27.2 µs", "0.0 s",
    ]  # fmt: skip
    assert duration(float("nan")) == "n/a"
    assert [percent(v) for v in (0.974, 0.0023, 0.0, 1.0)] == ["97 %", "0.23 %", "0 %", "100 %"]
    assert [times(v) for v in (1.04, 9.96, 396.6)] == ["1.0x", "10x", "397x"]
    assert step_ranges([5, 0, 1, 2, 9, 3, 12, 13, 2]) == "0-3, 5, 9, 12-13"
    assert step_ranges([]) == ""


def test_the_slowest_step_and_its_anatomy_are_the_rows_the_run_wrote(log_dir):
    slow_step_run(log_dir)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    walls = {step: row["anatomy/wall/seconds"] for step, row in rows.items()}
    assert max(walls, key=walls.__getitem__) == 3  # the sleeps made step 3 the slow one
    assert 0.25 <= rows[3]["anatomy/step/generation/seconds"] < 0.3
    median = statistics.median(walls.values())

    out = why(log_dir).stdout
    lines = out.splitlines()
    assert lines[0] == f"otel-rl why: {log_dir / 'metrics.jsonl'} (6 steps: 0-5)"
    assert f"slowest steps (step time; median {duration(median)}):" in lines
    listed = lines[lines.index(f"slowest steps (step time; median {duration(median)}):") + 1 :][:5]
    order = sorted(walls, key=lambda s: (-walls[s], s))[:5]
    for line, step in zip(listed, order, strict=True):
        phases = anatomy_phases(rows[step], untimed=True)
        top = max(phases, key=phases.__getitem__)
        assert line == (
            f"  step {step}: {duration(walls[step])} ({times(walls[step] / median)} median), "
            f"most in {top} {duration(phases[top])}"
        )
    assert listed[0].startswith("  step 3: ") and "most in step/generation" in listed[0]

    # the step's anatomy: every phase against its own median, largest first
    phases = anatomy_phases(rows[3], untimed=True)
    assert set(phases) == {"step", "step/generation", "step/reward", "untimed"}
    medians = {name: median_of(rows, f"anatomy/{name}/seconds") for name in phases}
    words = [
        f"{name} {duration(seconds)} (median {duration(medians[name])})"
        for name, seconds in sorted(phases.items(), key=lambda item: (-item[1], item[0]))
    ]
    sentence = f"step 3 took {duration(walls[3])}, median {duration(median)}: " + "; ".join(words)
    assert sentence in lines
    critical = rows[3]["anatomy/critical/step/generation/seconds"]
    assert f"  critical path: driver:step/generation ({duration(critical)})" in lines
    assert "stalls: none found" in lines and "stragglers: none found" in lines
    assert "notes:" not in lines


def test_step_takes_one_step_apart_and_json_says_the_same(log_dir):
    slow_step_run(log_dir)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    out = why(log_dir, "--step", "1", "--top", "2").stdout
    wall = rows[1]["anatomy/wall/seconds"]
    median = median_of(rows, "anatomy/wall/seconds")
    assert f"step 1 took {duration(wall)}, median {duration(median)}: " in out
    assert len([ln for ln in out.splitlines() if ln.startswith("  step ")]) == 2  # --top 2

    answer = json.loads(why(log_dir, "--step", "1", "--json").stdout)
    assert answer["steps"] == 6 and answer["step_ranges"] == "0-5"
    assert answer["measured_by"] == "anatomy"
    assert answer["median_seconds"] == median
    assert answer["slowest"][0]["step"] == 3
    assert answer["slowest"][0]["seconds"] == rows[3]["anatomy/wall/seconds"]
    step = answer["step"]
    assert step["step"] == 1 and step["seconds"] == wall
    phases = anatomy_phases(rows[1], untimed=True)
    assert {p["name"]: p["seconds"] for p in step["phases"]} == phases
    assert {p["name"]: p["median"] for p in step["phases"]} == {
        name: median_of(rows, f"anatomy/{name}/seconds") for name in phases
    }
    assert step["text"].startswith(f"step 1 took {duration(wall)}")


class _SlowestHolds:
    """Rank ``slowest`` is inside its innermost block before the other ranks start, and leaves
    each block only once they have left theirs of the same name: each of its blocks holds
    theirs, so it is the slowest at both timings however the machine schedules the threads
    (sleeps alone are not enough: a loaded machine stretches any of them)."""

    def __init__(self, others: int, slowest: int = 2) -> None:
        self.others, self.slowest = others, slowest
        self.innermost = threading.Event()
        self.out = {name: threading.Semaphore(0) for name in ("generation", "detokenize")}

    @contextlib.contextmanager
    def block(self, worker: WorkerMetrics, name: str, slowest: bool) -> Iterator[None]:
        with worker.timer(name):
            yield
            if slowest:
                assert all(self.out[name].acquire(timeout=60) for _ in range(self.others))
        if not slowest:
            self.out[name].release()


def _rollout_worker(rank: int, step: int, seconds: float, out: list, order: _SlowestHolds) -> None:
    """One rollout worker's step; ``order.slowest`` is the slowest rank whatever the load."""
    worker = WorkerMetrics(rank=rank, role="rollout")
    slowest = rank == order.slowest
    if not slowest:
        assert order.innermost.wait(60)
    with order.block(worker, "generation", slowest):
        time.sleep(seconds)
        with order.block(worker, "detokenize", slowest):
            if slowest:
                order.innermost.set()
            time.sleep(0.01 * (rank + 1))
    worker.record("tokens", 100.0, reduce="sum")
    out.append(worker.snapshot(step=step))


def test_workers_their_slowest_rank_the_critical_path_and_the_stragglers(log_dir):
    """Three rollout workers on their own threads; rank 2 is three times slower at every step,
    so the straggler watch (window 3) names it, and ``why`` says so in its words."""
    cfg = {"log_dir": str(log_dir), "stalls": {"straggler_window": 3}}
    with Logger(cfg) as logger:
        for step in range(4):
            snapshots: list = []
            order = _SlowestHolds(others=2)
            with logger.timer("generation"):
                workers = [
                    threading.Thread(target=_rollout_worker,
                                     args=(rank, step, s, snapshots, order))
                    for rank, s in enumerate((0.05, 0.05, 0.15))
                ]  # fmt: skip
                for thread in workers:
                    thread.start()
                for thread in workers:
                    thread.join()
            logger.log_worker_metrics(snapshots, step=step, prefix="rollout")
    rows = rows_by_step(log_dir / "metrics.jsonl")
    walls = {s: row["anatomy/wall/seconds"] for s, row in rows.items()}
    slowest = max(walls, key=walls.__getitem__)
    row = rows[slowest]
    assert row["rollout/timing/generation/slowest_rank"] == 2.0

    out = why(log_dir).stdout.splitlines()
    skew = row["rollout/timing/generation/skew"]
    phase = (
        f"generation {duration(row['anatomy/generation/seconds'])} "
        f"(median {duration(median_of(rows, 'anatomy/generation/seconds'))}), "
        f"its slowest rank 2 (skew {skew:.1f})"
    )
    (sentence,) = [ln for ln in out if ln.startswith(f"step {slowest} took")]
    assert phase in sentence
    kind = "slowest" if "anatomy/rollout/slowest_rank" in row else "busiest"
    rank = int(row[f"anatomy/rollout/{kind}_rank"])
    assert rank == 2
    assert (
        f"  workers rollout: busy {percent(row['anatomy/rollout/busy_fraction'])} of the step "
        f"(median rank), {kind} rank 2"
    ) in out
    # the workers' nested timer is reduced too, and no driver phase bears its name
    assert (
        f"  reduced timing rollout/timing/detokenize {duration(row['rollout/timing/detokenize'])}, "
        f"slowest rank 2 (skew {row['rollout/timing/detokenize/skew']:.1f})"
    ) in out
    links = {k[len("anatomy/critical/") : -len("/seconds")]: v for k, v in row.items()
             if k.startswith("anatomy/critical/")}  # fmt: skip
    assert set(links) == {"generation", "rollout/generation"}
    assert (
        f"  critical path: driver:generation ({duration(links['generation'])}) > "
        f"rollout rank 2:generation ({duration(links['rollout/generation'])})"
    ) in out

    events = [e for e in jsonl_rows(log_dir / "events.jsonl") if e["event"] == "otel_rl/straggler"]
    # rank 2 was the slowest at both of the workers' timings, at every step
    assert [e["step"] for e in events] == [2, 2]
    assert all("rank 2" in e["text"] for e in events)
    assert "stragglers: 2" in out
    listed = out.index("stragglers: 2")
    assert out[listed + 1 : listed + 3] == [f"  step 2: {e['text']}" for e in events]


def test_a_resumed_run_counts_each_steps_latest_row(log_dir):
    """Steps 3 and 4 written twice: by the first run (fast) and by the run that resumed from
    step 3 (its step 3 slow): the resumed run's rows are the ones that count."""
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(5):
            with logger.timer("generation"):
                time.sleep(0.02)
            logger.log_metrics({"loss": 1.0}, step=step)
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(3, 6):
            with logger.timer("generation"):
                time.sleep(0.3 if step == 3 else 0.02)
            logger.log_metrics({"loss": 1.0}, step=step)
    written = jsonl_rows(log_dir / "metrics.jsonl")
    first, second = written[0]["run_id"], written[-1]["run_id"]
    assert first != second and [r["step"] for r in written] == [0, 1, 2, 3, 4, 3, 4, 5]
    latest = {r["step"]: r["metrics"] for r in written}  # later lines win
    walls = {s: m["anatomy/wall/seconds"] for s, m in latest.items()}
    median = statistics.median(walls.values())
    assert max(walls, key=walls.__getitem__) == 3 and walls[3] >= 0.3

    out = why(log_dir).stdout.splitlines()
    assert out[0].endswith("(6 steps: 0-5)")
    assert f"slowest steps (step time; median {duration(median)}):" in out
    assert any(ln.startswith(f"step 3 took {duration(walls[3])}, median ") for ln in out)
    assert (
        "  2 step(s) were written again by a later run (a resumed run): the later run's row "
        "counts (3-4)"
    ) in out
    assert f"  metrics.jsonl holds rows of 2 runs ({first}, {second})" in out


def test_a_torn_last_line_is_skipped_and_said(log_dir):
    slow_step_run(log_dir, steps=3, slow=1)
    path = log_dir / "metrics.jsonl"
    lines = path.read_bytes().count(b"\n")
    with path.open("ab") as f:
        f.write(b'{"step":3,"time":1795762058.0,"run_id":"x","metrics":{"anatomy/wall/sec')
    out = why(log_dir).stdout.splitlines()
    assert out[0].endswith("(3 steps: 0-2)")
    assert (
        f"  metrics.jsonl: skipped its last line (line {lines + 1}), cut short: the run stopped "
        "while writing it (a crash or a kill)"
    ) in out
    assert any(ln.startswith("step 1 took ") for ln in out)


def test_a_run_without_anatomy_rows_is_measured_by_its_timings_and_says_so(log_dir):
    slow_step_run(log_dir, steps=4, slow=2, anatomy=False)
    rows = rows_by_step(log_dir / "metrics.jsonl")
    assert not any(k.startswith("anatomy/") for row in rows.values() for k in row)
    totals = {s: row["timing/step"] + row["timing/generation"] + row["timing/reward"]
              for s, row in rows.items()}  # fmt: skip
    median = statistics.median(totals.values())
    out = why(log_dir).stdout.splitlines()
    assert f"slowest steps (time in top-level timers; median {duration(median)}):" in out
    assert any(
        ln.startswith(f"step 2 spent in its timers {duration(totals[2])}, median "
                      f"{duration(median)}: step {duration(rows[2]['timing/step'])}")
        for ln in out
    )  # fmt: skip
    assert (
        "  this run has no anatomy rows (anatomy/wall/seconds): a step's time here is the sum "
        "of its top-level timing/<name> rows, which leaves out untimed time and counts a timer "
        "nested in another twice"
    ) in out


def test_a_run_that_times_nothing_says_so(log_dir):
    with Logger({"log_dir": str(log_dir)}) as logger:
        for step in range(3):
            logger.log_metrics({"loss": 1.0}, step=step)
    out = why(log_dir, "--step", "1").stdout.splitlines()
    assert "step 1: no row says where its time went" in out
    assert not any(ln.startswith("slowest steps") for ln in out)
    assert (
        "  no row says how long a step took: this run has neither anatomy rows "
        "(anatomy/wall/seconds) nor top-level timing/<name> rows (Logger.timer)"
    ) in out


def _hang_at_step_two(log_dir: Path) -> None:
    """A real run whose watchdog (after 0.3 s) reports a generation that hangs 1 s at step 2."""
    cfg = {"log_dir": str(log_dir), "stalls": {"after": 0.3, "factor": 1.0}}
    with Logger(cfg) as logger:
        for step in range(4):
            with logger.timer("generation"):
                time.sleep(1.0 if step == 2 else 0.02)
            logger.log_metrics({"loss": 1.0}, step=step)


def test_a_real_stall_report_and_its_end(log_dir):
    """The watchdog (after 0.3 s) reports a generation that hangs 1 s. A report written by a
    release without verdicts is the same file with its ``verdict`` taken out: its summary is
    told instead."""
    _hang_at_step_two(log_dir)
    (report_path,) = sorted((log_dir / "stalls").glob("*.json"))
    report = json.loads(report_path.read_text())
    assert report["last_step"] == 1 and report["ended"] is not None
    out = why(log_dir).stdout.splitlines()
    assert_stall_listed(out, report, report_path, last_step=1)

    report.pop("verdict", None)
    report_path.write_text(json.dumps(report))
    out = why(log_dir).stdout.splitlines()
    since, threshold = report["seconds_since_step"], report["threshold_seconds"]
    listed = out.index("stalls: 1")
    assert out[listed + 1] == (
        f"  {report['stalled_at']}, after step 1: no step for {duration(since)} "
        f"(threshold {duration(threshold)}); open timers: MainThread: generation"
    )

    # no report at all (a log_dir it could not write into): the run's stall events still tell
    for written in report_path.parent.iterdir():
        written.unlink()
    began, ended = [
        e for e in jsonl_rows(log_dir / "events.jsonl") if e["event"] == "otel_rl/stall"
    ]
    assert (began["level"], ended["level"]) == ("warning", "info")
    out = why(log_dir).stdout.splitlines()
    listed = out.index("stalls: 1")
    assert out[listed + 1].endswith(f", after step 1: {began['text']}")
    assert out[listed + 2 : listed + 4] == [
        f"    {ended['text']}",
        f"    events: {log_dir / 'events.jsonl'}",
    ]
    assert (
        f"  no stall report found; the stalls listed are the events of {log_dir / 'events.jsonl'}"
    ) in out


def test_a_stall_report_reads_back_in_one_reader_at_every_version(log_dir):
    """The watchdog's report is read by one class, :class:`StallFile`, for ``why`` and for the
    run's picture: each field as written. A report of version 1 (an older release: no
    ``version``, its time in whole seconds, no ``stalled_at_unix``) reads in both, the picture
    placing the stall at the end of its last step."""
    _hang_at_step_two(log_dir)
    (path,) = sorted((log_dir / "stalls").glob("*.json"))
    raw = json.loads(path.read_text())
    read = StallFile.read(path)
    assert (read.version, raw["version"]) == (2, 2)
    assert read.precise and read.began == raw["stalled_at_unix"]
    assert (read.last_step, read.attempt, read.stalled_at) == (1, 1, raw["stalled_at"])
    assert read.since_step == raw["seconds_since_step"]
    assert read.threshold == raw["threshold_seconds"]
    assert read.verdict == raw["verdict"]["text"] and read.verdict
    assert read.open_timers == {"MainThread": ["generation"]}
    assert read.ended == raw["ended"]["summary"]
    assert read.ended_seconds == raw["ended"]["seconds"] > 0.3
    picture = load_run(log_dir)
    (stall,) = picture.stalls
    assert stall.verdict == read.verdict and stall.last_step == 1
    assert stall.end - stall.start == pytest.approx(read.ended_seconds)
    before = why(log_dir).stdout

    older = {k: v for k, v in raw.items() if k not in ("version", "stalled_at_unix")}
    assert raw["stalled_at"].endswith("+00:00")  # whole seconds, as version 1 wrote it
    path.write_text(json.dumps(older))
    read = StallFile.read(path)
    assert (read.version, read.precise, read.last_step) == (1, False, 1)
    assert read.began == pytest.approx(raw["stalled_at_unix"], abs=1.0)
    older_picture = load_run(log_dir)
    (stall,) = older_picture.stalls
    step_one = next(s for s in older_picture.steps if s.step == 1)
    assert stall.start == step_one.end and stall.verdict == read.verdict
    assert why(log_dir).stdout == before


def assert_stall_listed(out: list[str], report: dict, path: Path, last_step: int) -> None:
    """The report is listed: when, after which step, its verdict (else its summary, in the
    report's own words when it has them), how it ended, where it is."""
    listed = out.index("stalls: 1")
    text = (report.get("verdict") or {}).get("text")
    head = f"  {report['stalled_at']}, after step {last_step}: "
    if text:
        assert out[listed + 1] == head + text
    else:
        assert out[listed + 1].startswith(head + "no step for ")
    assert out[listed + 2 : listed + 4] == [
        f"    {report['ended']['summary']}",
        f"    report: {path}",
    ]


def test_the_demo_output(tmp_path):
    """``otel-rl demo --stall``: half-way, one generation hangs 1 s; ``why`` names that step,
    its generation, and the stall with its verdict."""
    done = subprocess.run(
        [*CLI, "demo", "--steps", "10", "--stall", "1", "--backends", "jsonl",
         "--log-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = tmp_path / "exp_001"
    rows = rows_by_step(run / "metrics.jsonl")
    walls = {s: row["anatomy/wall/seconds"] for s, row in rows.items()}
    median = statistics.median(walls.values())
    out = why(run).stdout.splitlines()
    assert out[0] == f"otel-rl why: {run / 'metrics.jsonl'} (10 steps: 0-9)"
    listed = out.index(f"slowest steps (step time; median {duration(median)}):")
    # the demo's generation phase, under whatever timers the demo opens around it
    phases = anatomy_phases(rows[5], untimed=True)
    (name,) = [p for p in phases if p.rsplit("/", 1)[-1] == "generation"]
    gen = rows[5][f"anatomy/{name}/seconds"]
    assert gen >= 1.0
    assert out[listed + 1] == (
        f"  step 5: {duration(walls[5])} ({times(walls[5] / median)} median), "
        f"most in {name} {duration(gen)}"
    )
    (sentence,) = [ln for ln in out if ln.startswith("step 5 took ")]
    assert sentence.startswith(
        f"step 5 took {duration(walls[5])}, median {duration(median)}: {name} "
        f"{duration(gen)} (median {duration(median_of(rows, f'anatomy/{name}/seconds'))})"
    )
    (report_path,) = sorted((run / "stalls").glob("*.json"))
    report = json.loads(report_path.read_text())
    assert_stall_listed(out, report, report_path, last_step=4)


def test_why_reads_files_only_no_tracker_sdk_is_imported(log_dir):
    slow_step_run(log_dir, steps=3, slow=1)
    heavy = ("wandb", "mlflow", "swanlab", "ray", "torch", "tensorboard", "trackio", "numpy",
             "clearml", "transformers", "opentelemetry.sdk")  # fmt: skip
    code = (
        "import io, sys, contextlib\n"
        "from otel_rl.cli.main import main\n"
        "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
        f"    assert main(['why', {str(log_dir)!r}]) == 0\n"
        "assert 'step 1 took' in out.getvalue()\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


# ---- bad input ----------------------------------------------------------------------------------


def test_a_directory_without_metrics_says_what_is_missing(tmp_path):
    missing = tmp_path / "nope"
    done = why(missing, check=False)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        f"otel-rl why: {missing} does not exist: give a run's log_dir or its metrics.jsonl"
    )
    fifo = tmp_path / "a-fifo"
    os.mkfifo(fifo)
    done = why(fifo, check=False)
    assert done.returncode == 2
    assert "a-fifo is not a file or a directory" in one_clear_line(done.stderr)

    (tmp_path / "demo" / "exp_001").mkdir(parents=True)
    (tmp_path / "demo" / "exp_001" / "metrics.jsonl").write_text("")
    (tmp_path / "demo" / "exp_002").mkdir()
    (tmp_path / "demo" / "exp_002" / "metrics.jsonl").write_text("")
    done = why(tmp_path / "demo", check=False)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        f"otel-rl why: no metrics.jsonl in {tmp_path / 'demo'}: otel-rl why reads the rows of "
        "the JSONL tracker (enable it: jsonl_enabled: true; with jsonl.path elsewhere, pass "
        "that file); runs under it: exp_001, exp_002 (pass one of them)"
    )
    done = why(tmp_path / "demo" / "exp_001", check=False)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        f"otel-rl why: {tmp_path / 'demo' / 'exp_001' / 'metrics.jsonl'} holds no step rows"
    )


def test_a_step_not_in_the_run_names_the_steps_there(log_dir):
    slow_step_run(log_dir, steps=3, slow=1)
    done = why(log_dir, "--step", "42", check=False)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == "otel-rl why: step 42 is not in the run; its steps: 0-2"
    done = why(log_dir, "--step", "two", check=False)
    assert done.returncode == 2
    assert "argument --step: must be an integer, got 'two'" in done.stderr


def test_a_metrics_file_given_itself(log_dir):
    slow_step_run(log_dir, steps=3, slow=1)
    path = log_dir / "metrics.jsonl"
    renamed = log_dir / "ppo.jsonl"
    os.replace(path, renamed)
    out = why(renamed).stdout.splitlines()
    assert out[0] == f"otel-rl why: {renamed} (3 steps: 0-2)"
    assert any(ln.startswith("step 1 took ") for ln in out)


def test_rows_read_by_their_layout_and_rows_decoded_as_json_give_one_answer(log_dir, tmp_path):
    """A line in the exporter's own layout is read without decoding the whole row; the same
    rows written in another layout (spaces after the separators) are decoded as JSON. Both give
    the same answer, with timer names that JSON escapes and text rows that hold quotes."""
    cfg = {"log_dir": str(log_dir), "stalls": {"straggler_window": 3}}
    with Logger(cfg) as logger:
        for step in range(5):
            snapshots: list = []
            order = _SlowestHolds(others=1, slowest=1)  # rank 1: a straggler, an event
            with logger.timer("générer"):
                time.sleep(0.2 if step == 3 else 0.02)
                workers = [
                    threading.Thread(target=_rollout_worker,
                                     args=(rank, step, s, snapshots, order))
                    for rank, s in enumerate((0.01, 0.03))
                ]  # fmt: skip
                for thread in workers:
                    thread.start()
                for thread in workers:
                    thread.join()
            notes = {"note": 'the "slow" one'} if step % 2 else {}
            logger.log_worker_metrics(snapshots, step=step, prefix="rollout")
            logger.log_metrics({"loss": 1.0, **notes}, step=step)
    compact = (log_dir / "metrics.jsonl").read_text()
    assert "g\\u00e9n\\u00e9rer" in compact and '\\"slow\\"' in compact
    spaced = tmp_path / "spaced" / "metrics.jsonl"
    spaced.parent.mkdir()
    spaced.write_text(
        "".join(json.dumps(row) + "\n" for row in jsonl_rows(log_dir / "metrics.jsonl"))
    )
    (spaced.parent / "events.jsonl").write_bytes((log_dir / "events.jsonl").read_bytes())
    mine, decoded = explain(log_dir).to_json(), explain(spaced.parent).to_json()
    assert mine.pop("metrics") != decoded.pop("metrics")
    assert mine == decoded
    assert mine["slowest"][0]["step"] == 3
    assert mine["step"]["phases"][0]["name"] == "générer"
    assert mine["step"]["critical_path"].startswith("driver:générer (")


@pytest.mark.slow
def test_a_100k_row_file_is_streamed(log_dir, tmp_path):
    """A real run's rows repeated as 100,000 steps: read in seconds, in a few MB per column."""
    slow_step_run(log_dir, steps=4, slow=1)
    written = jsonl_rows(log_dir / "metrics.jsonl")
    big = tmp_path / "big" / "metrics.jsonl"
    big.parent.mkdir()
    with big.open("w") as f:
        for step in range(100_000):
            row = written[step % len(written)]
            f.write(json.dumps({**row, "step": step}, separators=(",", ":")) + "\n")
    started = time.perf_counter()
    answer = explain(big.parent)
    took = time.perf_counter() - started
    assert answer.steps == 100_000 and answer.step_ranges == "0-99999"
    slow_wall = written[1]["metrics"]["anatomy/wall/seconds"]
    assert [s.seconds for s in answer.slowest] == [slow_wall] * 5
    assert [s.step for s in answer.slowest] == [1, 5, 9, 13, 17]  # ties: lowest steps first
    assert took < 30, took


def relaunch(log_dir: Path, steps: range, slow: dict[int, float], run_id: str = "x") -> None:
    """One launch of run ``run_id``: a timed generation at each step, ``slow[step]`` seconds
    long where given (else 0.01)."""
    with Logger({"log_dir": str(log_dir), "run_id": run_id}) as logger:
        for step in steps:
            with logger.timer("generation"):
                time.sleep(slow.get(step, 0.01))
            logger.log_metrics({"loss": float(step)}, step=step)


def test_a_relaunched_run_is_read_at_its_latest_attempt(log_dir):
    """Run ``x`` logs 0-9 (its step 8 very slow), is relaunched from step 5 and logs 5-12 (its
    step 7 slow): the steps are 0-12 once each, 5-9 with the second attempt's rows, so the slow
    step 8 of the superseded attempt is not among the slowest."""
    relaunch(log_dir, range(10), {8: 0.5})
    relaunch(log_dir, range(5, 13), {7: 0.25})
    path = log_dir / "metrics.jsonl"
    every = rows_by_step(path, every_attempt=True)
    latest = rows_by_step(path)
    assert sorted(latest) == list(range(13))
    walls = {s: row["anatomy/wall/seconds"] for s, row in latest.items()}
    assert max(walls, key=walls.__getitem__) == 7 and walls[7] >= 0.25
    assert walls[8] < 0.25  # the second attempt's step 8
    first_eight = [r for r in jsonl_rows(path) if r["step"] == 8 and r["attempt"] == 1]
    assert first_eight[0]["metrics"]["anatomy/wall/seconds"] >= 0.5  # there, but superseded
    assert every[8]["anatomy/wall/seconds"] == walls[8]  # merged: the later line wins

    out = why(log_dir).stdout.splitlines()
    assert out[0] == f"otel-rl why: {path} (13 steps: 0-12)"
    median = statistics.median(walls.values())
    assert f"slowest steps (step time; median {duration(median)}):" in out
    listed = out.index(f"slowest steps (step time; median {duration(median)}):")
    assert out[listed + 1].startswith(f"  step 7: {duration(walls[7])} (")
    assert "  attempt 2 resumed at step 5; 5 superseded rows of attempt 1 left out" in out
    assert not any("written again" in line or "rows of 2 runs" in line for line in out)

    answer = json.loads(why(log_dir, "--step", "8", "--json").stdout)
    assert answer["steps"] == 13 and answer["step_ranges"] == "0-12"
    assert answer["step"]["step"] == 8 and answer["step"]["seconds"] == walls[8]
    assert answer["attempts"] == {
        "resumes": [{"run_id": "x", "attempt": 2, "step": 5}],
        "superseded": [{"run_id": "x", "attempt": 1, "rows": 5}],
    }
    assert "attempt 2 resumed at step 5; 5 superseded rows of attempt 1 left out" in (
        answer["notes"]
    )


def test_a_third_attempt_below_the_second_and_a_resume_record_last(log_dir, tmp_path):
    """Attempt 3 goes back to step 3, below attempt 2's 5: steps 0-2 are the first attempt's,
    3-7 the third's, attempt 2's 8-12 are gone. Then the same file cut right after a fourth
    launch's resume record (a kill between that record and its first row): its rows from step 6
    on are superseded with nothing after them."""
    relaunch(log_dir, range(10), {})
    relaunch(log_dir, range(5, 13), {})
    relaunch(log_dir, range(3, 8), {4: 0.2})
    answer = explain(log_dir)
    assert (answer.steps, answer.step_ranges) == (8, "0-7")
    assert answer.slowest[0].step == 4
    assert (
        "attempt 2 resumed at step 5; attempt 3 resumed at step 3; 7 superseded rows of "
        "attempt 1 left out; 8 superseded rows of attempt 2 left out"
    ) in answer.notes

    relaunch(log_dir, range(6, 9), {})
    lines = (log_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    cut = max(i for i, line in enumerate(lines) if '"resume":' in line) + 1
    assert json.loads(lines[cut - 1])["resume"] == {"attempt": 4, "step": 6}
    killed = tmp_path / "killed" / "metrics.jsonl"
    killed.parent.mkdir()
    killed.write_text("".join(lines[:cut]))
    out = why(killed.parent).stdout.splitlines()
    assert out[0].endswith("(6 steps: 0-5)")
    assert (  # attempt 4 supersedes attempt 3's 6-7; attempt 2's rows were gone already
        "  attempt 2 resumed at step 5; attempt 3 resumed at step 3; attempt 4 resumed at step "
        "6; 7 superseded rows of attempt 1 left out; 8 superseded rows of attempt 2 left out; "
        "2 superseded rows of attempt 3 left out"
    ) in out
    done = why(killed.parent, "--step", "7", check=False)
    assert done.returncode == 2
    assert one_clear_line(done.stderr) == (
        "otel-rl why: step 7 is not in the run; its steps: 0-5"
    )


def test_a_relaunched_run_read_by_its_layout_and_decoded_as_json_gives_one_answer(
    log_dir, tmp_path
):
    """The resume record and the rows with ``"attempt"`` read without decoding, and the same
    lines written in another layout (decoded as JSON), give the same answer; so does a file
    written before attempts existed (the same rows without ``"attempt"``) for a single run."""
    relaunch(log_dir, range(6), {2: 0.1})
    relaunch(log_dir, range(3, 8), {5: 0.2})
    written = jsonl_rows(log_dir / "metrics.jsonl")
    spaced = tmp_path / "spaced" / "metrics.jsonl"
    spaced.parent.mkdir()
    spaced.write_text("".join(json.dumps(row) + "\n" for row in written))
    mine, decoded = explain(log_dir).to_json(), explain(spaced.parent).to_json()
    assert mine.pop("metrics") != decoded.pop("metrics")
    assert mine == decoded
    assert mine["steps"] == 8 and mine["slowest"][0]["step"] == 5
    assert mine["attempts"]["superseded"] == [{"run_id": "x", "attempt": 1, "rows": 3}]

    single = tmp_path / "single" / "metrics.jsonl"
    single.parent.mkdir()
    first = [r for r in written if r["attempt"] == 1]
    single.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in first))
    old = tmp_path / "old" / "metrics.jsonl"
    old.parent.mkdir()
    old.write_text("".join(
        json.dumps({k: v for k, v in r.items() if k != "attempt"}, separators=(",", ":")) + "\n"
        for r in first
    ))  # fmt: skip
    assert '"attempt"' not in old.read_text()
    now, before = explain(single.parent).to_json(), explain(old.parent).to_json()
    assert now.pop("metrics") != before.pop("metrics")
    assert now == before
    assert now["steps"] == 6 and now["slowest"][0]["step"] == 2
    assert now["attempts"] == {"resumes": [], "superseded": []}


def test_a_reader_that_stops_early_ends_the_command_quietly_with_141(log_dir, tmp_path):
    """``otel-rl why DIR --json | head -2``: the reader closes the pipe after two lines while
    the command still has most of its answer to print (far beyond a pipe's buffer, so the
    closing always comes first). The command stops there: nothing on stderr, exit code 141
    (128 + SIGPIPE, as the shell reports for ``cat``; docs/anatomy.md)."""
    from otel_rl.cli.main import STDOUT_CLOSED

    slow_step_run(log_dir, steps=4, slow=1)
    written = jsonl_rows(log_dir / "metrics.jsonl")
    big = tmp_path / "big" / "metrics.jsonl"
    big.parent.mkdir()
    with big.open("w") as f:
        for step in range(2000):
            row = written[step % len(written)]
            f.write(json.dumps({**row, "step": step}, separators=(",", ":")) + "\n")
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        command = subprocess.Popen(
            [*CLI, "why", str(big.parent), "--json", "--top", "2000"],
            stdout=subprocess.PIPE, stderr=err,
        )  # fmt: skip
        assert command.stdout is not None
        first = [command.stdout.readline() for _ in range(2)]
        command.stdout.close()
        code = command.wait(timeout=120)
    assert first == [b"{\n", f'  "metrics": {json.dumps(str(big))},\n'.encode()]
    assert stderr.read_text() == ""
    assert code == STDOUT_CLOSED == 141
    # The same answer read whole: far more than the pipe held when the reader left.
    assert len(json.dumps(explain(big.parent, top=2000).to_json(), indent=2)) > 256 * 1024


def _stalling_launch(log_dir: Path, steps: range, stall_at: int) -> None:
    cfg = {"log_dir": str(log_dir), "run_id": "x", "stalls": {"after": 0.3, "factor": 1.0}}
    with Logger(cfg) as logger:
        for step in steps:
            with logger.timer("generation"):
                time.sleep(1.2 if step == stall_at else 0.01)
            with logger.timer("train"):
                time.sleep(0.005)
            logger.log_metrics({"loss": float(step)}, step=step)


def test_where_the_run_s_time_went_adds_up_to_its_rows_stalls_and_relaunches(log_dir):
    """Run ``x`` logs 0-9 (its step 8 stalls 1.2 s: a stall report), is relaunched from step 5
    and logs 5-12 (its step 11 stalls too): the steps' time is the kept rows' walls summed, each
    phase its rows summed, the stalls the kept one's report (the first attempt's stall is in a
    step done again: its time is the relaunch's, not counted twice), the relaunch the walls of
    the superseded rows (attempt 1's 5-9, its stalled step 8 among them)."""
    _stalling_launch(log_dir, range(10), stall_at=8)
    _stalling_launch(log_dir, range(5, 13), stall_at=11)
    path = log_dir / "metrics.jsonl"
    latest = rows_by_step(path)
    total = sum(row["anatomy/wall/seconds"] for row in latest.values())
    keys = {k for r in latest.values() for k in r if k.startswith("anatomy/")
            and k.endswith("/seconds") and k != "anatomy/wall/seconds"
            and not k.startswith("anatomy/critical/")}  # fmt: skip
    phases = {k[len("anatomy/") : -len("/seconds")]: sum(r.get(k, 0.0) for r in latest.values())
              for k in keys}  # fmt: skip
    redone = [r for r in jsonl_rows(path) if r.get("attempt") == 1 and 5 <= r.get("step", -1) <= 9]
    redone_seconds = sum(r["metrics"]["anatomy/wall/seconds"] for r in redone)
    assert redone_seconds > 1.2  # the stalled step 8 of the first attempt is among them
    reports = {r["attempt"]: r for r in (json.loads(p.read_text())
                                         for p in (log_dir / "stalls").glob("*.json"))}  # fmt: skip
    assert sorted(reports) == [1, 2] and reports[2]["last_step"] == 10

    answer = json.loads(why(log_dir, "--json").stdout)["time_spent"]
    assert answer["steps_seconds"] == pytest.approx(total, rel=1e-9)
    assert dict(answer["phases"]) == pytest.approx(phases, rel=1e-9)
    assert sum(s for _, s in answer["phases"]) == pytest.approx(total, rel=1e-3)
    assert answer["phases"][0][0] == "generation"  # the largest first
    assert (answer["stalls"], answer["stalls_seconds"]) == (1, reports[2]["ended"]["seconds"])
    assert answer["stalls_seconds"] < total
    assert answer["redone_steps"] == 5
    assert answer["redone_seconds"] == pytest.approx(redone_seconds, rel=1e-9)

    out = why(log_dir).stdout.splitlines()
    head = out.index(f"where the run's time went ({duration(total)} of steps):")
    generation = phases["generation"]
    assert out[head + 1] == "  by phase:"
    assert out[head + 2].split() == ["generation", *duration(generation).split(),
                                     *percent(generation / total).split()]  # fmt: skip
    assert (f"  lost to relaunches: {duration(redone_seconds)} (5 step row(s) a later attempt "
            "did again)") in out  # fmt: skip
    assert any(line.startswith("  lost to 1 stall(s): ") for line in out)


def test_a_stall_of_one_of_several_runs_in_a_log_dir_is_placed_in_its_own_run(log_dir):
    """A script run three times on one log_dir (runs ``a``, ``b``, ``c``); ``b`` stalls after
    step 2 and finishes without step 3, which ``c`` logs later. The stall is ``b``'s: on the
    run's picture it is in the second launch (not the first, whose attempt number it shares),
    and ``why`` does not count it in the steps' time, as the step it held up was done again by
    a later run (as by a relaunch)."""
    for run_id in ("a", "b", "c"):
        cfg = {"log_dir": str(log_dir), "run_id": run_id, "tracing": {"picture": False},
               "stalls": {"after": 0.3, "factor": 1.0}}  # fmt: skip
        with Logger(cfg) as logger:
            for step in range(3 if run_id == "b" else 6):
                with logger.timer("generation"):
                    time.sleep(0.02)
                logger.log_metrics({"loss": float(step)}, step=step, step_finished=True)
            if run_id == "b":
                time.sleep(1.0)  # the watchdog reports the stall; the run ends in it
        time.sleep(0.2)
    (path,) = sorted((log_dir / "stalls").glob("*.json"))
    report = StallFile.read(path)
    assert (report.run_id, report.attempt, report.last_step) == ("b", 1, 2)
    (stall,) = load_run(log_dir).stalls
    assert stall.attempt == 2 and stall.last_step == 2
    answer = explain(log_dir)
    (listed,) = answer.stalls
    assert listed.run_id == "b" and listed.last_step == 2
    assert answer.time_spent.stalls == 0 and answer.time_spent.stalls_seconds == 0.0
    out = why(log_dir).stdout.splitlines()
    assert not any(line.startswith("  lost to") and "stall" in line for line in out), out
