"""What a tracker's channel tells the user about its end: records left undelivered, a tracker
stopped by a permanent error, one left behind in its SDK, records lost for good.

Each message is a function of plain values, so that the words are written once: the channel
says them at its shutdown, and the training process says the same for a delivery process killed
before its trackers could (``service_link.py``).
"""

from __future__ import annotations

from pathlib import Path

from otel_rl.core.failures import Failure, describe_losses
from otel_rl.process.deadline import SHUTDOWN_GRACE

__all__ = [
    "CLOSE_GRACE", "SPOOL_GRACE", "left_behind_message", "lost_message", "replay_hint",
    "stopped_message", "undelivered_message",
]  # fmt: skip

#: Seconds past the shutdown deadline for the spool thread to write what it was handed (local
#: disk: a record it has not written is lost for good at exit; one append in flight and one more).
SPOOL_GRACE = 0.5 * SHUTDOWN_GRACE
#: Seconds past the shutdown deadline for the tracker's worker to end its write and close: short
#: enough that a tracker left behind is named here, with what it means, and the process still
#: exits within ``shutdown_timeout`` + the grace. The rest is the interpreter's own exit, measured
#: at 0.1-0.3 s on a 2-core machine and past 0.5 s under load.
CLOSE_GRACE = 0.3 * SHUTDOWN_GRACE


def replay_hint(spool_dir: object, log_dir: object) -> str:
    """The end of a message about records left in a spool: where, and the command."""
    return f" They are in the spool ({spool_dir}); deliver them with: otel-rl replay {log_dir}"


def stopped_message(name: str, failure: Failure, spool_dir: Path | None) -> str:
    """A tracker stopped by a permanent error: the cause, and where its records wait."""
    where = (
        f"; its records stay in the spool ({spool_dir}) for `otel-rl replay` once fixed"
        if spool_dir is not None else ""
    )  # fmt: skip
    return f"{name} stopped: {failure.describe()}{where}"


def left_behind_message(name: str) -> str:
    """A worker still inside the tracker's SDK after the shutdown deadline and its grace, with
    every record delivered (with records left, :func:`undelivered_message` says both at once)."""
    return (
        f"{name}: the tracker's SDK has not returned from a write or its close {CLOSE_GRACE:g} s "
        "after export.shutdown_timeout; it is left behind"
    )


def lost_message(name: str, lost: dict[str, int]) -> str:
    """Records lost for good in this run, by reason (``core/failures.py``)."""
    return (
        f"{name}: {sum(lost.values())} record(s) lost for good in this run: "
        f"{describe_losses(lost)} (docs/reliability.md, Losses)"
    )


def sent_after_shutdown_message(names: str) -> str:
    """Records sent to trackers whose shutdown had begun: said once, the others only counted."""
    return (
        f"{names}: record sent after shutdown dropped (counted lost: "
        "stats['dropped.after_shutdown']); further ones are only counted"
    )


def refused_message(name: str, kind: str, key: str, reason: str) -> str:
    """A value the tracker refused for good (said once per key; the record's others arrived)."""
    return (
        f"{name}: the tracker refused {kind} {key!r}, skipped (the record's other values were "
        f"delivered; further refusals are counted in stats['refused_values']): {reason}"
    )


def undelivered_message(
    name: str,
    *,
    left: int,
    checkpoints: int,
    timeout: float,
    run_timeout: float | None,
    failure: Failure | None,
    last_error: Failure | None,
    spool_dir: Path | None,
    log_dir: object,
    left_behind: bool = False,
    memory_only: str | None = None,
) -> str:
    """Records left at the end: how many, why, how to wait less, and how to deliver them (or,
    without a spool, that they are lost: ``memory_only`` says why the tracker has none, else
    the run turned it off), in one message.

    ``left`` counts the checkpoints of the step still being logged at the end (``checkpoints``
    of them). The deadline is ``run_timeout`` (the run's ``export.shutdown_timeout``) when set,
    else ``timeout``, the one given to the exporter's own ``shutdown()``: OpenTelemetry's unit,
    milliseconds, is the one the message speaks in then. ``left_behind``: the tracker was still
    in a write or its close when its grace ran out (the thread is left behind)."""
    given = run_timeout is None
    if run_timeout is not None:
        timeout = run_timeout
    error = failure or last_error
    sealed = left - checkpoints
    behind = (
        f"it had not returned from a write or its close {CLOSE_GRACE:g} s later and is left "
        "behind"
    )
    if not sealed:
        text = (
            f"{name}: the step still being logged when the run ended was checkpointed "
            f"({checkpoints} checkpoint(s)); no other record is undelivered."
        )
        if left_behind:
            text += f" At the shutdown's deadline {behind}."
    elif failure is not None:
        text = (
            f"{name}: {sealed} record(s) not delivered: the tracker stopped on "
            f"{failure.describe()}."
        )
    elif given:
        text = (
            f"{name}: {sealed} record(s) not delivered within the {timeout * 1000:g} ms "
            "given to shutdown() (timeout_millis, or the SDK's timeout keyword: milliseconds, "
            f"as OpenTelemetry's exporters take them; {CLOSE_GRACE:g} s more let the tracker "
            "end its write and close"
        )
        if left_behind:
            text += f"; {behind}"
        if error is not None:
            text += f"; last error: {error.describe()}"
        text += ")."
    else:
        text = (
            f"{name}: {sealed} record(s) not delivered before the shutdown timeout "
            f"(export.shutdown_timeout: {timeout:g} s"
        )
        if left_behind:
            text += f"; {behind}"
        if error is not None:
            text += f"; last error: {error.describe()}"
        text += (
            ")." if left_behind else  # more time would not have brought it back
            "; raise export.shutdown_timeout to deliver more before exit, lower it to wait "
            "less)." if timeout > 0 else
            ": finish() does not wait, so records in flight are counted here too)."
        )  # fmt: skip
    if sealed and checkpoints:
        text += " The step still being logged when the run ended was checkpointed as well."
    if spool_dir is not None:
        text += replay_hint(spool_dir, log_dir)
    elif memory_only is not None:
        text += f" They are lost: {memory_only}."
    else:
        text += " There is no spool (export.spool: false): they are lost."
    return text
