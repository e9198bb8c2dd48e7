"""A simulated GRPO training loop that exercises the whole pipeline in a few seconds."""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.delivery.registry import builtin_trackers
from otel_rl.distributed.worker import WorkerMetrics

DEMO_BACKENDS = ("tensorboard", "jsonl", "console")


def check_backends(backends: Sequence[str]) -> None:
    """Refuse names that are not trackers, listing the valid ones."""
    known = builtin_trackers()
    unknown = [b for b in backends if b not in known]
    if unknown:
        raise ValueError(
            f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(known)}"
        )


def demo_config(
    log_dir: str | Path,
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    stall: float = 0.0,
) -> dict[str, Any]:
    """The demo's embedded defaults: TensorBoard, JSONL and the console, no server needed.
    ``stall``: the watchdog's threshold is 2 s (half the stall if shorter), so that it shows."""
    check_backends(backends)
    cfg: dict[str, Any] = {f"{name}_enabled": name in backends for name in builtin_trackers()}
    cfg.update(
        log_dir=str(log_dir),
        experiment="otel-rl-demo",
        console={"every": 10},
        wandb={"project": "otel-rl-demo", "mode": "offline"},
        mlflow={"experiment_name": "otel-rl-demo"},
        swanlab={"project": "otel-rl-demo", "mode": "offline"},
        trackio={"project": "otel-rl-demo"},
        clearml={
            "project_name": "otel-rl-demo",
            "offline": True,
        },
        # Spans of every timer in <log_dir>/traces.jsonl: `otel-rl timeline` draws them.
        tracing={"enabled": True},
    )
    if prometheus_port is not None:
        cfg["prometheus"] = {"enabled": True, "port": prometheus_port}
    if otlp_endpoint is not None:
        # A shorter push interval than the default 10 s, so a paced demo looks live in Grafana.
        cfg["otlp"] = {"enabled": True, "endpoint": otlp_endpoint, "interval": 5.0}
    if stall > 0:  # a threshold the demo's stall passes, however short it is asked to be
        cfg["stalls"] = {"after": min(2.0, max(0.2, stall / 2)), "factor": 5.0}
    return cfg


def simulated_worker(worker: WorkerMetrics, step: int, rng: random.Random) -> float:
    """One training worker's step, recorded with its reductions; returns its token count.

    The driver merges the workers' snapshots: losses averaged, tokens summed, grad norms and
    the step time (``timing/worker_step``) by max across workers.
    """
    with worker.timer("worker_step"):
        time.sleep(0.002 + 0.0005 * worker.rank)
    tokens = float(rng.randint(3000, 5000))
    worker.record("loss", 2.0 * math.exp(-step / 20) + rng.gauss(0, 0.02) + 0.01 * worker.rank)
    worker.record("grad_norm", 1.0 + rng.random(), reduce="max")
    worker.record("tokens", tokens, reduce="sum")
    return tokens


def simulate_training(
    logger: Any, steps: int, seed: int = 0, step_seconds: float = 0.0, stall: float = 0.0
) -> None:
    """The demo's GRPO-like loop on ``logger``: rewards, loss, KL, lengths, timings, throughput.
    ``stall``: half-way, one generation hangs that many seconds (a rollout that never returns)."""
    rng = random.Random(seed)
    workers = [WorkerMetrics(rank=rank, role="trainer", tracing=True) for rank in range(2)]
    for step in range(steps):
        started = time.perf_counter()
        with logger.timer("generation"):
            time.sleep(0.004)
            if stall > 0 and step == steps // 2:
                wait_for_a_rollout_that_hangs(stall)
            lengths = [rng.randint(64, 512) + 4 * step for _ in range(16)]
        with logger.timer("reward"):
            base = -1.0 + 2.0 * (1 - math.exp(-step / 15))
            rewards = [base + rng.gauss(0, 0.3) for _ in range(16)]
        with logger.timer("train"):
            tokens = sum(simulated_worker(worker, step, rng) for worker in workers)
        # verl's name for tokens per second; Grafana's throughput panel plots it.
        logger.log_metrics(
            {"perf/throughput": tokens / (time.perf_counter() - started)}, step=step
        )
        snapshots = [worker.snapshot(step=step) for worker in workers]  # as Ray results would be
        logger.log_worker_metrics(snapshots, step=step, prefix="train")
        logger.log_metrics(
            {
                "reward": rewards,
                "kl": 0.002 * step + abs(rng.gauss(0, 0.001)),
                "response_length": lengths,
            },
            step=step,
            prefix="train",
            step_finished=True,
        )
        if step_seconds > 0:
            time.sleep(max(0.0, step_seconds - (time.perf_counter() - started)))


