"""The verdict of a stall: one sentence naming what the training process waits for, and what
that waits for in turn, down to what is stuck.

Built on the stall watchdog's thread when a report is made, from what the run has at that
moment: the live Python frames of this process (the wait is recognised by the module of its kind,
:mod:`otel_rl.watch.waits`, which also follows it: Ray's state API for the task behind an
object ref, the thread holding a lock, the rollout monitor's engines on an HTTP host, the GPU
bridge's last readings), the actors' ``py-spy`` stacks and the workers' open-timer reports
already in the :class:`~otel_rl.watch.stalls.StallReport`. Each link of the chain says where its
facts came from and how old they are; a link that cannot be known is left out, and the reason
goes to ``missing``: nothing is guessed.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from otel_rl.watch.chain import Link, Verdict
from otel_rl.watch.stalls import chain_lines, p95, seconds
from otel_rl.watch.waits import Following, recognise, training_thread

__all__ = ["Link", "Verdict", "build_verdict", "chain_lines", "training_thread"]


def process_name() -> str:
    """How this process is named in the chain: its rank under ``torch.distributed``, the
    driver of a Ray job, else the training process."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}"
    except Exception:
        pass
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return "the driver"
    except Exception:
        pass
    return "the training process"


def build_verdict(
    report: Any,
    *,
    timeout: float = 5.0,
    engines: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
    skip: int | None = None,
    job: Any = None,
) -> Verdict:
    """The verdict of ``report`` (a :class:`~otel_rl.watch.stalls.StallReport` with its other
    parts gathered), spending at most about ``timeout`` seconds on Ray's state API. ``engines``
    returns the rollout monitor's ``engine_states()``; ``skip`` is the calling thread; ``job`` is
    the job's verdict (:func:`otel_rl.watch.job_verdict.job_verdict`), when the process is one of
    a job's."""
    from otel_rl.telemetry.timing import open_phases, phase_history

    deadline = time.monotonic() + timeout
    verdict = Verdict(job=job)
    if job is not None:
        verdict.missing += job.unknown
    phases = {i: s for i, s in open_phases().items() if i != skip}
    ident = training_thread(phases)
    now = time.monotonic()
    process = process_name()
    frame = sys._current_frames().get(ident) if ident is not None else None
    try:
        stack = phases.get(ident or -1) or []
        if stack:
            path, began = stack[-1]
            age = now - began
            history = phase_history(path)
            told = (f"p95 {seconds(p95(history))} of {len(history)}" if history
                    else "never completed before")  # fmt: skip
            where = f"in {' > '.join(path.split('/'))} ({seconds(age)}; {told})"
            evidence = f"open timer {path!r} since {seconds(age)} ago"
        else:
            path, age = None, report.since_step
            where = f"outside any timer ({seconds(age)} since the last log_metrics call)"
            evidence = "no timer open on the training thread"
        wait = recognise(frame)
        if wait is None:
            verdict.chain.append(Link(process, path, None, age, evidence + "; no Python stack",
                                      text=f"{process} waits {where}"))  # fmt: skip
            verdict.missing.append("what the training thread runs: its stack is gone")
            return verdict
        head = Link(process, path, wait.words, age, f"{evidence}; {wait.evidence}")
        verdict.chain.append(head)
        if wait.unknown is not None:
            verdict.missing.append(wait.unknown)
        wait.follow(Following(report, verdict, head, deadline,
                              engines or (lambda: []), ident, phases, now, recognise))  # fmt: skip
        verb = "waits" if wait.kind != "code" else "is"
        head.text = f"{process} {verb} {where} " + ("on " if verb == "waits" else "at ")
        head.text += head.waits_on or wait.words
        return verdict
    finally:
        del frame  # a frame holds every local of the stack it belongs to
