"""The tracker contract: what a tracker does, and nothing of how its records reach it.

A :class:`Tracker` holds a tracker's verbs (open, write steps, write artifacts, flush, close, how
its errors classify) and its own config. It owns no thread, queue, spool or counter: the
delivery built around it (:class:`~otel_rl.delivery.channel.Channel`, or the delivery process of
``export.delivery: process``) calls the verbs, all on one thread, and keeps every counter. What
a tracker has to tell its delivery goes through three calls it inherits (``_warn_once``,
``_value_refused``, ``_remember_resume``), which reach the delivery's :class:`TrackerNotes`: a
warning given once, a value refused, the tracker's run named.

A third-party tracker subclasses :class:`Tracker` (docs/backends/README.md shows one); the
built-in ones subclass ``otel_rl.exporters.TrackerExporter``, a tracker that is also an OTel
``MetricExporter`` for code without a Logger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from otel_rl.core.failures import Failure, classify
from otel_rl.core.records import Event, Resume, RowValue, StepBatch, TableRows
from otel_rl.core.redaction import Patterns
from otel_rl.process.fork_safe_log import log as _log


class RunConfig(Protocol):
    """What a tracker's :meth:`Tracker.from_config` reads of the run's resolved config
    (``otel_rl.config.schema.LoggerSettings``, a layer above this one)."""

    @property
    def log_dir(self) -> Any: ...
    @property
    def run_id(self) -> str | None: ...
    @property
    def experiment(self) -> str | None: ...
    @property
    def attempt(self) -> int: ...
    @property
    def trackers(self) -> Mapping[str, Any]: ...
    def tracker_section(self, name: str) -> Any:
        """An otel-rl tracker's ``<name>:`` section (typed keys, or the mapping given)."""


class TrackerNotes(Protocol):
    """What a tracker tells the delivery that holds it (called on the delivery's thread)."""

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        """Log ``message % args`` the first time ``kind`` is given."""

    def value_refused(self, tracker: str, kind: str, key: str, reason: str) -> None:
        """One value of a record was refused for good; the record's other values arrived."""

    def run_named(self) -> None:
        """:attr:`Tracker.resume_config` now names the tracker's run: keep it where a later
        launch or ``otel-rl replay`` finds it (the spool's metadata)."""


