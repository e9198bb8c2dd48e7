"""What a fault-injection run logs, and the seeded plan of one iteration.

Both the training child and the checker import this module, so "what step ``s`` must hold" has
one definition: keys :func:`keys_of`, values :func:`value_of`, split over the calls of
:func:`calls_of`. Values are exact in float32 (TensorBoard's ``simple_value``) below step 2**21.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from typing import Any

KEYS = ("f/a", "f/b", "f/c")

#: Seconds of scheduling slack added to ``fsync_interval`` when deciding which steps must have
#: survived a kill: the spool thread shares two cores with the loop, the parent and other tests.
DEFAULT_GRACE = 0.3


def keys_of(step: int) -> tuple[str, ...]:
    """The keys step ``step`` holds once every call of that step returned."""
    return KEYS if step % 3 == 0 else KEYS[:2]


def value_of(step: int, key: str) -> float:
    return step + KEYS.index(key) * 0.25


def calls_of(step: int) -> list[dict[str, float]]:
    """The ``log_metrics`` calls of one step: odd steps take two calls that merge into one row."""
    values = {key: value_of(step, key) for key in keys_of(step)}
    if step % 2:
        first = dict(list(values.items())[:1])
        rest = dict(list(values.items())[1:])
        return [first, rest]
    return [values]


@dataclass
class ChildPlan:
    """What the training child does (passed to it as JSON)."""

    log_dir: str
    seed: str
    # "paced" (variable step times), "tight" (no pause), "finish" (N steps, finish()), "overload"
    # (no pause for max_seconds, then finish() far behind the trackers)
    loop: str
    steps: int  # steps before finish() ("finish" loops); others run until killed
    long_steps: bool  # some paced steps take 0.3-1.2 s (the pending step of a long step)
    fsync_interval: float
    shutdown_timeout: float
    tensorboard: bool = True
    faultfile: dict[str, str] | None = None  # {"path", "control"} of the test tracker
    mlflow: dict[str, str] | None = None  # {"tracking_uri", "experiment_name"}
    max_seconds: float = 60.0  # a child nobody kills ends on its own
    delivery: str = "thread"  # export.delivery: the trackers in threads or a delivery process
    # [start, seconds]: the delivery process is stopped (SIGSTOP) that long, that many seconds
    # after the Logger is ready, so that what the pipe cannot take goes to handoff files.
    pause_delivery: list[float] | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ChildPlan:
        return cls(**json.loads(text))

    def logger_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "log_dir": self.log_dir,
            "jsonl_enabled": True,
            "tensorboard_enabled": self.tensorboard,
            "export": {
                "fsync_interval": self.fsync_interval,
                "shutdown_timeout": self.shutdown_timeout,
                "retry_max_backoff": 0.2,
                "delivery": self.delivery,
            },
        }
        if self.faultfile is not None:
            cfg["trackers"] = {"faultfile": dict(self.faultfile)}
        if self.mlflow is not None:
            cfg["mlflow_enabled"] = True
            cfg["mlflow"] = dict(self.mlflow)
        return cfg


@dataclass
class IterationPlan:
    """Where and how one iteration injects its faults; everything follows from ``seed``."""

    seed: str
    # "loop", "tight" (inside log_metrics, most likely), "finish", or "overload" (a loop flat
    # out, then finish() far behind: killed in the loop, in finish(), or not at all)
    kill_point: str
    signal: str  # SIGKILL, SIGTERM or SIGINT
    kill_delay: float  # seconds after the Logger is ready ("finish": after finish() starts)
    steps: int
    long_steps: bool
    tracker_mode: str  # faultfile: "ok", "slow" or "outage"
    slow_delay: float
    outage_start: float  # seconds after ready
    outage_end: float | None  # None: the tracker is down until the replay
    replay_kill_signal: str | None
    replay_kill_delay: float
    replay_slow: bool  # the tracker is slow during the first replay (a kill lands mid-delivery)
    mlflow: bool = False  # a real MLflow server is one of the trackers
    mlflow_down_at: float | None = None  # the MLflow server is stopped then
    # The operator's seat: the run uses relative paths from its own directory and is replayed
    # from another one; two replays start at once; a replay is tried while the run still lives;
    # bytes of one tracker's spool are damaged before the replay (that tracker, else None).
    relative_paths: bool = False
    concurrent_replays: bool = False
    replay_during_run: bool = False
    corrupt: str | None = None
    delivery: str = "thread"  # "process": the trackers run in the delivery process
    # [start, seconds] of a stopped delivery process (before a SIGKILL: in the loop, or in a
    # finish() whose deadline may pass while it is stopped).
    pause_delivery: list[float] | None = None
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        outage = ""
        if self.tracker_mode == "outage":
            end = "replay" if self.outage_end is None else f"{self.outage_end:.2f}s"
            outage = f" outage {self.outage_start:.2f}s..{end}"
        elif self.tracker_mode == "slow":
            outage = f" slow {self.slow_delay * 1000:.0f}ms/write"
        replay = ""
        if self.replay_kill_signal:
            replay = f", replay {self.replay_kill_signal} at {self.replay_kill_delay:.2f}s"
        mlflow = ", mlflow" if self.mlflow else ""
        if self.mlflow_down_at is not None:
            mlflow += f" down at {self.mlflow_down_at:.2f}s"
        seat = [name for name, on in (("relative paths", self.relative_paths),
                                      ("two replays at once", self.concurrent_replays),
                                      ("replay during the run", self.replay_during_run)) if on]
        if self.corrupt:
            seat.append(f"{self.corrupt} spool damaged")
        if self.delivery != "thread":
            seat.append(f"delivery {self.delivery}")
        if self.pause_delivery is not None:
            start, seconds = self.pause_delivery
            seat.append(f"delivery process stopped {start:.2f}s..{start + seconds:.2f}s")
        operator = f", {', '.join(seat)}" if seat else ""
        return (
            f"seed={self.seed} kill={self.kill_point}/{self.signal}@{self.kill_delay:.3f}s "
            f"steps={self.steps} long_steps={self.long_steps} faultfile={self.tracker_mode}"
            f"{outage}{replay}{mlflow}{operator}"
        )


def make_plan(
    base_seed: str | int, index: int, shutdown_timeout: float, mlflow: bool
) -> IterationPlan:
    """The plan of iteration ``index``; string seeding is stable across processes and runs."""
    seed = f"{base_seed}:{index}"
    rng = random.Random(seed)
    kill_point = rng.choices(["loop", "tight", "finish"], weights=[4, 3, 3])[0]
    signal = rng.choices(["SIGKILL", "SIGTERM", "SIGINT"], weights=[2, 1, 1])[0]
    if kill_point == "loop":
        delay = rng.uniform(0.6, 2.5)  # mostly past fsync_interval + grace: rows to expect
    elif kill_point == "tight":
        delay = rng.uniform(0.6, 1.4)
    elif rng.random() < 0.5:  # finish(): often right at its start, where a fast drain ends
        delay = rng.uniform(0.0, 0.05)
    else:
        delay = rng.uniform(0.0, 1.2 * shutdown_timeout)
    mode = rng.choices(["ok", "slow", "outage"], weights=[4, 3, 3])[0]
    outage_start = rng.choice([0.0, rng.uniform(0.0, 1.0)])
    outage_end = rng.choice([None, outage_start + rng.uniform(0.2, 1.5)])
    replay_kill = rng.random() < 0.4
    plan = IterationPlan(
        seed=seed,
        kill_point=kill_point,
        signal=signal,
        kill_delay=delay,
        steps=rng.randint(20, 400),
        long_steps=rng.random() < 0.5,
        tracker_mode=mode,
        slow_delay=rng.uniform(0.002, 0.05),
        outage_start=outage_start,
        outage_end=outage_end,
        replay_kill_signal=rng.choice(["SIGKILL", "SIGTERM", "SIGINT"]) if replay_kill else None,
        replay_kill_delay=rng.uniform(0.3, 1.0),
        replay_slow=replay_kill and rng.random() < 0.8,
        mlflow=mlflow,
        mlflow_down_at=(rng.uniform(0.0, 1.5) if mlflow and rng.random() < 0.3 else None),
        relative_paths=rng.random() < 0.3,
        concurrent_replays=rng.random() < 0.25,
        replay_during_run=rng.random() < 0.25,
        corrupt=(
            rng.choice(["jsonl", "tensorboard", "faultfile"]) if rng.random() < 0.25 else None
        ),
        # Drawn last: the plans of a seed drawn before this dimension existed stay the same.
        delivery="process" if rng.random() < 0.3 else "thread",
    )
    if plan.delivery == "process" and signal == "SIGKILL" and rng.random() < 0.6:
        start = rng.uniform(0.0, 1.0)
        plan.pause_delivery = [start, rng.uniform(0.3, 2.0)]
    if rng.random() < OVERLOAD_SHARE:
        _overload(plan, rng)
    return plan


#: The share of iterations that overload the trackers (drawn last, as the dimensions above).
OVERLOAD_SHARE = 0.15
#: Seconds an overload loop logs flat out before its finish().
OVERLOAD_SECONDS = 1.5


def _overload(plan: IterationPlan, rng: random.Random) -> None:
    """A loop flat out for OVERLOAD_SECONDS, then finish(), whose deadline passes far behind
    the trackers, in either delivery mode; SIGKILLed in the loop, in finish(), or not at all
    (then every step logged must arrive)."""
    plan.kill_point = "overload"
    plan.signal = "SIGKILL"
    plan.kill_delay = rng.choice([rng.uniform(0.3, OVERLOAD_SECONDS),
                                  rng.uniform(OVERLOAD_SECONDS, OVERLOAD_SECONDS + 1.5),
                                  600.0])  # fmt: skip
    plan.delivery = rng.choice(["thread", "process"])
    plan.tracker_mode = rng.choice(["ok", "slow"])
    plan.replay_slow = False
    plan.replay_during_run = False
    plan.pause_delivery = None
