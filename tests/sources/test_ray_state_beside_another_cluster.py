"""A second Ray cluster on the machine (another job's, or a second ``ray.init()`` beside this
one): the stall report still asks Ray's state API about the cluster this process is connected
to, through that cluster's dashboard. Without an address the API looks for any local cluster
and, finding two, refuses ("Found multiple active Ray instances"), so the report lost the
actors' stacks and the task behind a ``ray.get``; and a cluster started without its dashboard
records the default dashboard port all the same, where the other cluster's dashboard answered
about tasks it never ran. Two real local clusters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from otel_rl.watch.stalls import ray_stacks, ray_state_address

# Holds a cluster of its own until its stdin closes.
_OTHER_CLUSTER = """
import sys
import ray
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.slow
def test_the_stall_report_asks_its_own_cluster_when_another_runs_on_the_machine(
    ray_with_dashboard,
):
    ray = ray_with_dashboard
    other = subprocess.Popen(
        [sys.executable, "-c", _OTHER_CLUSTER],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert other.stdout is not None and other.stdin is not None
        theirs = other.stdout.readline().strip()
        assert theirs, "the other cluster did not start"

        @ray.remote(num_cpus=0)
        class Rollout:
            def ping(self) -> int:
                return 1

        actor = Rollout.remote()
        assert ray.get(actor.ping.remote()) == 1
        assert ray.get_runtime_context().gcs_address != theirs
        assert ray_state_address() == f"http://{ray._private.worker.get_dashboard_url()}"
        stacks = ray_stacks(timeout=30)
        assert stacks["available"], stacks
        (entry,) = stacks["actors"]
        assert entry["actor_id"] == actor._actor_id.hex()
        assert entry["actor"].endswith(".Rollout")
    finally:
        if other.stdin is not None:
            other.stdin.close()
        try:
            other.wait(60)
        except subprocess.TimeoutExpired:
            other.kill()
            other.wait(10)


# A driver of a cluster of its own without a dashboard, beside the test's cluster (which has one,
# on the default port): what the stall report would ask, and what it gets.
_WITHOUT_A_DASHBOARD = """
import json
import ray
from otel_rl.watch.stalls import ray_stacks, ray_state_address
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=0)
class Rollout:
    def ping(self):
        return 1

actor = Rollout.remote()
ray.get(actor.ping.remote())
try:
    address = ray_state_address()
except LookupError as exc:
    address = f"LookupError: {exc}"
print(json.dumps({"address": address, "stacks": ray_stacks(timeout=30)}), flush=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_cluster_without_a_dashboard_is_never_answered_for_by_another_clusters(
    ray_with_dashboard,
):
    ray = ray_with_dashboard
    ours = ray._private.worker.get_dashboard_url()
    assert ours  # the other cluster's dashboard, on this machine

    @ray.remote(num_cpus=0)
    class Elsewhere:
        def ping(self) -> int:
            return 1

    theirs = Elsewhere.remote()  # an actor the driver below must never be told about
    assert ray.get(theirs.ping.remote()) == 1
    done = subprocess.run([sys.executable, "-c", _WITHOUT_A_DASHBOARD], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["address"] == "LookupError: no dashboard runs in this Ray cluster"
    stacks = answer["stacks"]
    assert stacks["available"] is False, stacks
    assert "no dashboard runs in this Ray cluster" in stacks["reason"]