class _Unheld:
    """The notes of a tracker no delivery holds yet (its verbs called by hand, as in tests):
    warnings are logged, nothing is counted."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def warn_once(self, kind: str, message: str, *args: Any) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            _log.warning("otel-rl: " + message, *args)

    def value_refused(self, tracker: str, kind: str, key: str, reason: str) -> None:
        self.warn_once(f"refused:{kind}:{key}", "%s: the tracker refused %s %r, skipped: %s",
                       tracker, kind, key, reason)  # fmt: skip

    def run_named(self) -> None:
        pass


class Tracker:
    """Base class of a tracker: override :meth:`write_step`, and what else the tracker
    supports. Every verb runs on the delivery's one thread, never the training thread."""

    # The name in config (``<name>_enabled``), logs and the registry; step batches handed to
    # write_batches at once in a backlog; modules the tracker needs (checked up front); what
    # it does with a step below one it has (docs/backends/README.md); whether a repeated step
    # is lost as well (trackers that keep one value per key and step).
    name: ClassVar[str] = "tracker"
    max_batch: ClassVar[int] = 1
    requires: ClassVar[tuple[str, ...]] = ()
    backwards_policy: ClassVar[str] = "it keeps both points at that step"
    repeat_is_backwards: ClassVar[bool] = False

    #: Config overrides that reopen this tracker's run later (``otel-rl replay``, a relaunch);
    #: set it in ``open()``, e.g. ``{"mlflow": {"run_id": run.info.run_id}}``.
    resume_config: dict[str, Any]
    # Where the tracker's warnings and refusals go: the delivery that holds it sets this (a
    # name of ours, never one a tracker's own options take).
    _notes: TrackerNotes

    def __new__(cls, *args: Any, **kwargs: Any) -> Tracker:
        # Set before any __init__ runs, so that a subclass's own __init__ need not call ours.
        tracker = super().__new__(cls)
        tracker.resume_config = {}
        tracker._notes = _Unheld()
        return tracker

    @classmethod
    def from_config(cls, cfg: RunConfig, **options: Any) -> Tracker:
        """Build from the run's resolved config. This default passes the tracker's
        ``trackers: {<name>: {...}}`` options as keyword arguments (third-party trackers)."""
        return cls(**dict(cfg.trackers.get(cls.name) or {}), **options)

    def open(self) -> None:
        """Connect to the tracker / open files. Called once, lazily, before the first write."""

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        """Write one step's rows. ``batch.axis`` names a custom x-axis when not ``None``."""
        raise NotImplementedError

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        """Write consecutive step batches. Override it with one request where possible: a tracker
        that does gets every step through it, one or many at a time."""
        for batch in batches:
            self.write_step(batch.step, batch.rows, batch)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Record the run's configuration (flattened keys)."""

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        """Store a rendered figure; trackers without images skip it (one warning)."""
        self._notes.warn_once("no-plot", "%s: plots are not supported; %r skipped", self.name, name)

    def write_page(self, name: str, step: int, html: str, png: bytes) -> None:
        """Store a self-contained HTML page (the run's timeline). Trackers that show pages
        override it; this default stores the page's picture as a plot when there is one."""
        if png:
            self.write_plot(name, step, png)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        """Store a table; trackers without tables skip it (one warning)."""
        self._notes.warn_once("no-table", "%s: tables are not supported; %r skipped", self.name,
                             name)  # fmt: skip

    def write_event(self, event: Event) -> None:
        """Show an :class:`~otel_rl.core.records.Event` (a stall, a straggler) as text; trackers
        without text skip it (the run's log and Prometheus/OTLP carry it anyway)."""

    def continue_run(self, resume_config: Mapping[str, Any]) -> None:
        """Open the run ``resume_config`` names (what :attr:`resume_config` held in an earlier
        launch of this run) rather than a new one; called before :meth:`open`. Trackers
        without a run of their own (files) keep the default, which ignores it."""

    def write_resume(self, resume: Resume) -> None:
        """The run was relaunched: from ``resume.step`` on, steps belong to ``resume.attempt``
        and supersede what earlier attempts logged there. Trackers that can hide the superseded
        steps (TensorBoard) or record the attempts (MLflow tags, a JSONL record) do it here."""

    def flush_backend(self) -> None:
        """Push buffered writes out to the tracker (called when the queue runs empty and at
        least every ``export.fsync_interval``): records count as delivered only after it."""

    def write_position(self) -> Any:
        """Where the tracker's output stands (JSON-able, e.g. a file size), noted in the spool
        before each write. Return ``None`` (the default) if the tracker cannot tell."""
        return None

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        """``otel-rl replay``: whether a write of ``records`` records (``None``: not noted) from
        ``position`` reached the tracker whole before a kill (with :meth:`write_position`; a
        kill can cut one write call short, so count what the output holds after it)."""
        return False

    def landed_since(self, position: Any, records: int) -> int | None:
        """``otel-rl replay``: how many of a write's ``records`` records, counted from the first
        written, the tracker holds whole after ``position`` (a kill can cut one write call short,
        leaving its first records whole); ``None`` (the default) when it can tell only all or
        nothing (:meth:`holds_since` then decides)."""
        return None

    def classify_error(self, exc: BaseException, phase: str) -> Failure:
        """Whether ``exc`` (raised in ``"open"`` or ``"write"``) is transient, permanent or
        refuses one record; override to recognise the tracker's own errors."""
        return classify(exc, phase, self.name)  # type: ignore[arg-type]

    def close(self, exit_code: int) -> None:
        """Finish the run in the tracker; ``exit_code != 0`` marks it failed where possible."""

    def redact_own_config(self, patterns: Patterns) -> None:
        """Apply the run's extra redaction patterns to any configuration this tracker sends on
        its own (a tracker SDK's ``init`` config); nothing by default."""

    # ---- for subclasses: what the tracker tells its delivery ---------------------------------

    def _warn_once(self, kind: str, message: str, *args: Any) -> None:
        self._notes.warn_once(kind, message, *args)

    def _value_refused(self, kind: str, key: str, reason: str) -> None:
        """One value of a record that the tracker refused for good while it took the record's
        other values: the delivery counts it (``stats["refused_values"]``; the record itself
        counts as delivered) and names it once per key."""
        self._notes.value_refused(self.name, kind, key, reason)

    def _remember_resume(self) -> None:
        """For trackers that open their run lazily: :attr:`resume_config` is now set."""
        if self.resume_config:
            self._notes.run_named()
