"""Trackio exporter.

The ``trackio`` config section is passed to ``trackio.init`` as it is (``project``, ``name``,
``group``, ``space_id``, ``resume``, ...); ``project`` defaults to ``experiment`` or ``otel-rl``.
Everything goes through the returned ``Run`` object: Trackio's module-level ``trackio.log`` keeps
the current run in a context variable and fails on any thread but the one that called ``init``.
Local data lives in Trackio's SQLite store, ``$TRACKIO_DIR/<project>.db`` (Trackio reads
``TRACKIO_DIR`` when it is imported; default ``~/.cache/huggingface/trackio``).

A relaunched run (same ``run_id`` and ``log_dir``, ``otel_rl/run/history.py``) continues the
Trackio run of the launch before it (``name``, ``resume: allow``); the attempts are recorded in
its config (:meth:`TrackioExporter.write_resume`).

Trackio keeps every row, also a repeated or earlier step. Rows on another x-axis (GPU data on
``ray/ray_step``) are logged at their axis value as Trackio's step, with the axis key in the row.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from otel_rl.core.records import HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import SdkInit, TrackerConfig
from otel_rl.exporters.conversions import histogram_edges, png_to_image
from otel_rl.exporters.sdk_run import RESUME_STEPS_KEY, SdkRunExporter, attempts_config


class TrackioExporter(SdkRunExporter):
    name: ClassVar[str] = "trackio"
    backwards_policy: ClassVar[str] = "Trackio keeps both rows at that step"
    requires: ClassVar[tuple[str, ...]] = ("trackio",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="Trackio",
        order=70,
        mapping="given to `trackio.init`; checked against its parameters",
        sdk_init=SdkInit(
            package="trackio",
            init_files=("__init__.py",),
            declared=frozenset({
                "project", "name", "group", "space_id", "server_url", "dataset_id", "bucket_id",
                "config", "resume", "settings", "private", "embed", "auto_log_gpu",
                "gpu_log_interval", "auto_log_cpu", "cpu_log_interval", "webhook_url",
                "webhook_min_level",
            }),
        ),
    )  # fmt: skip

    def __init__(self, init_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        self._trackio: Any = None
        self._config_pending = False
        self._highest_step = 0
        super().__init__({"project": "otel-rl", "embed": False, **(init_kwargs or {})}, **kwargs)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> TrackioExporter:
        init_kwargs = dict(cfg.tracker_section("trackio"))
        init_kwargs.setdefault("project", cfg.experiment or "otel-rl")
        return cls(init_kwargs, **kwargs)

    @property
    def project(self) -> str:
        return str(self.init_kwargs["project"])

    # ---- tracker hooks (worker thread) -------------------------------------------------------

    def open(self) -> None:
        import trackio

        self._trackio = trackio
        # The run itself starts with the first record, so hyperparameters logged before any
        # metric go into trackio.init(config=...), where Trackio stores them.

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        run = self._ensure_run()
        data: dict[str, Any] = {}
        for key, value in rows.items():
            if isinstance(value, HistogramValue):
                layout = histogram_edges(value)
                if layout is not None:
                    data[key] = self._trackio.Histogram(np_histogram=layout)
            else:
                data[key] = value
        if batch.axis is not None:
            data.setdefault(batch.axis, step)
        self._log(run, data, step)

    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        if self.run is None:
            self._ensure_run(config=params)
            return
        # Trackio stores a run's config with the first row logged after init. For later
        # hyperparameters its (private) "config written" flag is reset so the next row stores the
        # merged config again; the rows already queued are written first, because Trackio's
        # local writer keeps only the first config of each batch of rows.
        run = self.run
        run.config.update(dict(params))
        flush = getattr(run, "_flush_queues_inline", None)
        lock = getattr(run, "_client_lock", None)
        if not (flush and lock is not None and hasattr(run, "_config_logged")):
            self._warn_once(
                "late-config",
                "trackio: hyperparameters logged after the first metrics cannot be stored by "
                "this Trackio version; log them before the first metrics",
            )
            return
        with lock:
            flush()
        run._config_logged = False
        self._config_pending = True

    def write_plot(self, name: str, step: int, png: bytes) -> None:
        run = self._ensure_run()
        self._log(run, {name: self._trackio.Image(png_to_image(png))}, step)

    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        run = self._ensure_run()
        table = self._trackio.Table(columns=list(columns), data=[list(r) for r in rows])
        self._log(run, {name: table}, step)

    def write_resume(self, resume: Resume) -> None:
        """Record the attempt in the run's config (``otel_rl.attempts``,
        ``otel_rl.resume_steps``, as W&B's). Trackio keeps the rows of both attempts at a
        repeated step."""
        earlier = self.run.config.get(RESUME_STEPS_KEY) if self.run is not None else None
        self.write_hyperparams(attempts_config(resume.attempt, resume.step, earlier))

    def close(self, exit_code: int) -> None:
        # Trackio has no run status; the exit code is not recorded.
        if self.run is None:
            return
        if self._config_pending:
            # Late hyperparameters and no row since: an empty row carries them.
            self.run.log({}, step=self._highest_step)
        self.run.finish()
        self.run = None

    # ---- helpers -----------------------------------------------------------------------------

    def _ensure_run(self, config: Mapping[str, Any] | None = None) -> Any:
        if self.run is None:
            kwargs = dict(self.init_kwargs)
            if config is not None:
                kwargs["config"] = {**dict(kwargs.get("config") or {}), **dict(config)}
            self.run = self._trackio.init(**kwargs)
            name = getattr(self.run, "name", None)
            if name:
                # ``otel-rl replay`` continues the run of the same name (Trackio has no run id).
                self.resume_config = {"trackio": {"name": name, "resume": "allow"}}
                self._remember_resume()
        return self.run

    def _log(self, run: Any, data: dict[str, Any], step: int) -> None:
        with self.refused_content():
            run.log(data, step=step)
        self._config_pending = False
        self._highest_step = max(self._highest_step, step)
