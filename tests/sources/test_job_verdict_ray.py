"""The job's verdict in a Ray job of two nodes: a worker group of four actors across both nodes
(real raylets started by ``ray start``, one gloo process group), one of them in a named function
instead of the group's ``all_reduce``, while the driver waits on ``ray.get`` of all four.

The driver is a process of its own: joining the two nodes takes Ray's settings for them
(:data:`testkit.ray_cluster.CLIENT_ENV`), which Ray keeps for the life of the process, and the
tests that run after this one in the same process start clusters of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from testkit.ray_cluster import CLIENT_ENV, two_node_cluster
from testkit.servers import free_port

pytestmark = pytest.mark.slow

# Ranks 0 and 1 on the second node, 2 and 3 on the head; rank 1 sits in ``load_the_next_shard``
# at the fourth step. Prints what the test checks the report against, as JSON.
_DRIVER = textwrap.dedent("""
    import json, os, sys, threading, time
    from pathlib import Path
    import ray
    from otel_rl import Logger
    from otel_rl.watch.job_state import RayBoard

    address, log_dir, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    head, second = sys.argv[4], sys.argv[5]

    @ray.remote(num_cpus=0)
    class TrainerWorker:
        def __init__(self, rank, port):
            self.rank, self.port = rank, port

        def join(self):
            import torch
            import torch.distributed as dist
            from otel_rl import WorkerMetrics
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{self.port}",
                                    rank=self.rank, world_size=4)
            self.metrics = WorkerMetrics(rank=self.rank, role="trainer")
            self.values = torch.ones(4)
            return ray.get_runtime_context().get_node_id(), os.getpid()

        def step(self, step):
            import torch.distributed as dist

            def load_the_next_shard():
                time.sleep(600)

            with self.metrics.timer("train"):
                if step == 3 and self.rank == 1:
                    load_the_next_shard()
                dist.all_reduce(self.values)
            self.metrics.snapshot(step)
            return self.rank

    def first_report(timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = sorted((log_dir / "stalls").glob("*.json"))
            if found:
                return found[0]
            time.sleep(0.2)
        raise SystemExit(f"no stall report within {timeout} s")

    ray.init(address=address, log_to_driver=False)
    group = [TrainerWorker.options(resources={second if rank < 2 else head: 1})
             .remote(rank, port) for rank in range(4)]
    places = ray.get([w.join.remote() for w in group], timeout=120)
    logger = Logger({"log_dir": str(log_dir), "stalls": {"after": 3, "stacks_timeout": 30}})
    for step in range(3):
        ray.get([w.step.remote(step) for w in group], timeout=60)
        logger.log_metrics({"loss": float(step)}, step=step)

    def end_the_group():
        first_report(180)
        for worker in group:
            ray.kill(worker)

    ender = threading.Thread(target=end_the_group, daemon=True)
    ender.start()
    with logger.timer("train"):
        try:
            ray.get([w.step.remote(3) for w in group])
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError):
            pass  # an actor killed, or a peer's all_reduce ended by that kill first
    ender.join(30)
    logger.finish()

    # the killed actors' states are no longer read, and their keys are removed
    board = RayBoard.of_this_job()
    deadline = time.monotonic() + 30
    while True:
        states, _ = board.read()
        if [s.role for s in states] == ["driver"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    from ray._private.worker import global_worker
    keys = global_worker.gcs_client.internal_kv_keys(f"{board.job_id}/".encode(),
                                                     RayBoard.NAMESPACE, timeout=5)
    print(json.dumps({
        "places": places, "head": ray.get_runtime_context().get_node_id(),
        "report": str(first_report(1)), "roles_after": [s.role for s in states],
        "keys_after": [k.decode() for k in keys], "job": board.job_id, "pid": os.getpid(),
    }))
""")


def test_the_actor_a_worker_group_waits_for_is_named_with_its_class_rank_node_and_function(
    tmp_path,
):
    """The driver's report says none of the four calls returned, names TrainerWorker rank 1 with
    its node id, its function and the all_reduce it is one behind, and follows rank 0's call
    into its stack, read by the second node's Ray agent; once the group is killed, the actors'
    states are no longer read."""
    pytest.importorskip("ray")
    pytest.importorskip("torch")
    log_dir = tmp_path / "logs"
    env = {**os.environ, **CLIENT_ENV, "PYTHONPATH": os.pathsep.join(sys.path)}
    with two_node_cluster(tmp_path / "ray") as cluster:
        head, second = cluster.resources
        done = subprocess.run(
            [sys.executable, "-c", _DRIVER, cluster.address, str(log_dir), str(free_port()),
             head, second],
            capture_output=True, text=True, timeout=600, env=env,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    places, head_id = seen["places"], seen["head"]
    assert [node != head_id for node, _ in places] == [True, True, False, False]
    stuck_node, stuck_pid = places[1]

    report = json.loads(Path(seen["report"]).read_text())
    text = report["verdict"]["text"]
    print(text)
    assert text.startswith(
        "TrainerWorker rank 1 has not joined all_reduce #4 on the default group (4 ranks), "
        "which ranks 0, 2, 3 wait in: it entered only #3 (1 behind) and is at "
        "load_the_next_shard (<string>:"
    ), text
    assert f"last step 2, pid {stuck_pid} on " in text
    assert f", node {stuck_node[:8]}…; as it said " in text
    # the driver's own wait: how many of the four calls returned, and the first one that did not
    assert ". The driver waits in train (" in text
    assert "on ray.get of TrainerWorker.step (0 of 4 returned)" in text
    assert "→ that actor is inside all_reduce" in text

    job = report["job"]
    (odd,) = job["odd_ones_out"]
    assert (odd["actor"], odd["rank"], odd["node_id"], odd["pid"]) == (
        "TrainerWorker", 1, stuck_node, stuck_pid)  # fmt: skip
    assert (odd["count"], odd["behind"]) == (3, 1)
    assert odd["at"].startswith("load_the_next_shard (<string>:")
    actors = sorted((p["rank"], p["node_id"]) for p in job["processes"] if p["actor"])
    assert actors == [(rank, node) for rank, (node, _) in enumerate(places)]
    assert job["not_heard_from"] == [] and job["missing"] == []
    # the stacks of the second node's actors were read there, by its Ray agent
    on_second = [a for a in report["ray"]["actors"] if a["node"] != head_id]
    assert len(on_second) == 2
    for actor in on_second:
        assert actor["via"].startswith("the Ray agent of node "), actor
        assert "all_reduce" in actor["stack"] or "load_the_next_shard" in actor["stack"]
    # killed, the actors are left out, and only the driver's key is left
    assert seen["roles_after"] == ["driver"]
    assert seen["keys_after"] == [f"{seen['job']}/driver-{seen['pid']}"]
