"""What flows from the training thread to the tracker exporters' threads.

Every record kind is a :class:`Record`: it names the exporter hook it goes to (``deliver_to``)
and how it becomes plain data and back (``encode``/``decode``), so that every record a tracker is
given can also be replayed. That encoding, :func:`record_fields` / :func:`record_from_fields`,
is the only one a record has: a spool line is it in JSON (:func:`record_json`), and a frame to
the delivery process (``export.delivery: process``) is it pickled (``delivery/frames.py``).
Every record is immutable once handed over.

A :class:`StepBatch` carries the logged values of one step (the side channel that keeps NaN and
text) plus the OTel data collected for that step; its ``rows`` are computed once, lazily, by
whichever exporter thread asks first — never on the training thread.
"""

from __future__ import annotations

import base64
import json
import math
import operator
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    Metric,
    MetricsData,
    Sum,
)

#: The name of otel-rl's own meter; its instruments are mapped back to the user's keys.
OWN_SCOPE = "otel_rl"

#: A table's rows, as exporters' ``write_table`` receives them: cells are str, int or float.
TableRows = Sequence[Sequence[Any]]


@dataclass(frozen=True)
class HistogramValue:
    """A histogram for one step: explicit bucket bounds, counts per bucket, and totals."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float
    min: float
    max: float

    #: The scalars every histogram also gets in rows, as ``<key>/<stat>``.
    STATS: ClassVar[tuple[str, ...]] = ("count", "sum", "mean", "min", "max")

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def stats(self, key: str) -> dict[str, float]:
        """``{"<key>/count": …, "<key>/sum": …, …}``: the summary scalars of :data:`STATS`."""
        return {f"{key}/{stat}": float(getattr(self, stat)) for stat in self.STATS}

    def merge(self, other: HistogramValue) -> HistogramValue:
        if other.bounds != self.bounds:
            raise ValueError("cannot merge histograms with different bucket bounds")
        return HistogramValue(
            self.bounds,
            tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)),
            self.count + other.count,
            self.sum + other.sum,
            min(self.min, other.min),
            max(self.max, other.max),
        )


#: A value in a tracker row.
RowValue = Union[float, str, HistogramValue]  # noqa: UP007 (a runtime alias)


class Record:
    """One kind of thing a tracker is given. Subclasses set ``kind`` (its name in the encoding),
    and implement ``deliver_to`` (call the exporter's hook for it), ``encode`` (its fields, as
    JSON holds them) and ``decode`` (the record back from those fields)."""

    kind: ClassVar[str]
    #: Record classes by ``kind``, for reading the encoding back.
    kinds: ClassVar[dict[str, type[Record]]] = {}
    #: ``(launch, frame)``: the frame that brought this record to a delivery process
    #: (``export.delivery: process``), kept on its spool line so that a record handed over
    #: twice (a handoff file and the spool) is spooled once (``otel_rl/delivery/handoff.py``).
    intake: tuple[str, int] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Record.kinds[cls.kind] = cls

    def deliver_to(self, exporter: Any) -> None:
        raise NotImplementedError

    def encode(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Record:
        raise NotImplementedError


@dataclass(frozen=True)
class Hyperparams(Record):
    """Run configuration, flattened to ``{"a/b": value}``."""

    kind: ClassVar[str] = "hyperparams"
    params: Mapping[str, Any]

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_hyperparams(self.params)

    def encode(self) -> dict[str, Any]:
        return {"params": {k: plain(v) for k, v in self.params.items()}}

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Hyperparams:
        return cls(dict(body["params"]))


@dataclass(frozen=True)
class Plot(Record):
    """A rendered figure (PNG bytes) at a step."""

    kind: ClassVar[str] = "plot"
    name: str
    step: int
    png: bytes

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_plot(self.name, self.step, self.png)

    def encode(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "png": base64.b64encode(self.png).decode("ascii"),
        }

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Plot:
        return cls(str(body["name"]), int(body["step"]), base64.b64decode(body["png"]))


@dataclass(frozen=True)
class Page(Record):
    """A self-contained HTML page at a step (the run's timeline), with a PNG of it for trackers
    that show images but not pages (``png`` empty when none could be drawn)."""

    kind: ClassVar[str] = "page"
    name: str
    step: int
    html: str
    png: bytes = b""

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_page(self.name, self.step, self.html, self.png)

    def encode(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "html": self.html,
            "png": base64.b64encode(self.png).decode("ascii"),
        }

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Page:
        return cls(str(body["name"]), int(body["step"]), str(body["html"]),
                   base64.b64decode(body.get("png", "")))  # fmt: skip


@dataclass(frozen=True)
class Table(Record):
    """Rows of a table (e.g. validation samples) at a step; cells are str, int or float."""

    kind: ClassVar[str] = "table"
    name: str
    step: int
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_table(self.name, self.step, self.columns, self.rows)

    def encode(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "step": self.step,
            "columns": list(self.columns),
            "rows": [[plain(c) for c in row] for row in self.rows],
        }

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Table:
        return cls(
            str(body["name"]),
            int(body["step"]),
            tuple(map(str, body["columns"])),
            tuple(map(tuple, body["rows"])),
        )


@dataclass(frozen=True)
class Event(Record):
    """Something the run's watchers must hear about, at a step: a stall, its end, a straggler.

    Trackers show it as text where they have text (TensorBoard's TEXT tab, an MLflow artifact,
    SwanLab text, a W&B alert and an HTML panel, a line of ``events.jsonl``); ``name`` is its tag
    (``otel_rl/stall``), ``level`` ``"warning"`` or ``"info"``.
    """

    kind: ClassVar[str] = "event"
    name: str
    step: int
    title: str
    text: str
    level: str = "warning"

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_event(self)

    def encode(self) -> dict[str, Any]:
        return {"name": self.name, "step": self.step, "title": self.title, "text": self.text,
                "level": self.level}  # fmt: skip

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Event:
        return cls(str(body["name"]), int(body["step"]), str(body["title"]), str(body["text"]),
                   str(body.get("level", "warning")))  # fmt: skip


@dataclass(frozen=True)
class Resume(Record):
    """A relaunched run's next attempt begins at ``step``: from that step on, the steps belong to
    ``attempt`` and supersede what earlier attempts logged there (docs/reliability.md, "A run
    that resumes"). Sent once, before the attempt's first row."""

    kind: ClassVar[str] = "resume"
    attempt: int
    step: int

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_resume(self)

    def encode(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "step": self.step}

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> Resume:
        return cls(int(body["attempt"]), int(body["step"]))


def plain(value: Any) -> Any:
    """``value`` as JSON can hold it: scalars as they are, sequences as lists, mappings as
    objects (a list of dicts, e.g. a scheduler's config, arrives as one), the rest as text."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    return str(value)


_ROWS_LOCK = threading.Lock()


@dataclass(eq=False)
class StepBatch(Record):
    """Everything logged at one step (or one point of another axis, see ``axis``).

    ``axis`` is ``None`` for the training step; otherwise the name of the custom x-axis
    (``ray/ray_step`` for GPU data, seconds since the run started) and ``step`` its value.
    ``step_metrics`` maps a key prefix to the metric W&B should plot it against.

    ``seal`` numbers the training steps a Logger hands over (0, 1, 2, ...). A ``provisional``
    batch is a checkpoint of a step still being logged: it goes to the spool only, so that a
    crash during a long step loses at most ``export.fsync_interval`` of it; the sealed batch with
    the same ``seal`` supersedes it (``otel-rl replay`` delivers a provisional batch only when its
    step was never sealed).
    """

    kind: ClassVar[str] = "step"
    step: int
    values: Mapping[str, RowValue] = field(default_factory=dict)
    otel: Sequence[MetricsData] = ()
    time: float = field(default_factory=time.time)
    axis: str | None = None
    step_metrics: Mapping[str, str] = field(default_factory=dict)
    #: ``(timing/<name>, seconds)`` of each use of a timer in the step: its row is their sum.
    timings: Sequence[tuple[str, float]] = ()
    seal: int | None = None
    provisional: bool = False
    _rows: dict[str, RowValue] | None = field(default=None, init=False, repr=False)
    #: The batch's JSON (:func:`record_json`), encoded once for every tracker's spool.
    encoded: str | None = field(default=None, init=False, repr=False)

    @property
    def rows(self) -> dict[str, RowValue]:
        """``{key: value}`` for this step: OTel data and the timers' totals first, then the
        logged values on top."""
        rows = self._rows
        if rows is None and not self.otel and not self.timings and type(self.values) is dict:
            # The usual step of a loop without timers: its values are its rows. The batch owns
            # them (the step assembler starts a new dict at each seal), so no copy is made.
            rows = self._rows = self.values
        elif rows is None:
            # One lock for every batch, not one made per step on the training thread: rows
            # with OTel data or timings are computed once, by the first tracker to ask.
            with _ROWS_LOCK:
                rows = self._rows
                if rows is None:
                    rows = rows_from_metrics(self.otel) if self.otel else {}
                    totals: dict[str, float] = {}
                    for key, seconds in self.timings:
                        totals[key] = totals.get(key, 0.0) + seconds
                    rows.update(totals)
                    rows.update(self.values)
                    self._rows = rows
        return rows

    def deliver_to(self, exporter: Any) -> None:
        exporter.write_step(self.step, self.rows, self)

    def encode(self) -> dict[str, Any]:
        """The rows are computed here by the first to ask: a spool thread, or with the delivery
        process the training thread, which is why they are given as they are (the batch's own,
        not copied, histograms as :class:`HistogramValue`: :func:`record_json` writes one as
        ``{"__histogram__": [...]}``, a pickle carries it as it is): a scan of 100 values to
        convert them would cost the training thread 2 µs a step, half of what pickling costs."""
        body: dict[str, Any] = {
            "step": self.step,
            "time": self.time,
            "axis": self.axis,
            "step_metrics": dict(self.step_metrics),
            "rows": self.rows,
        }
        if self.seal is not None:
            body["seal"] = self.seal
        if self.provisional:
            body["provisional"] = True
        return body

    @classmethod
    def decode(cls, body: Mapping[str, Any]) -> StepBatch:
        step, rows = body["step"], body["rows"]
        if type(step) is not int or not isinstance(rows, dict):
            raise TypeError(f"step {step!r} / rows of type {type(rows).__name__}")
        if set(map(type, rows.values())) <= _ROW_TYPES:  # the keys: JSON's, or encode's
            values = dict(rows)  # the usual rows: nothing to turn back, only to copy
        else:
            values = {str(k): _decode_value(v) for k, v in rows.items()}
        return cls(
            step=step,
            values=values,
            time=float(body["time"]),
            axis=body["axis"],
            step_metrics=dict(body.get("step_metrics") or {}),
            seal=body.get("seal"),
            provisional=bool(body.get("provisional", False)),
        )


#: The types of row values decoded as they are.
_ROW_TYPES = frozenset({float, str, HistogramValue})


def _json_value(value: Any) -> Any:
    """A value JSON has no form for: a histogram as ``{"__histogram__": [bounds, counts,
    count, sum, min, max]}``, anything else (a value of the caller's own class) as its text."""
    if isinstance(value, HistogramValue):
        return {
            "__histogram__": [
                list(value.bounds),
                list(value.counts),
                value.count,
                value.sum,
                value.min,
                value.max,
            ]
        }
    return str(value)


def _decode_value(value: Any) -> RowValue:
    if isinstance(value, HistogramValue):  # pickled as it is (otel_rl/delivery/frames.py)
        return value
    if isinstance(value, dict) and "__histogram__" in value:
        bounds, counts, count, total, lo, hi = value["__histogram__"]
        return HistogramValue(tuple(bounds), tuple(counts), count, total, lo, hi)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        return value
    raise TypeError(f"row value of type {type(value).__name__}")


#: The ``kind`` of an object that is no :class:`Record` (a third party's own, delivered live):
#: its encoding names its type only, and it decodes to ``None`` (it cannot be replayed).
OPAQUE_KIND = "opaque"

# One line, no spaces. Made once: ``json.dumps`` with these options builds an encoder per call.
_JSON = json.JSONEncoder(separators=(",", ":"), default=_json_value)


def record_fields(record: Any) -> dict[str, Any]:
    """The record as data: ``{"kind": ..., <its fields>}``, and ``"intake": [launch, frame]``
    when a delivery process was handed it (:attr:`Record.intake`). A spool line holds this in
    JSON (:func:`fields_json`), a frame to the delivery process pickled; both are read back by
    :func:`record_from_fields`. The fields are JSON's types but for a step's histograms
    (:class:`HistogramValue`, see :meth:`StepBatch.encode`)."""
    if not isinstance(record, Record):
        return {"kind": OPAQUE_KIND, "type": type(record).__name__}
    fields = {"kind": record.kind, **record.encode()}
    if record.intake is not None:
        fields["intake"] = list(record.intake)
    return fields


def fields_json(fields: Mapping[str, Any]) -> str:
    """A record's fields as one line of JSON (NaN and infinities as JSON's ``NaN`` and
    ``Infinity`` tokens, which ``json`` reads back; histograms as :func:`_json_value` says)."""
    return _JSON.encode(fields)


def record_json(record: Any) -> str:
    """:func:`fields_json` of the record. A step's is encoded once and kept on the batch: every
    tracker's spool writes the same text."""
    text = getattr(record, "encoded", None)
    if text is None:
        text = fields_json(record_fields(record))
        if isinstance(record, StepBatch):
            record.encoded = text
    return text


def record_from_fields(fields: Mapping[str, Any]) -> Record | None:
    """The record :func:`record_fields` gave ``fields`` for; ``None`` for an opaque object.

    Raises ``KeyError``, ``TypeError`` or ``ValueError`` for fields that are not a record's
    (an unknown kind, a missing or mistyped field).
    """
    kind = fields["kind"]
    if kind == OPAQUE_KIND:
        return None
    if kind not in Record.kinds:
        raise TypeError(f"unknown record kind {kind!r}")
    record = Record.kinds[kind].decode(fields)
    intake = fields.get("intake")
    if intake is not None:
        launch, frame = intake
        if type(frame) is not int:
            raise TypeError(f"intake frame {frame!r} is not an integer")
        object.__setattr__(record, "intake", (str(launch), frame))
    return record


def scoped_metrics(datas: Iterable[MetricsData]) -> Iterator[tuple[str, Metric]]:
    """``(scope name, metric)`` of every metric in OTel collections, in collection order."""
    for data in datas:
        for resource_metrics in data.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    yield scope_metrics.scope.name, metric


def last_gauge_value(data: MetricsData, name: str) -> float | None:
    """The last value of the gauge ``name`` in ``data`` (a step gauge), if it has one."""
    for _, metric in scoped_metrics((data,)):
        if metric.name == name and isinstance(metric.data, Gauge) and metric.data.data_points:
            return float(metric.data.data_points[-1].value)
    return None


def rows_from_metrics(datas: Sequence[MetricsData]) -> dict[str, RowValue]:
    """Turn OTel data collected during one step into row values.

    Instruments appear under their OTel name, with attributes as ``name{a=1,b=x}``. Gauges
    give their last value, sums their value (per step for counters, which the step reader reads
    as deltas), histograms a :class:`HistogramValue` under the key plus ``/count, /sum, /mean,
    /min, /max`` scalars. Several collections within one step are merged.
    """
    numbers: dict[str, float] = {}
    histograms: dict[str, HistogramValue] = {}
    for _, metric in scoped_metrics(datas):
        _merge_points(metric.data, metric.name, numbers, histograms)
    rows: dict[str, RowValue] = dict(numbers)
    for key, hist in histograms.items():
        rows[key] = hist
        rows.update(hist.stats(key))
    return rows


def _merge_points(
    data: Any, base: str, numbers: dict[str, float], histograms: dict[str, HistogramValue]
) -> None:
    for point in data.data_points:
        key = _with_attributes(base, point.attributes)
        if isinstance(data, Histogram):
            hist = HistogramValue(
                tuple(point.explicit_bounds),
                tuple(point.bucket_counts),
                point.count,
                point.sum,
                point.min,
                point.max,
            )
            old = histograms.get(key)
            histograms[key] = old.merge(hist) if old is not None else hist
        elif isinstance(data, Sum):
            delta = data.aggregation_temporality == AggregationTemporality.DELTA
            value = float(point.value)
            numbers[key] = numbers.get(key, 0.0) + value if delta else value
        elif isinstance(data, Gauge):
            numbers[key] = float(point.value)
        else:  # exponential histograms are configured for OTLP only; keep their totals
            numbers[f"{key}/count"] = float(point.count)
            numbers[f"{key}/sum"] = float(point.sum)


def _with_attributes(base: str, attributes: Mapping[str, Any] | None) -> str:
    if not attributes:
        return base
    inner = ",".join(f"{k}={attributes[k]}" for k in sorted(attributes))
    return f"{base}{{{inner}}}"


@dataclass(frozen=True)
class CountedHistogram(HistogramValue):
    """A histogram of logged values, with how many of them no bucket could hold: NaN has no
    place on the axis, and an equal-width bin cannot hold ±inf. Rows get them as
    ``<key>/nan_count`` and ``<key>/inf_count`` next to the histogram, when not zero."""

    nan_count: int = 0
    inf_count: int = 0

    def left_out(self, key: str) -> dict[str, float]:
        counts = {f"{key}/nan_count": self.nan_count, f"{key}/inf_count": self.inf_count}
        return {name: float(n) for name, n in counts.items() if n}


def exact_sum(values: Sequence[float]) -> float:
    """The exact sum as a float (±inf beyond the float range): ``fsum`` raises when a partial
    sum overflows, though the total may fit, so it is summed at a smaller scale then."""
    try:
        return math.fsum(values)
    except OverflowError:
        pass
    k = 2.0
    while True:
        try:
            return math.fsum(x / k for x in values) * k
        except OverflowError:
            k *= 2.0


#: The most bins a histogram may have: more is no picture any tracker draws (W&B keeps 512),
#: and ``bins=10**9`` would hold the training thread for seconds and gigabytes.
MAX_BINS = 10_000


def checked_bins(bins: Any) -> int:
    """``bins`` as an int from 1 to :data:`MAX_BINS` (numpy integers too); ``ValueError``
    for anything else."""
    try:
        count = operator.index(bins) if not isinstance(bins, bool) else 0
    except TypeError:
        count = 0
    if not 1 <= count <= MAX_BINS:
        raise ValueError(f"bins must be an integer from 1 to {MAX_BINS}, not {bins!r}")
    return count


def histogram_layout(lo: float, hi: float, bins: int) -> tuple[float, float, tuple[float, ...]]:
    """``(scale, width, bounds)`` of ``bins`` equal-width bins from ``lo`` to ``hi``: the value
    ``x`` falls in bin ``min(int((x * scale - lo * scale) / width), bins - 1)``. One rule for
    both ways of binning (:func:`histogram_of` here, numpy's in ``core/values.py``), so that they
    give the same bins and counts.

    Degenerate ranges: values all equal, or so close that a bin's width rounds to zero (subnormal
    differences: ``[0.0, 5e-324]``), are binned as one value is, every one in the first bin of
    bins 1 wide. A range beyond the largest float (``[-1e308, 1e308]``) is measured in halves.
    """
    bins = checked_bins(bins)
    scale = 0.5 if math.isinf(hi - lo) else 1.0
    width = (hi * scale - lo * scale) / bins if hi > lo else 0.0
    if width == 0.0:
        scale, width = 1.0, 1.0
    # lo * scale + width * i stays within [lo, hi] * scale: no bound overflows to inf.
    bounds = tuple((lo * scale + width * i) / scale for i in range(1, bins))
    return scale, width, bounds


def histogram_of(numbers: Sequence[float], bins: int = 30) -> CountedHistogram:
    """Equal-width histogram of the finite ``numbers``; NaNs and infinities are counted apart."""
    finite = [x for x in numbers if math.isfinite(x)]
    nans = sum(1 for x in numbers if x != x)
    # + 0.0 makes -0.0 0.0: which of the two equal zeros min() returns depends on their order.
    lo, hi = (min(finite) + 0.0, max(finite) + 0.0) if finite else (0.0, 0.0)
    scale, width, bounds = histogram_layout(lo, hi, bins)
    counts = [0] * bins
    for x in finite:
        counts[min(int((x * scale - lo * scale) / width), bins - 1)] += 1
    return CountedHistogram(
        bounds,
        tuple(counts),
        len(finite),
        exact_sum(finite),
        lo,
        hi,
        nan_count=nans,
        inf_count=len(numbers) - len(finite) - nans,
    )
