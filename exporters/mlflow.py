"""MLflow exporter: metrics, params, plots and tables of one MLflow run, via ``MlflowClient``.

MLflow's fluent API (``mlflow.log_metric``) keeps the active run per thread, so everything here
goes through an ``MlflowClient`` and an explicit run id, on the exporter's own thread. When a
backlog of steps builds up, they leave in one ``log_batch`` request (at most 1000 metrics and
100 params per request, MLflow's limits). Names are mapped to MLflow's rules by
:mod:`otel_rl.exporters.mlflow_names`.

Where things go (see docs/backends/mlflow.md):

- tracking URI: ``mlflow.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local SQLite store
  ``sqlite:///<log_dir>/mlflow/mlflow.db`` with artifacts under ``<log_dir>/mlflow/artifacts``;
- run: ``mlflow.run_id`` or ``MLFLOW_RUN_ID`` resumes that run, else a new run in
  ``mlflow.experiment_name`` / ``MLFLOW_EXPERIMENT_NAME`` / ``MLFLOW_EXPERIMENT_ID`` / the
  config's ``experiment`` / ``Default``;
- scalars → metrics at their step (NaN stays NaN; MLflow stores ±inf as ±1.797e308);
  histograms → ``<key>/count, /sum, /mean, /min, /max``; text → ``text/<key>/step_<N>.txt``;
  plots → ``plots/<name>/step_<N>.png``; tables → ``tables/<name>/step_<N>.json``;
- ``close(exit_code)``: FINISHED (0), KILLED (130, 143, 137 or a negative signal number),
  FAILED (anything else).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from otel_rl.core.errors import ConfigError
from otel_rl.core.records import Event, HistogramValue, Resume, RowValue, StepBatch, TableRows
from otel_rl.core.redaction import collect_secrets, redact_text, secret_values
from otel_rl.delivery.tracker import RunConfig
from otel_rl.exporters.base import RowRejected, TrackerConfig, TrackerExporter
from otel_rl.exporters.mlflow_names import NameMap, sanitize

#: MLflow's per-request limits (mlflow.utils.validation).
MAX_METRICS_PER_REQUEST = 1000
MAX_PARAMS_PER_REQUEST = 100
MAX_PARAM_VALUE_LENGTH = 6000

#: Keys accepted in the ``mlflow:`` config section.
CONFIG_KEYS = frozenset(
    {"experiment_name", "run_name", "tracking_uri", "run_id", "artifact_location", "tags"}
)

#: Exit codes that mean the run was stopped from outside: SIGINT (130), SIGTERM (143),
#: SIGKILL (137), and subprocess's negative signal numbers.
_KILLED_CODES = frozenset({130, 137, 143, -2, -9, -15})

#: MLflow error codes that mean "this request can never succeed" (as opposed to a server
#: that is down or busy).
_PERMANENT_ERRORS = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE"})


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def _server_call(hook: _Hook) -> _Hook:
    """A hook that calls the tracking server: the server is reached first (a TCP connection,
    :meth:`MlflowExporter._reach_server`) while no call has reached it since the last failure,
    so that a server that is down fails the try at once, not after MLflow's own retries; and
    its error is scrubbed in place (MLflow's errors quote the request URL, which holds the
    tracking URI's ``user:password@``; type and ``error_code`` kept, so it is classified the
    same) before it reaches any log line or the spool."""

    @functools.wraps(hook)
    def wrapper(self: MlflowExporter, *args: Any, **kwargs: Any) -> Any:
        try:
            if not self._reached:
                self._reach_server()
            result = hook(self, *args, **kwargs)
        except Exception as exc:
            self._reached = False
            _scrub_exception(exc, self._secrets)
            raise
        self._reached = True
        return result

    return wrapper  # type: ignore[return-value]


def server_address(uri: str) -> tuple[str, int] | None:
    """Where a connection to an ``http(s)://`` tracking server goes (its proxy's address when
    the environment routes it through one); ``None`` for other stores."""
    from urllib.parse import urlsplit
    from urllib.request import getproxies, proxy_bypass

    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    proxy = getproxies().get(parts.scheme)
    if proxy and not proxy_bypass(parts.hostname):
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    host = parts.hostname
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a port that is no number: MLflow's own call says so
        return None
    return (host, port) if host else None


def run_status(exit_code: int) -> str:
    """The MLflow run status for a process exit code."""
    if exit_code == 0:
        return "FINISHED"
    if exit_code in _KILLED_CODES:
        return "KILLED"
    return "FAILED"


def is_file_store(uri: str) -> bool:
    """Whether ``uri`` is MLflow's file store (a path or ``file:``), where names are paths."""
    if uri in ("databricks", "databricks-uc", "uc"):
        return False
    scheme = uri.split(":", 1)[0] if ":" in uri else ""
    return scheme in ("", "file") or (len(scheme) == 1 and scheme.isalpha())  # C:\ on Windows


