"""The otel-rl command line: the demo, spool replay, the standalone GPU monitor, ``why`` and
``timeline``."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

DESCRIPTION = (
    "otel-rl: one OpenTelemetry pipeline from an RL training loop to every experiment tracker."
)


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a step count)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port from 0 (any free) to 65535, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: seconds, zero or more."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value >= 0 or value == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def package_version() -> str:
    """The installed distribution's version (package metadata), as ``otel_rl.__version__``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("otel-rl")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otel-rl", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="run a simulated GRPO loop through the pipeline",
        description="Run a simulated GRPO loop through the pipeline. Each run writes into a new "
        "directory LOG_DIR/exp_NNN (the next free number), so runs never mix.",
    )
    demo.add_argument(
        "--steps", type=positive_int, default=50, help="training steps, at least 1 (default 50)"
    )
    demo.add_argument(
        "--log-dir",
        default="logs/demo",
        help="each run goes into a new LOG_DIR/exp_NNN directory (default logs/demo)",
    )
    demo.add_argument(
        "--backends",
        default="tensorboard,jsonl,console",
        help="comma-separated trackers (default tensorboard,jsonl,console)",
    )
    demo.add_argument(
        "--prometheus-port", type=port_number, default=None,
        help="serve /metrics on this port (0: any free port)",
    )  # fmt: skip
    demo.add_argument("--otlp-endpoint", default=None, help="push OTLP/HTTP to this collector")
    demo.add_argument(
        "--step-seconds",
        type=non_negative_float,
        default=0.0,
        help="pace the loop to this many seconds per step (e.g. 1 for a live dashboard)",
    )
    demo.add_argument(
        "--hold",
        type=non_negative_float,
        default=0.0,
        help="keep /metrics served this many seconds after the last step (default 0)",
    )
    demo.add_argument(
        "--stall",
        type=non_negative_float,
        nargs="?",
        const=4.0,
        default=0.0,
        metavar="SECONDS",
        help="make a stall on purpose: half-way, one generation hangs SECONDS (default 4) and "
        "the watchdog, set to 2 s, writes its report to LOG_DIR/exp_NNN/stalls/",
    )
    demo.set_defaults(run=_demo)

    replay = commands.add_parser(
        "replay",
        help="deliver spooled records that trackers did not get (after a crash/outage)",
        description="Deliver what a crash or a tracker outage left in a run's spool, exactly "
        "once, in step order.",
    )
    replay.add_argument("log_dir", help="the run's log_dir")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")
    replay.add_argument(
        "--timeout", type=non_negative_float, default=300.0,
        help="seconds to wait per tracker (default 300)",
    )  # fmt: skip
    replay.add_argument(
        "--wait", type=non_negative_float, default=0.0,
        help="seconds to wait for a spool in use by the live run or another replay (default 0: "
        "say who holds it and go on; exit 75 if that was all that was left)",
    )  # fmt: skip
    replay.add_argument(
        "--run", dest="run_id", default=None, metavar="RUN_ID",
        help="only the spools of this run_id (all its launches, oldest first)",
    )  # fmt: skip
    replay.add_argument(
        "--before-attempt", type=positive_int, default=None, metavar="N",
        help="with --run: only the launches before attempt N (what a relaunch delivers first)",
    )  # fmt: skip
    replay.set_defaults(run=_replay)

    from otel_rl.cli import gpu_monitor

    monitor = commands.add_parser(
        "gpu-monitor",
        help="scrape Ray nodes' GPU metrics standalone and print a live table",
        description=gpu_monitor.DESCRIPTION,
    )
    gpu_monitor.add_arguments(monitor)
    monitor.set_defaults(run=gpu_monitor.run)

    why = commands.add_parser(
        "why",
        help="why a run's slow steps were slow: its anatomy, critical path, stalls, stragglers",
        description="Read what a run wrote (LOG_DIR/metrics.jsonl, events.jsonl, stalls/) and "
        "say which steps were slowest against the median, where one step's time went (each "
        "phase against its own median, the critical path, the workers), and the stalls and "
        "stragglers found. No server or tracker needed.",
    )
    why.add_argument("log_dir", help="the run's log_dir (or its metrics .jsonl file)")
    why.add_argument(
        "--step", type=_int, default=None,
        help="the step to take apart (default: the slowest)",
    )  # fmt: skip
    why.add_argument("--top", type=positive_int, default=5, help="slowest steps listed (default 5)")
    why.add_argument("--json", action="store_true", help="print the answer as JSON")
    why.set_defaults(run=_why)

    from otel_rl.cli.timeline import FORMATS

    timeline = commands.add_parser(
        "timeline",
        help="a picture of a run: one HTML page that opens offline, or a Perfetto trace",
        description="Draw a run from its files (LOG_DIR/traces.jsonl, metrics.jsonl, stalls/): "
        "a lane per process and thread with its spans, step boundaries, stalls and their "
        "verdicts, GPU utilisation, each step's anatomy. No server needed.",
    )
    timeline.add_argument("log_dir", help="the run's log_dir")
    timeline.add_argument(
        "--steps", default=None, metavar="A-B",
        help="the steps to draw (default: the slowest step and two on each side)",
    )  # fmt: skip
    timeline.add_argument(
        "-o", "--out", default=None,
        help="the file to write (default LOG_DIR/timeline.html or timeline.perfetto.json)",
    )  # fmt: skip
    timeline.add_argument(
        "--format", choices=FORMATS, default="html",
        help="html (default), or perfetto: Chrome trace-event JSON for ui.perfetto.dev",
    )  # fmt: skip
    timeline.set_defaults(run=_timeline)
    return parser


