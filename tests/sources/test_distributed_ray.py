"""Worker metrics on a real local Ray cluster: 4 actors, snapshots returned with the results and
pushed to the named MetricsAggregator, merged by the driver's Logger into TensorBoard and JSONL.

One cluster for the module (a head costs ~6 s and ~500 MiB); the actors take no CPU slot.
"""

from __future__ import annotations

import statistics
import time

import pytest

from testkit.readers import jsonl_rows, tensorboard_scalars

N_ACTORS = 4
STEPS = 3
#: Seconds a call to the actors may take before the test fails (not hangs: a call lost inside
#: Ray, seen once on a loaded machine, would otherwise hold the whole suite).
GET_TIMEOUT = 120


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def make_trainer_class(ray):
    # Defined inside a function so Ray ships the class by value to its workers.
    class Trainer:
        def __init__(self, rank: int, aggregator_name: str) -> None:
            from otel_rl import WorkerMetrics
            from otel_rl.ray import MetricsAggregator

            self.rank = rank
            self.metrics = WorkerMetrics(rank=rank, role="trainer")
            self.aggregator = MetricsAggregator.connect(aggregator_name)

        def train_step(self, step: int) -> dict:
            r, m = self.rank, self.metrics
            m.record("loss", (r + 1) * (step + 1))  # mean by default
            m.record("tokens", 100 * (r + 1) + step, reduce="sum")
            m.record("grad_norm", r + 0.5 * step, reduce="max")
            m.record("entropy", 1.0 - 0.25 * r + step, reduce="min")
            m.record("reward", r + step, weight=r + 1)  # weighted mean
            m.record("sample_count", 8)  # "sum" from the driver's config
            m.record("lr", 1e-3 / (step + 1), reduce="last")
            generate = m.timer("generate")
            for _ in range(2):  # repeated timers add up within the step
                with generate:
                    time.sleep(0.01 * (r + 1))
            snapshot = m.snapshot(step=step)
            self.aggregator.push(snapshot)
            return {"loss": float(step), "metrics": snapshot}

        def push_stats(self) -> dict:
            return dict(self.aggregator.stats)

    return ray.remote(num_cpus=0)(Trainer)


def expected_row(step: int) -> dict[str, float]:
    ranks = range(N_ACTORS)
    return {
        "loss": sum((r + 1) * (step + 1) for r in ranks) / N_ACTORS,
        "tokens": sum(100 * (r + 1) + step for r in ranks),
        "grad_norm": N_ACTORS - 1 + 0.5 * step,
        "entropy": 1.0 - 0.25 * (N_ACTORS - 1) + step,
        "reward": sum((r + step) * (r + 1) for r in ranks) / sum(r + 1 for r in ranks),
        "sample_count": 8.0 * N_ACTORS,
        "lr": 1e-3 / (step + 1),
    }


