"""Which tracker errors are worth retrying, and what to tell the user about the others.

Three kinds:

- **transient**: the tracker may accept the same write later (connection refused or reset, a
  timeout, HTTP 429 or 5xx, a full disk). Retried with jittered exponential backoff.
- **permanent**: the tracker will refuse every write until the user changes something (a typo in
  its settings, no API key, an unusable path, a missing package). The tracker stops at once; its
  records stay in the spool for ``otel-rl replay`` once fixed.
- **record**: this one record can never be written (a value the tracker refuses). It is set aside,
  counted and reported; the records after it go on.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Literal

Kind = Literal["transient", "permanent", "record"]
Phase = Literal["open", "write"]

_TRANSIENT_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENETUNREACH,
    errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ECONNRESET, errno.ETIMEDOUT, errno.EPIPE,
}  # fmt: skip
_PATH_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}
# Third-party exception classes, by name so that no SDK is imported to recognise them.
_TRANSIENT_NAMES = ("ConnectionError", "Timeout", "ConnectTimeout", "ReadTimeout",
                    "ClientConnectorError", "ServerDisconnectedError", "CommError",
                    "ProtocolError", "RemoteDisconnected", "ChunkedEncodingError")
_AUTH_NAMES = ("AuthenticationError", "AuthorizationError", "UnauthorizedError",
               "UsageError", "ForbiddenError", "PermissionDenied",
               "MissingConfigError")  # ClearML without a server or credentials configured
_MLFLOW_TRANSIENT_CODES = ("INTERNAL_ERROR", "TEMPORARILY_UNAVAILABLE", "REQUEST_LIMIT_EXCEEDED")


#: Why a record was lost for good, one name per cause (docs/reliability.md, "Losses"). Each is
#: counted in an exporter's ``stats["dropped.<reason>"]`` (their sum in ``stats["dropped"]``),
#: named in the exit message and ``otel-rl replay``'s summary, and observed as
#: ``otel_rl.exporter.dropped{tracker, reason}``.
LOSS_REASONS = {
    "queue_full": "dropped from a full queue (export.on_full: drop_oldest, or no spool)",
    "refused": "refused by the tracker (set aside, never retried)",
    "tracker_stopped": "held in memory when a permanent error stopped the tracker (no spool)",
    "exit_timeout": "not delivered by the shutdown's deadline (no spool)",
    "spool_vanished": "deleted or cut from the spool from outside before delivery",
    "corrupt": "in spool lines that could not be read back (otel-rl replay)",
    "delivery_process": "not handed to the delivery process, which had exited "
    "(export.delivery: process)",
}


def count_loss(stats: dict[str, int], reason: str, n: int = 1) -> None:
    """Count ``n`` records lost for ``reason`` (one of :data:`LOSS_REASONS`)."""
    if n:
        stats["dropped"] = stats.get("dropped", 0) + n
        key = f"dropped.{reason}"
        stats[key] = stats.get(key, 0) + n


def losses(stats: dict[str, int]) -> dict[str, int]:
    """``{reason: records}`` of what was lost, reasons with none left out."""
    return {r: stats[f"dropped.{r}"] for r in LOSS_REASONS if stats.get(f"dropped.{r}")}


def describe_losses(lost: dict[str, int]) -> str:
    """``"3 dropped from a full queue (...), 1 refused by the tracker (...)"``."""
    return ", ".join(f"{n} {LOSS_REASONS[reason]}" for reason, n in lost.items())


class RowRejected(Exception):
    """Raised by a tracker write to drop a record for good (it can never succeed)."""


@dataclass(frozen=True)
class Failure:
    """An error of one tracker, classified."""

    kind: Kind
    error: BaseException
    hint: str = ""

    def describe(self) -> str:
        text = f"{type(self.error).__name__}: {self.error}"
        return f"{text} — {self.hint}" if self.hint else text


#: The trackers whose SDK an extra of otel-rl installs (pyproject.toml's optional dependencies).
OWN_EXTRAS = frozenset({"clearml", "mlflow", "swanlab", "tensorboard", "trackio", "wandb"})


def install_hint(tracker: str, module: str | None) -> str:
    """How to install what ``tracker`` misses: otel-rl's extra for its own trackers, the
    missing module for anyone else's."""
    if tracker in OWN_EXTRAS:
        return f'install the tracker\'s SDK: pip install "otel-rl[{tracker}]"'
    what = (module or tracker).split(".")[0]
    return f"install the tracker's SDK (the {what!r} module): pip install {what}"


def classify(exc: BaseException, phase: Phase, tracker: str) -> Failure:
    """The kind of ``exc`` raised by ``tracker`` while opening it or writing a record."""
    if isinstance(exc, RowRejected):
        return Failure("record", exc)
    if isinstance(exc, ImportError):
        return Failure("permanent", exc, install_hint(tracker, exc.name))
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & set(_AUTH_NAMES):
        return Failure(
            "permanent", exc, f"give {tracker} its credentials (API key or login) or use its "
            "offline mode; the rows wait in the spool for `otel-rl replay`",
        )
    status = _http_status(exc)
    if status is not None:
        if status == 429 or status >= 500:
            return Failure("transient", exc)
        if status in (401, 403):
            return Failure("permanent", exc, f"check {tracker}'s credentials and permissions")
        if phase == "write":
            return Failure("record", exc)
        return Failure("permanent", exc, f"check the `{tracker}:` settings in the logger config")
    code = getattr(exc, "error_code", None)
    if isinstance(code, str) and code in _MLFLOW_TRANSIENT_CODES:
        return Failure("transient", exc)
    if isinstance(exc, (ConnectionError, TimeoutError)) or names & set(_TRANSIENT_NAMES):
        return Failure("transient", exc)
    if isinstance(exc, OSError):
        if exc.errno in _PATH_ERRNOS or isinstance(
            exc, (PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)
        ):
            path = getattr(exc, "filename", None)
            # The path named is a file the tracker writes (metrics.jsonl) or a folder it writes
            # in: say what it must be.
            want = "a writable file" if isinstance(exc, IsADirectoryError) else "writable"
            return Failure(
                "permanent", exc, f"make {tracker}'s path {want} ({path or 'see the error'})"
            )
        return Failure("transient", exc)  # a full disk, an I/O error: may clear
    if isinstance(exc, (TypeError, ValueError, OverflowError, KeyError, AttributeError)):
        if phase == "write":
            return Failure("record", exc)
        return Failure(
            "permanent", exc, f"check the `{tracker}:` settings in the logger config "
            "(docs/backends/ lists what each tracker accepts)",
        )
    return Failure("transient", exc)


def _http_status(exc: BaseException) -> int | None:
    for candidate in (
        getattr(getattr(exc, "response", None), "status_code", None),
        getattr(exc, "status_code", None),
        getattr(exc, "status", None),
        getattr(exc, "http_status", None),
    ):
        if isinstance(candidate, int) and 100 <= candidate <= 599:
            return candidate
    return None
