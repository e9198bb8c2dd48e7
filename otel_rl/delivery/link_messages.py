"""Every word the delivery process and its link say to the user, in one place: the training
process's warnings and errors through the ``otel_rl`` logger, the reason a start failed, the one
line written to stderr when the logger's handlers are too slow to say the child's own lines by
the deadline, and the delivery process's own warnings (said in the training process through its
``otel_rl`` logger, ``otel_rl/delivery/delivery_process.py``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from otel_rl.core.failures import describe_losses
from otel_rl.delivery.messages import replay_hint, sent_after_shutdown_message
from otel_rl.process.fork_safe_log import log as _log


def start_failed(reason: str) -> str:
    """The :class:`ConfigError` of a delivery process that did not start its trackers."""
    return f"the delivery process (export.delivery: process) failed: {reason}"


def not_started_in(timeout: float) -> str:
    return f"it did not start within {timeout:g} s"


def exited_before_starting(code: int | None) -> str:
    return f"it exited with code {code} before starting"


def say_no_handoff_folder(exc: OSError) -> None:
    _log.warning("otel-rl: the delivery process's handoff folder cannot be written "
                 "(%s); what it has not spooled if it is killed is lost", exc)  # fmt: skip


def say_unpicklable(exc: Exception) -> None:
    _log.warning("otel-rl: a record cannot reach the delivery process (%s: %s); "
                 "it is dropped", type(exc).__name__, exc)  # fmt: skip


def say_sent_after_end(names: Sequence[str]) -> None:
    _log.warning("otel-rl: %s", sent_after_shutdown_message(", ".join(names)))


def say_not_kept_up(patience: float) -> None:
    _log.warning(
        "otel-rl: the delivery process has not kept up for %.1f s (it reads nothing, "
        "or less than is logged); until it has caught up, log_metrics no longer "
        "waits for it: up to export.queue_size records wait here, older ones are "
        "dropped and counted (queue_full)", patience,
    )  # fmt: skip


def say_caught_up() -> None:
    _log.warning("otel-rl: the delivery process has caught up again")


def say_no_handoff_file(exc: OSError) -> None:
    _log.warning("otel-rl: the delivery process's handoff file cannot be written (%s); "
                 "log_metrics waits for the delivery process instead", exc)  # fmt: skip


def say_exited_early(
    code: int | None, names: Sequence[str], kept: bool, where: Path | None, unspooled: int
) -> None:
    """The child exited before the run ended; ``kept``: what it had not spooled is in the
    launch's leftover file (in ``where``), else ``unspooled`` records are lost."""
    if kept:
        _log.error(
            "otel-rl: the delivery process exited (code %s) before the run ended; the "
            "records it had not spooled and those for %s from now on wait in %s for "
            "otel-rl replay, with what it had spooled", code, ", ".join(names), where,
        )  # fmt: skip
    else:
        _log.error(
            "otel-rl: the delivery process exited (code %s) before the run ended; %d "
            "record(s) it had not spooled and those for %s from now on are lost "
            "(counted), what it had spooled waits for otel-rl replay", code, unspooled,
            ", ".join(names),
        )  # fmt: skip


def say_killed_at_deadline(names: Sequence[str], kept: bool) -> None:
    _log.warning(
        "otel-rl: the delivery process had not ended (closing %s, or stopped) at the "
        "deadline (export.shutdown_timeout); it was killed: %s",
        ", ".join(names),
        "what it had not delivered waits for otel-rl replay" if kept else
        "what it had spooled waits for otel-rl replay, what it had not spooled yet is "
        "lost (counted)",
    )  # fmt: skip


def say_left_at_deadline(
    name: str, left: int, files: int, log_dir: str, timeout: float,
    spool_dir: Path | None, handoff_dir: Path | None,
) -> None:  # fmt: skip
    """What tracker ``name``'s channel would have said at its close, had it got there: ``left``
    records not delivered, ``files`` of them in handoff files (``timeout``: the run's
    ``export.shutdown_timeout``)."""
    _log.warning(
        "otel-rl: %s: %d record(s) not delivered before the shutdown timeout "
        "(export.shutdown_timeout: %g s; the delivery process was killed there).%s",
        name, left, timeout,
        replay_hint(spool_dir, log_dir) if not files else
        f" {left - files} are in the spool ({spool_dir}), {files} in "
        f"handoff files ({handoff_dir}); deliver them with: otel-rl replay {log_dir}",
    )  # fmt: skip


def say_lost_on_the_way(name: str, lost: dict[str, int]) -> None:
    _log.warning(
        "otel-rl: %s: %d record(s) lost for good on their way to the delivery "
        "process's spool: %s (docs/reliability.md, Losses)",
        name, sum(lost.values()), describe_losses(lost),
    )  # fmt: skip


def say_lines_unsaid(left: int) -> None:
    """Written to stderr: the ``otel_rl`` logger is what was too slow."""
    sys.stderr.write(
        f"otel-rl: {left} log line(s) of the delivery process were not said by the run's "
        "deadline: a handler of the otel_rl logger is slow\n"
    )


# ---- said by the delivery process --------------------------------------------------------------


def say_message_unreadable(exc: Exception) -> None:
    _log.warning("otel-rl: a message from the training process cannot be read in the delivery "
                 "process (%s: %s); skipped", type(exc).__name__, exc)  # fmt: skip


def say_record_unreadable(name: str, exc: Exception) -> None:
    """Once per tracker: the records after it go on."""
    _log.warning(
        "otel-rl: %s: a record from the training process cannot be read in the delivery "
        "process (%s: %s); it is set aside, later records go on",
        name, type(exc).__name__, exc,
    )  # fmt: skip


def say_handoff_unreadable(path: Path, exc: OSError) -> None:
    _log.warning("otel-rl: the delivery process cannot read %s (%s); its records are lost",
                 path, exc)  # fmt: skip


def say_setup_failed(name: str, exc: Exception) -> None:
    _log.warning("otel-rl: %s: setting up the tracker failed: %s", name, exc)
