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
    demo.set_defaults(run=_demo)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    return int(args.run(args) or 0)


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
