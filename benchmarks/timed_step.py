"""A real step on the training thread: five timers and 100 keys, beside the 100 keys alone.

A step of an instrumented RL loop times its phases and then logs its values. Here each step is
five timers around empty blocks (``generation``, ``reward``, ``ref_logprobs``, then ``train``
holding ``forward``), then ``log_metrics`` of 100 float keys with ``step_finished=True``
(``benchmarks.hot_loop.timed_step``); the same loop with the keys alone (``keys_step``) runs in
the same process, alternated with it, so the ratio of the two is what the timers cost a step.
A third side, the floor (``hot_loop.floor_step``), replaces the five timers with five bare
``with`` blocks that read the clock and append: what five blocks cost this interpreter at the
least, so ``ratio_floor_median`` is the lowest ratio any timer written in Python could reach.
Both are timed by ``training_thread``'s loop, through the public API only (``Logger(cfg)``,
``logger.timer(name)``, ``logger.log_metrics``), and reported as the training thread's median,
p99.9 and max per step, with each side's time from the loop's start until ``finish()`` returned
(every row in every tracker: ``*_durable_s``).

Two sets of trackers:

- **Four trackers** (``training_thread``'s: TensorBoard, MLflow on the shared local server,
  W&B offline, JSONL), with ``export.delivery: thread`` and ``process``: ``ROUNDS`` rounds of
  ``STEPS`` steps per side and mode, ``finish()`` given ``FINISH_TIMEOUT_S``.
- **The default config**, JSONL and TensorBoard only (``log_dir`` and ``tensorboard_enabled``,
  nothing else), and the same with ``tracing: {enabled: false}``: four sides alternated in one
  set of rounds (``ROUNDS`` of ``DEFAULT_STEPS`` steps each), the tracing row also giving its
  medians over the default's.

``--quick``: 30 steps of four trackers (``thread`` only, a local SQLite MLflow store) and 200
of the default config, one round.

    python -m benchmarks --only timed_step
    python -m benchmarks.timed_step [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.hot_loop import STEP_KINDS, floor_step
from benchmarks.training_thread import (
    four_trackers,
    make_rows,
    percentile,
    run_logger,
    tracker_environment,
    tracking_store,
)

STEPS, DEFAULT_STEPS, ROUNDS, KEYS = 500, 2_000, 3, 100
#: ``export.shutdown_timeout`` of the four trackers' runs (seconds).
FINISH_TIMEOUT_S = 120.0
#: The kinds of step: ``hot_loop.STEP_KINDS``'s two, and the floor (five bare ``with`` blocks
#: and the keys: ``hot_loop.floor_step``), what no timer written in Python can go below.
KEYS_ALONE, TIMED, FLOOR = "keys", "timers+keys", "floor+keys"
KINDS = {**STEP_KINDS, FLOOR: floor_step}

#: The default config's two variants: as a user writes it, and with tracing switched off.
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "defaults + tracing off": {"tracing": {"enabled": False}},
}


def default_config(log_dir: Path, variant: str) -> dict[str, Any]:
    """The acceptance configuration of a timed step: the defaults, with JSONL (on by default)
    and TensorBoard."""
    return {"log_dir": str(log_dir), "tensorboard_enabled": True, **DEFAULT_CONFIGS[variant]}


Side = tuple[str, str]  # (config, kind of step)


def alternate(
    configs: Mapping[str, Callable[[Path], dict[str, Any]]],
    rows: list[dict[str, float]],
    rounds: int,
    root: Path,
) -> dict[Side, list[dict[str, Any]]]:
    """Every config with each kind of step, in one order, then the reverse, ``rounds`` times:
    each side's runs (``run_logger``'s results)."""
    sides: list[Side] = [(config, kind) for config in configs for kind in KINDS]
    runs: dict[Side, list[dict[str, Any]]] = {side: [] for side in sides}
    for r in range(rounds):  # alternate so the machine's drift hits every side alike
        for i, (config, kind) in enumerate(sides if r % 2 == 0 else sides[::-1]):
            cfg = configs[config](root / f"round{r}-{i}")
            runs[config, kind].append(run_logger(cfg, rows, step=KINDS[kind]))
    return runs


def costs(runs: Sequence[dict[str, Any]]) -> list[float]:
    """µs per step over all the runs of a side."""
    return [c for run in runs for c in run["costs"]]


def summary(runs: Mapping[str, Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Each kind of step's median, p99.9 and max (``runs``: by kind), timed over keys alone
    for each, the floor's median over keys alone, and the median time from the loop's start
    until ``finish()`` returned (every row delivered)."""
    keys, timed = runs[KEYS_ALONE], runs[TIMED]
    out: dict[str, Any] = {}
    for side, each_run in (("keys", keys), ("timed", timed), ("floor", runs[FLOOR])):
        each = costs(each_run)
        out[f"{side}_median_us"] = round(statistics.median(each), 1)
        out[f"{side}_p99.9_us"] = round(percentile(each, 99.9), 1)
        out[f"{side}_max_us"] = round(max(each), 1)
    for measure in ("median", "p99.9", "max"):
        out[f"ratio_{measure}"] = round(out[f"timed_{measure}_us"] / out[f"keys_{measure}_us"], 2)
    out["ratio_floor_median"] = round(out["floor_median_us"] / out["keys_median_us"], 2)
    for side, each_run in (("keys", keys), ("timed", timed)):
        out[f"{side}_durable_s"] = round(statistics.median(r["durable_s"] for r in each_run), 2)
    return out


