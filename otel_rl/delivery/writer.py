"""Writing records to one tracker: shared by a channel's worker and by ``otel-rl replay``.

The writer calls the tracker's verbs (:class:`~otel_rl.delivery.tracker.Tracker`) directly. It
opens the tracker once, writes a batch all or nothing (or knows how far it got), notices steps
that go backwards, classifies every error (:mod:`otel_rl.core.failures`) and sets aside a record
the tracker refuses, so that one bad record never holds back the ones after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast
from weakref import WeakSet

from otel_rl.core.failures import Failure, count_loss
from otel_rl.core.records import Record, StepBatch
from otel_rl.delivery.step_order import StepOrder
from otel_rl.delivery.tracker import Tracker
from otel_rl.process.fork_safe_log import log as _log

#: ``note(first_seq, last_seq, records, position)``: where the tracker's output stood before a
#: write (the spool's attempt line, which replay's duplicate check reads).
NoteAttempt = Callable[[int, int, int, Any], None]


class TrackerWriter:
    """Writes records to one tracker, in order, on the caller's thread."""

    def __init__(
        self,
        tracker: Tracker,
        stats: dict[str, int],
        warn_once: Callable[..., None],
    ) -> None:
        self.tracker = tracker
        self.name = tracker.name
        self._stats = stats
        self._warn_once = warn_once
        # A tracker without its own write_batches gets one write_step per batch, and a failure
        # half-way says how far it got, so that a retry never writes a step twice.
        self._one_by_one = type(tracker).write_batches is Tracker.write_batches
        self.order = StepOrder(repeat_is_backwards=tracker.repeat_is_backwards)
        self._noted: WeakSet[StepBatch] = WeakSet()  # order checked (a retry sends them again)
        self.opened = False

    def write(
        self, items: Sequence[tuple[int | None, Any]], note: NoteAttempt | None = None
    ) -> tuple[int, Failure | None]:
        """Write ``items`` (``(seq, record)`` pairs); returns how many at the head are done
        (written or set aside) and the failure that stopped the rest, if any.

        ``note`` is called once the tracker is open, just before the write, with the tracker's
        ``write_position()`` (when it can tell one).
        """
        tracker = self.tracker
        failure = self.open()
        if failure is not None:
            return 0, failure
        records = [record for _, record in items if record is not None]
        if note is not None:
            self._note(items, len(records), note)
        if not records:
            return len(items), None
        first = records[0]
        done = 0
        try:
            if not isinstance(first, StepBatch):
                first.deliver_to(tracker)  # records other than steps come one at a time
                return len(items), None
            batches = cast("list[StepBatch]", records)  # several records are step batches only
            self._note_order(batches)
            if not self._one_by_one:
                tracker.write_batches(batches)
                return len(items), None
            for batch in batches:
                tracker.write_step(batch.step, batch.rows, batch)
                done += 1
            return len(items), None
        except Exception as exc:
            error = exc
        failure = tracker.classify_error(error, "write")
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

    def open(self) -> Failure | None:
        """Open the tracker unless it is open; the failure if it cannot be opened."""
        if self.opened:
            return None
        try:
            self.tracker.open()
        except Exception as exc:
            failure = self.tracker.classify_error(exc, "open")
            if failure.kind == "record":  # nothing to set aside before the tracker opens
                failure = Failure("permanent", exc, failure.hint)
            return failure
        self.opened = True
        return None

    def flush(self) -> Failure | None:
        if not self.opened:
            return None
        try:
            self.tracker.flush_backend()
        except Exception as exc:
            self._warn_once(f"flush:{type(exc).__name__}", "%s: flush failed: %s", self.name, exc)
            return self.tracker.classify_error(exc, "write")
        return None

    def close(self, exit_code: int) -> None:
        if not self.opened:
            return
        try:
            self.tracker.close(exit_code)
        except Exception as exc:
            _log.warning("otel-rl: %s: close failed: %s", self.name, exc)

    def _note(
        self, items: Sequence[tuple[int | None, Any]], records: int, note: NoteAttempt
    ) -> None:
        seqs = [seq for seq, _ in items if seq is not None]
        if not seqs:
            return
        try:
            where = self.tracker.write_position()
            if where is not None:
                note(seqs[0], seqs[-1], records, where)
        except Exception as exc:  # only replay's duplicate check depends on it
            self._warn_once("position", "%s: cannot note the write position: %s", self.name, exc)

    def _note_order(self, batches: list[StepBatch]) -> None:
        for batch in batches:
            # Once per batch: a retried write delivers the same batches again.
            if batch.axis is not None or batch in self._noted:
                continue
            self._noted.add(batch)
            previous = self.order.check(batch.step)
            if previous is None:
                continue
            self._stats["backwards_steps"] = self.order.backwards
            self._warn_once(
                "backwards",
                "%s: step went backwards (%d after %d); %s; further occurrences are only counted",
                self.name, batch.step, previous, self.tracker.backwards_policy,
            )  # fmt: skip

    def _set_aside(self, record: Record, failure: Failure) -> None:
        self._stats["rejected"] = self._stats.get("rejected", 0) + 1
        count_loss(self._stats, "refused")
        where = f" at step {record.step}" if hasattr(record, "step") else ""
        self._warn_once(
            f"rejected:{type(failure.error).__name__}",
            "%s: record%s refused by the tracker and set aside (%s); it will not be retried, "
            "later records go on; further refusals are counted in stats['rejected']",
            self.name, where, failure.describe(),
        )  # fmt: skip