@pytest.mark.slow
def test_four_actors_merge_into_exact_rows_via_results_and_the_aggregator(ray_cluster, log_dir):
    ray = ray_cluster
    from otel_rl import Logger
    from otel_rl.ray import MetricsAggregator

    aggregator = MetricsAggregator.start("test-aggregator")
    trainers = [make_trainer_class(ray).remote(r, "test-aggregator") for r in range(N_ACTORS)]
    cfg = {
        "log_dir": str(log_dir),
        "tensorboard_enabled": True,
        "reductions": {"*/sample_count": "sum", "timing/*": ["max", "min", "mean"]},
    }
    totals: dict[int, list[float]] = {}
    busiest: dict[int, int] = {}
    with Logger(cfg) as logger:
        for step in range(STEPS):
            results = ray.get([t.train_step.remote(step) for t in trainers], timeout=GET_TIMEOUT)
            returned = [res["metrics"] for res in results]
            totals[step] = [s["timings"]["timing/generate"][0] for s in returned]
            # each rank's own timer seconds, as the anatomy counts them (its phase clock)
            busiest[step] = max(range(N_ACTORS), key=lambda r: sum(returned[r]["anatomy"].values()))
            logger.log_worker_metrics(returned, step=step, prefix="train")
            pushed = aggregator.drain(step, expect=N_ACTORS, timeout=30)
            assert sorted(s["rank"] for s in pushed) == list(range(N_ACTORS))
            logger.log_worker_metrics(pushed, step=step, prefix="pushed")
    assert aggregator.actor_stats() == {
        "received": N_ACTORS * STEPS, "drained": N_ACTORS * STEPS, "dropped": 0, "held": 0,
    }  # fmt: skip
    aggregator.kill()

    rows = {r["step"]: r["metrics"] for r in jsonl_rows(log_dir / "metrics.jsonl")}
    assert sorted(rows) == list(range(STEPS))
    scalars = tensorboard_scalars(log_dir / "tensorboard")
    for step in range(STEPS):
        row = rows[step]
        times = totals[step]
        expected = {**expected_row(step)}
        expected["timing/generate"] = max(times)
        expected["timing/generate/min"] = min(times)
        expected["timing/generate/mean"] = sum(times) / N_ACTORS
        # the snapshots come back in rank order: the slowest is the index of the max total
        expected["timing/generate/slowest_rank"] = float(times.index(max(times)))
        expected["timing/generate/skew"] = max(times) / statistics.median(times)
        for prefix in ("train", "pushed"):
            got = {k.split("/", 1)[1]: v for k, v in row.items() if k.startswith(prefix + "/")}
            assert got.keys() == expected.keys()
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-12), (prefix, key)
                tag = f"{prefix}/{key}"
                assert (step, pytest.approx(value, rel=1e-6)) in scalars[tag], tag
        # rank r slept twice (r+1)*10 ms: max and min are at least those. Which rank was
        # slowest is the one whose measured total is largest (checked above from the actors'
        # own totals), not the one that asked for the longest sleep: on a loaded machine a
        # 20 ms margin between two ranks' sleeps is not an order.
        assert row["train/timing/generate"] >= 0.08
        assert row["train/timing/generate/min"] >= 0.02
        # the step's anatomy: the trainers' own timer seconds (each snapshot counted once,
        # though logged under two prefixes); the driver timed nothing, so its link is untimed
        # (the timer's histogram and the phase clock read the same block with clock reads of
        # their own: on a loaded machine they part by a scheduling delay, a few milliseconds)
        wall = row["anatomy/wall/seconds"]
        busy = row["anatomy/trainer/busy_fraction"] * wall
        assert busy == pytest.approx(statistics.median(times), abs=0.005)
        assert row["anatomy/trainer/busiest_rank"] == busiest[step]
        critical = row["anatomy/critical/trainer/generate/seconds"]
        assert critical == pytest.approx(max(times), rel=0.01)
    assert rows[0]["anatomy/critical_path"] == (
        f"driver:untimed > trainer rank {busiest[0]}:generate"
    )


@pytest.mark.slow
def test_a_dead_aggregator_never_blocks_a_worker(ray_cluster):
    ray = ray_cluster
    from otel_rl.ray import MetricsAggregator

    aggregator = MetricsAggregator.start("short-lived")
    trainer = make_trainer_class(ray).remote(0, "short-lived")
    ray.get(trainer.train_step.remote(0), timeout=GET_TIMEOUT)
    assert len(aggregator.drain(0, expect=1, timeout=30)) == 1
    aggregator.kill()

    started = time.monotonic()
    results = ray.get([trainer.train_step.remote(step) for step in range(1, 4)], timeout=60)
    elapsed = time.monotonic() - started
    assert [r["loss"] for r in results] == [1.0, 2.0, 3.0]  # the worker kept working
    stats = ray.get(trainer.push_stats.remote(), timeout=GET_TIMEOUT)
    assert stats["pushed"] >= 1 and stats["failed"] + stats["dropped"] >= 1
    # generous: 3 steps sleep 60 ms in total; a blocked push would wait for a Ray timeout
    assert elapsed < 20


@pytest.mark.slow
def test_a_late_snapshot_of_an_earlier_step_does_not_count_towards_a_drain_s_expect(ray_cluster):
    """Rank 1's snapshot of step 0 comes after step 0's drain gave up on it: step 1's drain
    takes it, and still waits for the two snapshots of step 1 (it counted the late one, and
    returned without rank 1's step 1, which then slipped a step: for the rest of the run)."""
    ray = ray_cluster
    from otel_rl.ray import MetricsAggregator

    aggregator = MetricsAggregator.start("late-pushes")
    trainer = make_trainer_class(ray)
    first, second = trainer.remote(0, "late-pushes"), trainer.remote(1, "late-pushes")
    ray.get(first.train_step.remote(0), timeout=GET_TIMEOUT)
    assert [(s["rank"], s["step"]) for s in aggregator.drain(0, expect=2, timeout=1)] == [(0, 0)]
    ray.get([second.train_step.remote(0), first.train_step.remote(1)], timeout=GET_TIMEOUT)
    deadline = time.monotonic() + 30
    while aggregator.actor_stats()["held"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)

    @ray.remote(num_cpus=0)
    def later(actor):
        time.sleep(0.5)
        return ray.get(actor.train_step.remote(1), timeout=120)["loss"]

    pushing = later.remote(second)
    began = time.monotonic()
    drained = aggregator.drain(1, expect=2, timeout=30)
    assert sorted((s["rank"], s["step"]) for s in drained) == [(0, 1), (1, 0), (1, 1)]
    assert time.monotonic() - began >= 0.4
    assert ray.get(pushing, timeout=GET_TIMEOUT) == 1.0
    aggregator.kill()