def four_tracker_config(log_dir: Path, tracking_uri: str, delivery: str) -> dict[str, Any]:
    """``training_thread``'s four trackers, given longer to finish: the rows with timers are
    more (their ``timing/*`` and ``anatomy/*`` keys), and what the training thread pays does
    not depend on how long MLflow takes to take them all."""
    cfg = four_trackers(log_dir, tracking_uri, delivery)
    cfg["export"]["shutdown_timeout"] = FINISH_TIMEOUT_S
    return cfg


def run(quick: bool = False) -> list[dict[str, Any]]:
    steps, default_steps = (30, 200) if quick else (STEPS, DEFAULT_STEPS)
    rounds = 1 if quick else ROUNDS
    out = []
    with tempfile.TemporaryDirectory(prefix="otel-rl-bench-") as tmp:
        root = Path(tmp)
        uri, store = tracking_store(quick, root)
        with tracker_environment(root):
            rows = make_rows(steps, KEYS)
            for delivery in ("thread",) if quick else ("thread", "process"):
                configs = {
                    delivery: partial(four_tracker_config, tracking_uri=uri, delivery=delivery)
                }
                runs = alternate(configs, rows, rounds, root / f"four-{delivery}")
                out.append({
                    "trackers": "TensorBoard + MLflow + W&B + JSONL", "mlflow": store,
                    "delivery": delivery, "steps": steps, "rounds": rounds,
                    **summary({kind: runs[delivery, kind] for kind in KINDS}),
                })  # fmt: skip
            rows = make_rows(default_steps, KEYS)
            configs = {v: partial(default_config, variant=v) for v in DEFAULT_CONFIGS}
            runs = alternate(configs, rows, rounds, root / "default")
            for variant in DEFAULT_CONFIGS:
                row = {
                    "trackers": f"JSONL + TensorBoard ({variant})", "delivery": "thread",
                    "steps": default_steps, "rounds": rounds,
                    **summary({kind: runs[variant, kind] for kind in KINDS}),
                }  # fmt: skip
                if variant != "defaults":
                    for kind, side in ((KEYS_ALONE, "keys"), (TIMED, "timed")):
                        ours = statistics.median(costs(runs[variant, kind]))
                        default = statistics.median(costs(runs["defaults", kind]))
                        row[f"{side}_median_vs_default"] = round(ours / default, 2)
                out.append(row)
    return out


def prepare(quick: bool = False) -> None:
    """Boot the MLflow server while the benchmarks before this one run."""
    if not quick:
        from benchmarks.mlflow_server import start_in_background

        start_in_background()


def main() -> None:
    from benchmarks.__main__ import _print_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    prepare(args.quick)
    _print_table(run(args.quick))


if __name__ == "__main__":
    main()
