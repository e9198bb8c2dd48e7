"""The ``otel-rl`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="otel-rl", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run a simulated GRPO loop through the pipeline")
    demo.add_argument("--steps", type=int, default=50, help="training steps (default 50)")
    demo.add_argument("--log-dir", default="logs/demo", help="where outputs go (default logs/demo)")
    demo.add_argument(
        "--backends",
        default="tensorboard,jsonl,console",
        help="comma-separated trackers (default tensorboard,jsonl,console)",
    )
    demo.add_argument("--prometheus-port", type=int, default=None, help="serve /metrics here")
    demo.add_argument("--otlp-endpoint", default=None, help="push OTLP/HTTP to this collector")
    demo.add_argument(
        "--step-seconds",
        type=float,
        default=0.0,
        help="pace the loop to this many seconds per step (e.g. 1 for a live dashboard)",
    )
    demo.add_argument(
        "--hold",
        type=float,
        default=0.0,
        help="keep /metrics served this many seconds after the last step (default 0)",
    )
    demo.set_defaults(run=_demo)

    replay = commands.add_parser(
        "replay", help="deliver spooled records that trackers did not get (after a crash/outage)"
    )
    replay.add_argument("log_dir", help="the run's log_dir")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait per tracker (default 300)"
    )
    replay.set_defaults(run=_replay)

    from otel_rl.ray import monitor_cli

    gpu_monitor = commands.add_parser(
        "gpu-monitor", help="scrape Ray nodes' GPU metrics standalone and print a live table"
    )
    monitor_cli.add_arguments(gpu_monitor)
    gpu_monitor.set_defaults(run=monitor_cli.run)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    return int(args.run(args) or 0)


def _replay(args: argparse.Namespace) -> int:
    from otel_rl.replay import run

    return run(args.log_dir, progress=not args.no_progress, timeout=args.timeout)


def _demo(args: argparse.Namespace) -> int:
    from otel_rl.demo import run_demo

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    try:
        summary = run_demo(
            steps=args.steps,
            log_dir=args.log_dir,
            backends=backends,
            prometheus_port=args.prometheus_port,
            otlp_endpoint=args.otlp_endpoint,
            step_seconds=args.step_seconds,
            hold=args.hold,
        )
    except ValueError as exc:
        print(f"otel-rl demo: {exc}", file=sys.stderr)
        return 2
    print(f"\nRan {summary['steps']} simulated GRPO steps. Results are in {summary['log_dir']}/:")
    if "jsonl" in backends:
        print(f"  metrics (JSONL):  {summary['jsonl']}")
    if "tensorboard" in backends:
        print(f"  TensorBoard:      {summary['tensorboard']}")
        print(f"  view them with:   tensorboard --logdir {summary['tensorboard']}")
    if summary.get("prometheus"):
        print(f"  Prometheus:       {summary['prometheus']} (served while the demo ran)")
    if summary.get("otlp"):
        print(f"  OTLP:             pushed to {summary['otlp']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