#: The exit code of a command whose stdout was closed before it had printed everything
#: (``otel-rl why DIR --json | head -2``): 128 + SIGPIPE, what the shell reports for a tool
#: that signal ended (``cat``), so ``set -o pipefail`` scripts see the same. No traceback.
STDOUT_CLOSED = 141


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            args = build_parser().parse_args(argv)
            logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
            return int(args.run(args) or 0)
        finally:
            # Flushed here, not by the interpreter at exit, where a closed pipe is a message
            # on stderr and exit code 120.
            if sys.stdout is not None:
                sys.stdout.flush()
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe: a real error
        # The Python docs' advice (signal module, "Note on SIGPIPE"): stdout to devnull, so the
        # interpreter's own flush at exit has nowhere to fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return STDOUT_CLOSED


def _stdout_closed() -> bool:
    """Whether stdout is a pipe (or socket) whose reader has gone."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a file
        return False
    import select

    if not hasattr(select, "poll"):  # Windows: a broken pipe on the way out is stdout's
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _why(args: argparse.Namespace) -> int:
    from otel_rl.cli.why import run

    return run(args.log_dir, step=args.step, top=args.top, as_json=args.json)


def _timeline(args: argparse.Namespace) -> int:
    from otel_rl.cli.timeline import run

    return run(args.log_dir, steps=args.steps, out=args.out, fmt=args.format)


def _replay(args: argparse.Namespace) -> int:
    from otel_rl.cli.replay import run

    if args.before_attempt is not None and args.run_id is None:
        print("otel-rl replay: --before-attempt needs --run RUN_ID (the run whose launches it "
              "counts)", file=sys.stderr)  # fmt: skip
        return 2

    return run(args.log_dir, progress=not args.no_progress, timeout=args.timeout, wait=args.wait,
               run_id=args.run_id, before_attempt=args.before_attempt)  # fmt: skip


def _demo(args: argparse.Namespace) -> int:
    from otel_rl.process.lifecycle import signal_of

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    started: list[Path] = []
    try:
        from otel_rl.cli.demo import run_demo  # inside: Ctrl-C while it imports is one line too

        summary = run_demo(
            steps=args.steps,
            log_dir=args.log_dir,
            backends=backends,
            prometheus_port=args.prometheus_port,
            otlp_endpoint=args.otlp_endpoint,
            step_seconds=args.step_seconds,
            hold=args.hold,
            on_start=started.append,
            stall=args.stall,
        )
    except ValueError as exc:
        print(f"otel-rl demo: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a --log-dir that cannot be written: one line, not a traceback
        print(f"otel-rl demo: --log-dir {args.log_dir}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _demo_stopped(signal.SIGINT, started)
    except SystemExit as exc:
        signum = signal_of(exc)
        if signum is None:
            raise
        return _demo_stopped(signum, started)
    from otel_rl.cli.demo import summary_lines

    print("\n".join(summary_lines(summary)))
    return 0


def _demo_stopped(signum: int, started: list[Path]) -> int:
    """Ctrl-C or SIGTERM: the demo's trackers are closed by now (the Logger's ``with`` block
    ends the run with the signal's code); one line instead of a traceback into our loop."""
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    where = f"the steps logged so far are in {started[0]}" if started else "before the run began"
    print(f"otel-rl demo: stopped by {name}; {where}", file=sys.stderr)
    return 128 + signum


if __name__ == "__main__":
    sys.exit(main())
