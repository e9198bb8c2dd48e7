"""Which tracker errors are worth retrying, and what to tell the user about the others.

Three kinds:

- **transient**: the tracker may accept the same write later (connection refused or reset, a
  timeout, HTTP 429 or 5xx, a full disk). Retried with jittered exponential backoff, or later
  when the server said when (``Retry-After``: :func:`retry_after_of`, :func:`retry_wait`).
- **permanent**: the tracker will refuse every write until the user changes something (a typo in
  its settings, no API key, an unusable path, a missing package). The tracker stops at once; its
  records stay in the spool for ``otel-rl replay`` once fixed.
- **record**: this one record can never be written (a value the tracker refuses). It is set aside,
  counted and reported; the records after it go on.
"""

from __future__ import annotations

import dataclasses
import email.utils
import errno
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timezone
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
    "exit_timeout": "not delivered by the shutdown's deadline, and in no spool (none, or it "
    "could not hold them: a full disk)",
    "spool_vanished": "deleted or cut from the spool from outside before delivery",
    "corrupt": "in spool lines that could not be read back (otel-rl replay)",
    "delivery_process": "not handed to the delivery process, which had exited "
    "(export.delivery: process)",
    "after_shutdown": "sent to the tracker after its shutdown (the run had ended)",
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
    #: Seconds the tracker's server asked to be left alone before the next attempt
    #: (``Retry-After``), for a transient failure that said so; :func:`retry_wait` honours it.
    retry_after: float | None = None

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
    """The kind of ``exc`` raised by ``tracker`` while opening it or writing a record; a
    transient one keeps the ``Retry-After`` it carries (:func:`retry_after_of`)."""
    failure = _kind_of(exc, phase, tracker)
    if failure.kind == "transient":
        wait = retry_after_of(exc)
        if wait is not None:
            return dataclasses.replace(failure, retry_after=wait)
    return failure


#: The longest ``Retry-After`` honoured, unless ``export.retry_max_backoff`` is longer: rate
#: limits ask for seconds to a minute, and a longer one (a proxy's misconfiguration, a date
#: from a clock far off ours) must not hold a tracker back for the rest of the run.
RETRY_AFTER_CAP = 60.0


def retry_wait(backoff: float, failure: Failure, max_backoff: float) -> float:
    """Seconds to wait after ``failure`` before the next attempt: the exponential ``backoff``
    jittered down to half at random (the ranks of a job hitting one recovering server spread
    out), or the server's ``Retry-After`` when longer, up to :data:`RETRY_AFTER_CAP` (or
    ``max_backoff``, ``export.retry_max_backoff``, when that is longer)."""
    wait = backoff * random.uniform(0.5, 1.0)
    if failure.retry_after is not None:
        wait = max(wait, min(failure.retry_after, max(RETRY_AFTER_CAP, max_backoff)))
    return wait


def retry_after_of(exc: BaseException) -> float | None:
    """How long the server asked to wait before the next request, in seconds; None when it did
    not say (or said nothing readable).

    Read from the error's own ``retry_after`` (seconds, or a header's text: a tracker may raise
    an error that carries it), else from a ``Retry-After`` header, in seconds or as an HTTP
    date, of the error's ``headers`` (urllib's ``HTTPError``, aiohttp) or its ``response.headers``
    (requests, httpx). A date already past means at once. MLflow's client honours
    ``Retry-After`` in its own retries and raises without the headers."""
    own = getattr(exc, "retry_after", None)
    if isinstance(own, (int, float, str)) and not isinstance(own, bool):
        return _delay(str(own))  # as a header's text: an int past the float range is no error
    for headers in (getattr(exc, "headers", None),
                    getattr(getattr(exc, "response", None), "headers", None)):  # fmt: skip
        value = _header(headers, "retry-after")
        if value is not None:
            return _delay(value)
    return None


def _header(headers: object, name: str) -> str | None:
    """``name`` (lower case) of a header collection, whatever its case there."""
    if headers is None:
        return None
    try:  # collections of any client: a lookup that raises reads as no header
        value = headers.get(name) if hasattr(headers, "get") else None
        if value is None and isinstance(headers, Mapping):
            value = next((v for k, v in headers.items() if str(k).lower() == name), None)
    except Exception:
        return None
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value if isinstance(value, str) else None


def _delay(value: str) -> float | None:
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # "-0000": UTC, said without a zone
            when = when.replace(tzinfo=timezone.utc)
        return max(0.0, when.timestamp() - time.time())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _kind_of(exc: BaseException, phase: Phase, tracker: str) -> Failure:
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
