"""Writing records to one tracker: shared by the live worker and by ``otel-rl replay``.

The writer opens the tracker once, writes a batch all or nothing (or reports how far it got),
classifies every error (:mod:`otel_rl.core.failures`) and sets aside a record the tracker refuses,
so that one bad record never holds back the ones after it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_rl.core.failures import Failure, count_loss
from otel_rl.process.fork_safe_log import log as _log


class PartialWrite(Exception):
    """Raised by a tracker's deliver callable when the first ``done`` records were written
    before ``error``: only the rest is retried (a batch is never written twice in part)."""

    def __init__(self, done: int, error: BaseException) -> None:
        super().__init__(f"{done} written, then {type(error).__name__}: {error}")
        self.done = done
        self.error = error


@dataclass
class TrackerHooks:
    """The calls one tracker exporter offers its writer (all run on one thread)."""

    open: Callable[[], None]
    deliver: Callable[[list[Any]], None]
    flush: Callable[[], None]
    close: Callable[[int], None]
    classify: Callable[[BaseException, str], Failure]
    position: Callable[[], Any] = lambda: None


class TrackerWriter:
    """Writes records to one tracker: opens it once, classifies what goes wrong, and sets aside
    a record the tracker refuses. Used by the live worker and by ``otel-rl replay`` alike."""

    def __init__(
        self,
        name: str,
        hooks: TrackerHooks,
        stats: dict[str, int],
        warn_once: Callable[..., None],
    ) -> None:
        self.name = name
        self._hooks = hooks
        self._stats = stats
        self._warn_once = warn_once
        self.opened = False

    def write(
        self,
        items: list[tuple[int | None, Any]],
        note: Callable[[int, int, int, Any], None] | None = None,
    ) -> tuple[int, Failure | None]:
        """Write ``items`` (``(seq, record)`` pairs); returns how many at the head are done
        (written or set aside) and the failure that stopped the rest, if any.

        ``note(first_seq, last_seq, records, position)`` is called once the tracker is open, just
        before the write, with the tracker's :meth:`position` (when it can tell one).
        """
        if not self.opened:
            try:
                self._hooks.open()
                self.opened = True
            except Exception as exc:
                failure = self._hooks.classify(exc, "open")
                if failure.kind == "record":  # nothing to set aside before the tracker opens
                    failure = Failure("permanent", exc, failure.hint)
                return 0, failure
        replayable = [record for _, record in items if record is not None]
        seqs = [seq for seq, _ in items if seq is not None]
        if note is not None and seqs:
            try:
                where = self._hooks.position()
                if where is not None:
                    note(seqs[0], seqs[-1], len(replayable), where)
            except Exception as exc:  # only replay's duplicate check depends on it
                self._warn_once("position", "%s: cannot note the write position: %s",
                                self.name, exc)  # fmt: skip
        try:
            if replayable:
                self._hooks.deliver(replayable)
            return len(items), None
        except PartialWrite as partial:
            done, error = partial.done, partial.error
        except Exception as exc:
            done, error = 0, exc
        failure = self._hooks.classify(error, "write")
        if failure.kind != "record":
            return done, failure
        if len(items) - done > 1:
            # Find the refused record: write the rest one by one (each all or nothing).
            for index in range(done, len(items)):
                _, sub_failure = self.write([items[index]])
                if sub_failure is not None:
                    return index, sub_failure
            return len(items), None
        self._set_aside(items[done][1], failure)
        return done + 1, None

    def flush(self) -> Failure | None:
        if not self.opened:
            return None
        try:
            self._hooks.flush()
        except Exception as exc:
            self._warn_once(f"flush:{type(exc).__name__}", "%s: flush failed: %s", self.name, exc)
            return self._hooks.classify(exc, "write")
        return None

    def close(self, exit_code: int) -> None:
        if not self.opened:
            return
        try:
            self._hooks.close(exit_code)
        except Exception as exc:
            _log.warning("otel-rl: %s: close failed: %s", self.name, exc)

    def _set_aside(self, record: Any, failure: Failure) -> None:
        self._stats["rejected"] = self._stats.get("rejected", 0) + 1
        count_loss(self._stats, "refused")
        where = f" at step {record.step}" if hasattr(record, "step") else ""
        self._warn_once(
            f"rejected:{type(failure.error).__name__}",
            "%s: record%s refused by the tracker and set aside (%s); it will not be retried, "
            "later records go on; further refusals are counted in stats['rejected']",
            self.name, where, failure.describe(),
        )  # fmt: skip
