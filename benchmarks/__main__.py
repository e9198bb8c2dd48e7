"""Run every benchmark, print a table, write benchmarks/results.json.

    python -m benchmarks            # the full set (about 20 minutes on 2 cores, 10 of them
                                    # replay_drain's 2,000,000-record backlogs)
    python -m benchmarks --quick    # seconds; what CI runs so the benchmarks never rot
    python -m benchmarks --only scaling,training_thread
    python -m benchmarks --against main   # the training thread's cost here beside a revision

Each benchmark measures otel-rl and a baseline in the same run, alternating, and reports medians
and the ratio. Nothing here asserts a speed: the numbers are for people to read.

The baselines call the trackers' own SDKs, so the full set needs the test extra as well
(torch for TensorBoard's SummaryWriter, the full mlflow package for its server, pytest for the
shared server fixtures): pip install -e ".[all,test]". With less installed, each benchmark whose
packages are missing is skipped, and the skip names the package and this command.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

#: Benchmark modules, each with ``run(quick: bool) -> dict | list`` and optionally
#: ``prepare(quick: bool)``, called for all of them first (e.g. to boot a server in the background).
BENCHMARKS = (
    "training_thread", "timed_step", "slow_tracker", "scaling", "gpu_scrape", "merge",
    "artifact_dump", "spool_drain", "replay_drain", "otlp_down", "job_store_down",
    "rollout_scrape", "tail", "array_summary",
)

#: What installs every package the full set needs (README's second command).
FULL_INSTALL = 'pip install -e ".[all,test]"'

#: Top-level modules of this checkout: a missing one of these is a bug, never a skip.
_OWN_MODULES = frozenset({"otel_rl", "benchmarks", "testkit"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, seconds in total")
    parser.add_argument("--only", default="", help="comma-separated benchmark names")
    parser.add_argument("--out", default=str(Path(__file__).with_name("results.json")))
    parser.add_argument(
        "--against", metavar="REV", default=None,
        help="instead of the set: the hot loop on this git revision and on the working tree, "
             "alternating, in one run (benchmarks/against.py)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.against is not None:
        return _against(args.against, args.quick, Path(args.out))
    names = [n for n in args.only.split(",") if n] or list(BENCHMARKS)
    results: dict[str, Any] = {
        "machine": {"python": platform.python_version(), "cpus": _cpus(),
                    "platform": platform.platform()},
        "quick": args.quick,
    }
    failed = 0
    missing: dict[str, str] = {}  # benchmark -> what it lacks ("needs torch")
    for name in names:
        # A module may start slow set-up (a server) early, to overlap with other benchmarks.
        # A missing package is reported below, when the benchmark itself runs.
        with contextlib.suppress(ImportError):
            prepare = getattr(importlib.import_module(f"benchmarks.{name}"), "prepare", None)
            if prepare is not None:
                prepare(quick=args.quick)
    for name in names:
        started = time.monotonic()
        print(f"## {name}", flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            result = module.run(quick=args.quick)
        except BaseException as exc:
            lacking = missing_package(exc)
            if lacking is None:
                if not isinstance(exc, Exception):
                    raise  # KeyboardInterrupt, SystemExit
                # one broken benchmark must not hide the others' numbers
                failed += 1
                print(f"   failed: {type(exc).__name__}: {exc}")
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            missing[name] = lacking
            print(f"   skipped: {lacking} ({FULL_INSTALL})\n", flush=True)
            results[name] = {"skipped": lacking}
            continue
        results[name] = result
        _print_table(result)
        print(f"   ({time.monotonic() - started:.1f} s)\n", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    print(f"wrote {args.out}")
    if missing:
        skipped = ", ".join(f"{name} ({lacking})" for name, lacking in missing.items())
        print(f"skipped {len(missing)} benchmark(s): {skipped}; {FULL_INSTALL} installs "
              "everything they need")  # fmt: skip
    return 1 if failed else 0


def _against(rev: str, quick: bool, out: Path) -> int:
    from benchmarks.against import compare

    print(f"## against {rev}", flush=True)
    try:
        rows = compare(rev, quick=quick)
    except ValueError as exc:  # an unknown revision: say so, no traceback
        print(f"   {exc}", file=sys.stderr)
        return 2
    _print_table(rows)
    out.write_text(json.dumps({"against": rows}, indent=2, default=str))
    print(f"wrote {out}")
    return 0


def missing_package(exc: BaseException) -> str | None:
    """What is missing when ``exc`` reports an absent package ("needs torch"), else None.

    A ModuleNotFoundError for a module outside this checkout, or pytest's skip raised by the
    shared server fixtures (testkit/servers.py) when the full mlflow package is not installed.
    """
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        return None if top in _OWN_MODULES else f"needs {top}"
    outcomes = sys.modules.get("_pytest.outcomes")
    if outcomes is not None and isinstance(exc, outcomes.Skipped):
        # importorskip's reason, e.g. "the MLflow server needs the full mlflow package"
        return str(getattr(exc, "msg", "") or exc) or "an optional package"
    return None


def _print_table(result: Any, indent: str = "   ") -> None:
    if isinstance(result, dict) and all(not isinstance(v, (dict, list)) for v in result.values()):
        result = [result]
    if isinstance(result, list) and result and all(isinstance(r, dict) for r in result):
        columns = list(dict.fromkeys(k for r in result for k in r))
        widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in result)) for c in columns}
        print(indent + "  ".join(c.ljust(widths[c]) for c in columns))
        for row in result:
            print(indent + "  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))
        return
    if isinstance(result, dict):
        for key, value in result.items():
            print(f"{indent}{key}:")
            _print_table(value, indent + "   ")
        return
    print(indent + str(result))


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


if __name__ == "__main__":
    sys.exit(main())
