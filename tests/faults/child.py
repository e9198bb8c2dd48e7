"""The training process of the fault-injection suite: ``python -m tests.faults.child PLAN_JSON``.

It logs the steps of :mod:`tests.faults.plan` through a real ``Logger`` and, right after the
last ``log_metrics`` call of each step returns, writes ``"<step> <time.monotonic()>"`` to stdout
(line-buffered; CLOCK_MONOTONIC is system-wide on Linux, so the parent compares it with its own
kill time). Other lines: ``R <t>`` once the Logger is built, ``F <t>`` as ``finish()`` starts,
``D <t>`` when it returned, ``P <pid>`` the delivery process it stops for a while.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time

from otel_rl import Logger
from tests.faults.plan import ChildPlan, calls_of


def main(argv: list[str]) -> int:
    plan = ChildPlan.from_json(argv[1])
    sys.stdout.reconfigure(line_buffering=True)
    rng = random.Random(f"{plan.seed}:child")
    logger = Logger(plan.logger_config())
    print(f"R {time.monotonic()}")
    if plan.pause_delivery is not None:
        pid = logger.exporters[0].link.process.pid
        print(f"P {pid}")  # the parent lets it go on after a kill of this process
        start, seconds = plan.pause_delivery
        for delay, sig in ((start, signal.SIGSTOP), (start + seconds, signal.SIGCONT)):
            timer = threading.Timer(delay, os.kill, (pid, sig))
            timer.daemon = True
            timer.start()
    started = time.monotonic()
    step = 0
    while time.monotonic() - started < plan.max_seconds:
        if plan.loop == "finish" and step >= plan.steps:
            break
        for call in calls_of(step):
            logger.log_metrics(call, step=step)
        print(f"{step} {time.monotonic()}")
        if plan.loop == "paced":
            if plan.long_steps and rng.random() < 0.03:
                # A long step: the previous step's row is the pending one all this time.
                time.sleep(rng.uniform(0.3, 1.2))
            else:
                time.sleep(rng.uniform(0.0, 0.01))
        elif plan.loop == "finish":
            time.sleep(rng.uniform(0.0, 0.002))
        # "tight" and "overload": no pause at all
        step += 1
    print(f"F {time.monotonic()}")
    logger.finish()
    print(f"D {time.monotonic()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