def wait_for_a_rollout_that_hangs(seconds: float) -> None:
    """The demo's stall: what a stuck inference engine looks like from the training loop."""
    time.sleep(seconds)


def run_demo(
    steps: int = 50,
    log_dir: str | Path = "logs/demo",
    backends: Sequence[str] = DEMO_BACKENDS,
    prometheus_port: int | None = None,
    otlp_endpoint: str | None = None,
    seed: int = 0,
    step_seconds: float = 0.0,
    hold: float = 0.0,
    on_start: Callable[[Path], object] | None = None,
    stall: float = 0.0,
) -> dict[str, Any]:
    """Run the simulated loop into a new run directory; returns where the results are.

    Each call writes into ``<log_dir>/exp_<NNN>`` with the next free number, as NeMo RL names
    its experiment directories: running the demo again never appends a second run to the
    first one's ``metrics.jsonl`` or TensorBoard files (step 0 twice in one chart).

    ``step_seconds`` paces the loop (a live dashboard needs steps spread over scrapes);
    ``hold`` keeps ``/metrics`` served that many seconds after the last step, so a Prometheus
    that scrapes every 15 s still sees the final values. ``on_start`` is called with the run
    directory once the run's Logger exists, so that a caller stopped by a signal can say where
    the steps logged so far are.

    No backend (``--backends ''``) is refused unless Prometheus or OTLP is given: a demo whose
    values go nowhere would end with nothing to show, which is never what was asked. With
    Prometheus or OTLP it is a run for a dashboard alone, and the summary says so.

    The summary's ``trackers`` are ``(label, text)`` lines: where each SDK tracker (W&B,
    MLflow, SwanLab, Trackio, ClearML) keeps the run and the command that opens or uploads it,
    read from the tracker's own run while it is open (:func:`summary_lines` prints them).

    SIGINT and SIGTERM stop the loop at a safe point (``KeyboardInterrupt``,
    ``SystemExit(143)``); the trackers are closed with 130/143 before the exception leaves.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    check_backends(backends)  # before a run directory is claimed for nothing
    if not backends and prometheus_port is None and otlp_endpoint is None:
        raise ValueError(
            "no backend given (--backends ''), nor --prometheus-port or --otlp-endpoint: the "
            "run would go nowhere; name a tracker (e.g. --backends jsonl) or one of those"
        )
    from otel_rl.compat.nemo_utils import get_next_experiment_dir
    from otel_rl.logger import Logger

    run_dir = Path(get_next_experiment_dir(str(log_dir)))
    cfg = demo_config(run_dir, backends, prometheus_port, otlp_endpoint, stall)
    try:
        logger = Logger(cfg)
    except BaseException:
        # Nothing was written: give the number back rather than leave an empty exp directory.
        with contextlib.suppress(OSError):
            run_dir.rmdir()
        raise
    if on_start is not None:
        on_start(run_dir)
    with logger:
        logger.log_hyperparams(
            {"algorithm": "grpo", "policy": {"lr": 1e-6, "model": "demo-0.5b"}, "steps": steps}
        )
        simulate_training(logger, steps, seed=seed, step_seconds=step_seconds, stall=stall)
        if hold > 0:
            time.sleep(hold)
        # Every tracker has opened its run once what was logged is delivered: where each one
        # keeps it is read from its SDK's run now, while that run is open.
        logger.flush(timeout=30)
        trackers = tracker_outputs([d.tracker for d in logger.exporters if d.tracker is not None])
        summary = {
            "base_dir": str(Path(log_dir)),
            "log_dir": str(run_dir),
            "tensorboard": str(run_dir / "tensorboard"),
            "jsonl": str(run_dir / "metrics.jsonl"),
            "prometheus": logger.prometheus_url,
            "otlp": logger.otlp_endpoint,
            "steps": steps,
            "backends": list(backends),
            "trackers": trackers,
        }
    return summary


def tracker_outputs(exporters: Sequence[Any]) -> list[tuple[str, str]]:
    """``(label, text)`` lines saying where each SDK tracker keeps the run and how to open it;
    a tracker whose run never opened says so (its warning was logged)."""
    lines: list[tuple[str, str]] = []
    for exporter in exporters:
        describe = _DESCRIBE.get(exporter.name)
        if describe is None:
            continue
        if exporter.name != "mlflow" and getattr(exporter, "run", None) is None:
            lines.append((exporter.name, "no run opened (see the warnings above)"))
            continue
        lines.extend(describe(exporter))
    return lines


def _wandb(exporter: Any) -> list[tuple[str, str]]:
    run = exporter.run
    folder = Path(run.dir).parent  # run.dir is the run's files/ folder
    if run.settings.mode == "offline":
        return [("W&B (offline)", str(folder)), ("  upload it:", f"wandb sync {folder}")]
    return [("W&B", str(run.url or folder))]


def _mlflow(exporter: Any) -> list[tuple[str, str]]:
    uri, run_id = exporter.shown_tracking_uri, exporter.run_id
    if run_id is None:
        return [("MLflow", f"no run opened in {uri} (see the warnings above)")]
    lines = [("MLflow", f"run {run_id} in {uri}")]
    if uri.startswith(("http://", "https://")):
        from mlflow import MlflowClient

        try:
            experiment = MlflowClient(exporter.tracking_uri).get_run(run_id).info.experiment_id
        except Exception as exc:  # the server went away since: the run id is still worth saying
            lines.append(("  open it:", f"the server did not answer ({type(exc).__name__})"))
        else:
            page = f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
            lines.append(("  open it:", page))
    else:
        view = f"mlflow ui --backend-store-uri {uri}  (then http://127.0.0.1:5000)"
        lines.append(("  view it:", view))
    return lines


def _swanlab(exporter: Any) -> list[tuple[str, str]]:
    run = exporter.run
    if run.mode in ("offline", "local"):
        return [
            (f"SwanLab ({run.mode})", str(run.dir)),
            ("  upload it:", f"swanlab sync {run.dir}"),
        ]
    return [("SwanLab", str(run.url or run.dir))]


def _trackio(exporter: Any) -> list[tuple[str, str]]:
    from trackio import utils

    store = Path(utils.TRACKIO_DIR) / f"{exporter.project}.db"
    return [
        ("Trackio", f"run {exporter.run.name} in {store}"),
        ("  view it:", f"trackio show --project {exporter.project}"),
    ]


def _clearml(exporter: Any) -> list[tuple[str, str]]:
    task = exporter.task
    if not task.is_offline():
        return [("ClearML", str(task.get_output_log_web_page()))]
    # ClearML zips the session folder when the task closes, at the end of the run.
    session = Path(str(task.get_offline_mode_folder())).with_suffix(".zip")
    load = f"python -c \"from clearml import Task; Task.import_offline_session('{session}')\""
    return [("ClearML (offline)", str(session)), ("  upload it:", load)]


_DESCRIBE: dict[str, Callable[[Any], list[tuple[str, str]]]] = {
    "wandb": _wandb,
    "mlflow": _mlflow,
    "swanlab": _swanlab,
    "trackio": _trackio,
    "clearml": _clearml,
}


def summary_lines(summary: Mapping[str, Any]) -> list[str]:
    """What the demo prints at its end: every output of the run and how to open it."""
    backends = summary["backends"]
    lines = [
        f"\nRan {summary['steps']} simulated GRPO steps. This run is in {summary['log_dir']}/:"
    ]
    if "jsonl" in backends:
        lines.append(f"  metrics (JSONL):  {summary['jsonl']}")
        lines.append(f"  where steps went: otel-rl why {summary['log_dir']}")
    if "tensorboard" in backends:
        lines.append(f"  TensorBoard:      {summary['tensorboard']}")
        lines.append(f"  view every run:   tensorboard --logdir {summary['base_dir']}")
    if "console" in backends:
        lines.append("  console:          the tables printed above (stderr)")
    for label, text in summary["trackers"]:
        # A tracker's name ends with a colon; its indented follow-up lines carry their own.
        lines.append(f"  {label if label.startswith(' ') else label + ':':<17} {text}")
    if summary.get("prometheus"):
        lines.append(f"  Prometheus:       {summary['prometheus']} (served while the demo ran)")
    if summary.get("otlp"):
        lines.append(f"  OTLP:             pushed to {summary['otlp']}")
    if not backends:
        lines.append("  no tracker (--backends ''): the values went to the outputs above only")
    for report in sorted(Path(summary["log_dir"], "stalls").glob("*.txt")):
        lines.append(f"  stall report:     {report}")
    return lines