def _alive(pid: str) -> bool:
    """Whether the process ``pid`` (as text) still runs; True when that cannot be known."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (ValueError, OSError):
        return True
    return True


def anchored(uri: str) -> str:
    """``uri`` with a relative local path made absolute here: a store the tracker opens later on
    its own thread (or after the script's ``chdir()``) is where the config meant it."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        if path and not path.startswith("/") and not path.startswith(":memory:"):
            return f"sqlite:///{Path(path).absolute().as_posix()}"
        return uri
    if uri.startswith("file:") and not uri.startswith(("file:/", "file://")):
        return Path(uri.removeprefix("file:")).absolute().as_uri()
    if is_file_store(uri) and ":" not in uri:
        return str(Path(uri).absolute())
    return uri


class MlflowExporter(TrackerExporter):
    name: ClassVar[str] = "mlflow"
    backwards_policy: ClassVar[str] = "MLflow keeps both points at that step"
    #: Steps per worker pass: a backlog of up to 64 steps leaves in as few requests as the
    #: 1000-metrics limit allows (one for 64 steps of 15 keys, seven for 64 steps of 100 keys).
    max_batch: ClassVar[int] = 64
    requires: ClassVar[tuple[str, ...]] = ("mlflow",)
    config: ClassVar[TrackerConfig | None] = TrackerConfig(
        flag="MLflow",
        order=50,
        mapping=(
            "`experiment_name`, `run_name`, `tracking_uri`, `run_id`, `artifact_location`, `tags` "
            "([backends/mlflow.md](backends/mlflow.md))"
        ),
        accepted=CONFIG_KEYS,
    )  # fmt: skip

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        artifact_location: str | None = None,
        tags: Mapping[str, Any] | None = None,
        log_dir: str | os.PathLike[str] = "logs",
        fallback_experiment: str | None = None,
        **kwargs: Any,
    ) -> None:
        env = os.environ
        mlflow_dir = Path(log_dir).absolute() / "mlflow"
        #: Whether the tracking URI is otel-rl's default local store (nothing configured).
        self.local_default = not (tracking_uri or env.get("MLFLOW_TRACKING_URI"))
        self.tracking_uri = anchored(
            tracking_uri
            or env.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(mlflow_dir / 'mlflow.db').as_posix()}"
        )
        if artifact_location is None and self.local_default:
            artifact_location = (mlflow_dir / "artifacts").as_uri()
        elif artifact_location is None and self.tracking_uri.startswith("sqlite:"):
            # MLflow's own default for a new experiment in a SQLite store, taken from here now
            # rather than from wherever the script is when the tracker opens it.
            artifact_location = Path("mlruns").absolute().as_uri()
        self.artifact_location = None if artifact_location is None else anchored(artifact_location)
        # The artifact root of a SQLite store this tracker creates (see _create_sqlite_store).
        self._store_root = (self.local_default and self.artifact_location) or (
            Path("mlruns").absolute().as_uri()
        )
        self.experiment_name = experiment_name or env.get("MLFLOW_EXPERIMENT_NAME") or None
        self._experiment_id = None if self.experiment_name else env.get("MLFLOW_EXPERIMENT_ID")
        if not (self.experiment_name or self._experiment_id):
            self.experiment_name = fallback_experiment or None  # else MLflow's "Default"
        self.run_name = run_name
        #: The MLflow run id: the one to resume, or the new run's once it is created.
        self.run_id: str | None = run_id or env.get("MLFLOW_RUN_ID") or None
        self._tags = {str(k): str(v) for k, v in (tags or {}).items()}
        file_store = is_file_store(self.tracking_uri)
        #: Row key → metric name, for the keys MLflow's rules made us rename.
        self.metric_names = NameMap("metric", file_store=file_store)
        self.param_names = NameMap("param", file_store=file_store)
        self._client: Any = None
        #: Whether the last call reached the server. Until one does (the first call, and after
        #: a failure), a connection is tried first: MLflow's own client retries a refused one
        #: for minutes inside one call, past any deadline of the run's end.
        self._reached = False
        # Metrics of a step already accepted by MLflow, so that a retry after a partial
        # failure does not send them again (stores keep duplicates of re-sent points).
        self._sent: weakref.WeakKeyDictionary[StepBatch, int] = weakref.WeakKeyDictionary()
        self._artifact_names: dict[str, set[str]] = {}
        # The URI's password (and the secret env vars) are replaced in every error message.
        self._secrets = secret_values(collect_secrets({"tracking_uri": self.tracking_uri}))
        super().__init__(**kwargs)

    @property
    def shown_tracking_uri(self) -> str:
        """The tracking URI as log lines may show it (no password)."""
        return redact_text(self.tracking_uri, self._secrets)

    @classmethod
    def from_config(cls, cfg: RunConfig, **kwargs: Any) -> MlflowExporter:
        section = dict(cfg.tracker_section("mlflow") or {})
        unknown = sorted(set(section) - CONFIG_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown logger config key(s) 'mlflow.{', mlflow.'.join(unknown)}'; "
                f"valid keys: {', '.join(sorted(CONFIG_KEYS))}"
            )
        tags = dict(section.get("tags") or {})
        if cfg.run_id:
            tags.setdefault("otel_rl.run_id", cfg.run_id)
        return cls(
            tracking_uri=section.get("tracking_uri"),
            experiment_name=section.get("experiment_name"),
            run_name=section.get("run_name"),
            run_id=section.get("run_id"),
            artifact_location=section.get("artifact_location"),
            tags=tags,
            log_dir=cfg.log_dir,
            fallback_experiment=cfg.experiment,
            **kwargs,
        )

    # ---- worker thread -----------------------------------------------------------------------

    @_server_call
    def open(self) -> None:
        from mlflow import MlflowClient

        self._create_sqlite_store()
        client = MlflowClient(tracking_uri=self.tracking_uri)
        if self.shown_tracking_uri != self.tracking_uri:
            _print_links_without_password(client, self.shown_tracking_uri)
        if self.run_id:
            run = client.get_run(self.run_id)  # a wrong id fails here, loudly, and is retried
            if run.info.status != "RUNNING":
                client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(
                self._resolve_experiment(client), run_name=self.run_name, tags=self._run_tags()
            )
            self.run_id = run.info.run_id
        self._client = client
        # A replay of spooled records (otel-rl replay) continues this run, not a new one.
        self.resume_config = {"mlflow": {"run_id": self.run_id}}

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    @_server_call
    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        pending: list[tuple[StepBatch, Any]] = []
        for batch in batches:
            already = self._sent.get(batch, 0)
            pending.extend((batch, m) for m in self._metrics(batch)[already:])
        for start in range(0, len(pending), MAX_METRICS_PER_REQUEST):
            chunk = pending[start : start + MAX_METRICS_PER_REQUEST]
            self._log_metrics([metric for _, metric in chunk])
            for batch, _ in chunk:
                self._sent[batch] = self._sent.get(batch, 0) + 1
        for batch in batches:
            for key, value in batch.rows.items():
                if isinstance(value, str):
                    path = f"text/{_artifact_dir(key)}/step_{batch.step}.txt"
                    self._client.log_text(self.run_id, value, path)

    @_server_call
    def write_hyperparams(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = []
        for key, value in params.items():
            name = self.param_names(str(key))
            text = _param_text(value)
            length = len(text)
            if length > MAX_PARAM_VALUE_LENGTH:
                full = f"params/{_artifact_dir(name)}.txt"
                self._client.log_text(self.run_id, text, full)
                note = f" ...[truncated: {length} chars, full value in artifact {full}]"
                text = text[: MAX_PARAM_VALUE_LENGTH - len(note)] + note
                self._warn_once(
                    f"long-param:{key}",
                    "%s: param %r is %d chars, over MLflow's %d; truncated with a note, the full "
                    "value is the artifact %s",
                    self.name,
                    key,
                    length,
                    MAX_PARAM_VALUE_LENGTH,
                    full,
                )
            items.append(Param(name, text))
        for start in range(0, len(items), MAX_PARAMS_PER_REQUEST):
            self._send(items[start : start + MAX_PARAMS_PER_REQUEST], "params")

    @_server_call
    def write_plot(self, name: str, step: int, png: bytes) -> None:
        folder = f"plots/{_artifact_dir(name)}"
        self._log_file(folder, self._unused_name(folder, f"step_{step}", ".png"), png)

    @_server_call
    def write_table(self, name: str, step: int, columns: Sequence[str], rows: TableRows) -> None:
        # MLflow's own table layout (pandas' "split" orientation): read back with
        # pandas.read_json(path, orient="split") or json.load.
        data = {"columns": list(columns), "data": [[_cell(c) for c in row] for row in rows]}
        folder = f"tables/{_artifact_dir(name)}"
        filename = self._unused_name(folder, f"step_{step}", ".json")
        self._log_file(folder, filename, json.dumps(data).encode("utf-8"))

    def write_event(self, event: Event) -> None:
        folder = f"events/{_artifact_dir(event.name)}"
        filename = self._unused_name(folder, f"step_{event.step}", ".txt")
        self._log_file(folder, filename, f"{event.title}\n\n{event.text}\n".encode())

    @_server_call
    def write_page(self, name: str, step: int, html: str, png: bytes) -> None:
        # MLflow's artifact view shows an .html file as the page itself.
        folder = f"pages/{_artifact_dir(name)}"
        filename = self._unused_name(folder, f"step_{step}", ".html")
        self._log_file(folder, filename, html.encode("utf-8"))

    @_server_call
    def continue_run(self, resume_config: Mapping[str, Any]) -> None:
        self.run_id = (resume_config.get("mlflow") or {}).get("run_id") or self.run_id

    @_server_call
    def write_resume(self, resume: Resume) -> None:
        # MLflow keeps every value logged at a step (its history shows both attempts there;
        # the charts draw the latest): the tags say which attempts the run had and where each
        # began, so the superseded values can be told apart by time.
        tags = self._client.get_run(self.run_id).data.tags
        steps = [s for s in tags.get("otel_rl.resume_steps", "").split(",") if s]
        self._client.set_tag(self.run_id, "otel_rl.attempts", str(resume.attempt))
        self._client.set_tag(
            self.run_id, "otel_rl.resume_steps", ",".join([*steps, str(resume.step)])
        )

    @_server_call
    def close(self, exit_code: int) -> None:
        if self._client is not None and self.run_id:
            self._client.set_terminated(self.run_id, status=run_status(exit_code))

    # ---- helpers -----------------------------------------------------------------------------

    def _reach_server(self) -> None:
        """Connect to an HTTP tracking server (or its proxy) and close: a server that refuses
        or does not answer within 5 s fails this call at once, as a transient error (retried
        with backoff until the run's end, what waits staying in the spool)."""
        import socket

        address = server_address(self.tracking_uri)
        if address is None:
            return
        try:
            socket.create_connection(address, timeout=5.0).close()
        except OSError as exc:
            raise ConnectionError(
                f"the MLflow tracking server {self.shown_tracking_uri} cannot be reached "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def _create_sqlite_store(self) -> None:
        """Create the SQLite store, if it does not exist yet, whole or not at all.

        MLflow builds a new store by running its migrations one after another, each committed
        on its own: a process killed part-way (a launch killed in its first seconds, a delivery
        process killed at the run's deadline), or a second process building the same file at
        the same time, left a half-built store that every later opening refused ("table ...
        already exists"), replay included. The store is built under a name of its own beside
        the file and linked into place, which never replaces a store another process put there
        first. A new store creates its ``Default`` experiment with the store's artifact root:
        the default store's is the tracker's artifact location (``log_dir``'s unless set), any
        other's MLflow's ``./mlruns`` as seen from where ``Logger()`` ran (MLflow would take the
        current directory's).
        """
        from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

        path = self.tracking_uri.removeprefix("sqlite:///")
        if path == self.tracking_uri or not path or path.startswith(":memory:") or "?" in path:
            return  # not a plain SQLite file: MLflow's own way
        db_path = Path(path)
        if db_path.exists():
            return
        db_path.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{db_path.name}."
        for stale in db_path.parent.glob(f"{prefix}*.building*"):  # with SQLite's journal
            if not _alive(stale.name.removeprefix(prefix).split("-")[0]):  # what a kill left
                stale.unlink(missing_ok=True)
        building = db_path.with_name(f"{prefix}{os.getpid()}-{id(self):x}.building")
        try:
            store = SqlAlchemyStore(  # type: ignore[no-untyped-call]
                f"sqlite:///{building.as_posix()}", self._store_root
            )
            store.engine.dispose()
            try:
                os.link(building, db_path)
            except FileExistsError:
                pass  # another process's store, whole: this one is not needed
            except OSError:  # a file system without hard links
                if not db_path.exists():
                    os.replace(building, db_path)
        finally:
            building.unlink(missing_ok=True)

    def _resolve_experiment(self, client: Any) -> str:
        if self._experiment_id:
            return str(self._experiment_id)
        name = self.experiment_name or "Default"
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            return str(experiment.experiment_id)
        try:
            return str(client.create_experiment(name, artifact_location=self.artifact_location))
        except Exception:
            # Another process may have created it in between.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return str(experiment.experiment_id)

    def _run_tags(self) -> dict[str, str]:
        tags: dict[str, str] = {}
        try:  # user, source file and git commit, as mlflow.start_run() records them
            from mlflow.tracking.context.registry import resolve_tags

            tags.update(resolve_tags())
        except Exception:
            pass
        tags.update(self._tags)
        return tags

    def _metrics(self, batch: StepBatch) -> list[Any]:
        from mlflow.entities import Metric

        rows = batch.rows
        timestamp = int(batch.time * 1000)
        step = int(batch.step)
        metrics = []
        for key, value in rows.items():
            if type(value) is float:
                metrics.append(Metric(self.metric_names(key), value, timestamp, step))
            elif isinstance(value, HistogramValue):
                for sub, number in value.stats(key).items():
                    if sub not in rows:
                        metrics.append(Metric(self.metric_names(sub), number, timestamp, step))
        return metrics

    def _log_metrics(self, metrics: list[Any]) -> None:
        if metrics:
            self._send(metrics, "metrics")

    def _send(self, items: list[Any], kind: str) -> None:
        """One ``log_batch``; an item MLflow refuses for good is isolated and dropped alone."""
        try:
            self._client.log_batch(self.run_id, **{kind: items}, synchronous=True)
        except Exception as exc:
            if not _is_permanent(exc):
                raise  # down or busy: the base class retries with backoff
            if len(items) == 1:
                self._value_refused(kind[:-1], items[0].key, _first_line(exc))
                return
            half = len(items) // 2
            self._send(items[:half], kind)
            self._send(items[half:], kind)

    def _unused_name(self, folder: str, stem: str, suffix: str) -> str:
        """``stem+suffix``, or ``stem_<k>+suffix`` if that file already exists in the run."""
        taken = self._artifact_names.get(folder)
        if taken is None:
            # Once per folder: a resumed run may already hold files from before.
            taken = {Path(f.path).name for f in self._client.list_artifacts(self.run_id, folder)}
            self._artifact_names[folder] = taken
        filename = stem + suffix
        k = 1
        while filename in taken:
            filename = f"{stem}_{k}{suffix}"
            k += 1
        return filename

    def _log_file(self, folder: str, filename: str, data: bytes) -> None:
        with tempfile.TemporaryDirectory(prefix="otel-rl-mlflow-") as tmp:
            path = Path(tmp) / filename
            path.write_bytes(data)
            self._client.log_artifact(self.run_id, str(path), artifact_path=folder)
        self._artifact_names.setdefault(folder, set()).add(filename)


def _is_permanent(exc: Exception) -> bool:
    if isinstance(exc, RowRejected):
        return True
    return getattr(exc, "error_code", None) in _PERMANENT_ERRORS


def _print_links_without_password(client: Any, shown_uri: str) -> None:
    """MLflow prints "View run <name> at: <tracking URI>/#/..." when a run ends, password
    included. This client prints the same links with the password replaced; if MLflow's
    internals differ from the version this was written for, the links are not printed at all
    (``MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT``, MLflow's own switch, read when a run ends)."""
    tracking = getattr(client, "_tracking_client", None)
    if tracking is None or not callable(getattr(tracking, "_log_url", None)):
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        return

    def log_url(run_id: str) -> None:
        try:
            run = client.get_run(run_id)
        except Exception:
            return  # a link is a courtesy: never fail the run's end for it
        base = shown_uri.rstrip("/")
        experiment = f"{base}/#/experiments/{run.info.experiment_id}"
        print(f"🏃 View run {run.info.run_name} at: {experiment}/runs/{run_id}", flush=True)
        print(f"🧪 View experiment at: {experiment}", flush=True)

    tracking._log_url = log_url


def _first_line(exc: Exception) -> str:
    text = redact_text(str(exc)).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _scrub_exception(exc: BaseException, secrets: set[str], depth: int = 0) -> None:
    """Redact the messages of ``exc`` and of its causes, in place."""
    if depth > 5:
        return
    try:
        exc.args = tuple(redact_text(a, secrets) if isinstance(a, str) else a for a in exc.args)
        message = getattr(exc, "message", None)
        if isinstance(message, str):
            exc.message = redact_text(message, secrets)  # type: ignore[attr-defined]
    except Exception:
        pass  # an exception type with read-only attributes: leave it as it is
    for linked in (exc.__cause__, exc.__context__):
        if linked is not None and linked is not exc:
            _scrub_exception(linked, secrets, depth + 1)


def _artifact_dir(name: str) -> str:
    """A safe relative artifact folder for a metric/plot/table name (``/`` keeps nesting)."""
    return sanitize(name)


def _param_text(value: Any) -> str:
    # str() as mlflow.log_params does, so values read the same as in MLflow's own runs.
    return value if isinstance(value, str) else str(value)


def _cell(value: Any) -> Any:
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    return str(value)
