"""Read back what W&B, SwanLab and Trackio stored, with each tracker's own reader.

- W&B: ``wandb leet inspect --json <run dir>`` (W&B's own decoder of the ``run-<id>.wandb``
  transaction log; wandb 0.31 has no Python reader for it any more).
- SwanLab: SwanLab's ``DataStoreReader`` over ``run-<id>.swanlab`` and its ``Record`` protobufs.
- Trackio: Trackio's ``SQLiteStorage`` over ``$TRACKIO_DIR/<project>.db``.

Trackio reads ``TRACKIO_DIR`` once, when it is imported; importing this module points it at a
temporary directory unless the environment already sets one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="otel-rl-trackio-"))


# ---- W&B -------------------------------------------------------------------------------------


def wandb_offline_env(monkeypatch: Any, directory: Path, *, mode: str | None = "offline") -> None:
    """Point W&B at ``directory`` with no account or network (``mode=None``: the test's config
    chooses the mode).

    W&B reads its environment once per process, when its first run begins: a test whose run
    must be offline whatever ran before it in the process says so in its config too
    (``mode: offline``). (Tearing W&B down to make it read the environment again stops the
    service a run of an earlier test may still be using.)
    """
    if mode is None:
        monkeypatch.delenv("WANDB_MODE", raising=False)
    else:
        monkeypatch.setenv("WANDB_MODE", mode)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.setenv(name, str(directory / name.lower()))


@dataclass
class WandbRun:
    run_id: str
    resumed: bool
    history: list[dict[str, Any]]
    config: dict[str, Any]
    metrics: dict[str, str | None]  # metric name → its step_metric
    exit_code: int | None
    files: list[str] = field(default_factory=list)

    def series(self, key: str, axis: str = "global_step") -> list[tuple[Any, Any]]:
        """``[(axis value, value)]`` of every history row that holds ``key``, in log order."""
        return [(row.get(axis), row[key]) for row in self.history if key in row]


def wandb_run_dirs(root: Path) -> list[Path]:
    """Run directories (``offline-run-*`` / ``run-*``) under ``root/wandb``, oldest first."""
    base = Path(root) / "wandb"
    dirs = [p for p in base.iterdir() if p.is_dir() and "run-" in p.name and not p.is_symlink()]
    return sorted(dirs, key=lambda p: p.name)


def wandb_folder_run_id(run_dir: Path) -> str:
    """The run id W&B put in a run folder's name: ``[offline-]run-<date>_<time>-<id>``, with
    ``-<n>`` after it when two folders of the run were made in the same second."""
    match = re.fullmatch(r"(?:offline-)?run-\d{8}_\d{6}-(.+?)(?:-\d+)?", run_dir.name)
    if match is None:
        raise AssertionError(f"{run_dir} is not named as W&B names a run's folder")
    return match.group(1)


def wandb_wrote_a_run(run_dir: Path) -> bool:
    """Whether W&B wrote a run into ``run_dir`` (its ``.wandb`` log holds more than its header):
    a launch killed while ``wandb.init`` ran leaves the folder without one."""
    return any(log.stat().st_size > 7 for log in run_dir.glob("*.wandb"))


def read_wandb(run_dir: Path) -> WandbRun:
    """Decode a run's ``.wandb`` log with ``wandb leet inspect --json``."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    command = [str(wandb_cli)] if wandb_cli.exists() else [sys.executable, "-m", "wandb"]
    done = subprocess.run(
        [*command, "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise AssertionError(
            f"wandb leet inspect {run_dir} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    out = done.stdout
    run_id, resumed, exit_code = "", False, None
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    metrics: dict[str, str | None] = {}
    files: list[str] = []
    for line in out.splitlines():
        record = json.loads(line)
        kind = record.get("type")
        body = record.get(kind, {})
        if kind == "run":
            run_id = body["run_id"]
            resumed = bool(body.get("resume"))
            config.update(_drop_internal(body.get("config", {}).get("update", {})))
        elif kind == "history":
            history.append(body["item"])
        elif kind == "config":
            config.update(_drop_internal(body.get("update", {})))
        elif kind == "metric" and "name" in body:
            metrics[body["name"]] = body.get("step_metric")
        elif kind == "exit":
            exit_code = int(body.get("exit_code", 0))
        elif kind == "files":
            files.extend(f["path"] for f in body.get("files", []))
    return WandbRun(run_id, resumed, history, config, metrics, exit_code, files)


def wandb_number(value: Any) -> float:
    """A history value as a float (the JSON log spells non-finite numbers as strings)."""
    return float(value) if isinstance(value, str) else value


def _drop_internal(update: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in update.items() if k != "_wandb"}


# ---- SwanLab ---------------------------------------------------------------------------------


@dataclass
class SwanLabRun:
    run_dir: Path
    run_id: str
    scalars: dict[str, list[tuple[int, float]]]
    media: dict[str, list[tuple[int, str, list[str]]]]  # key → [(step, column type, files)]
    finish_state: str | None
    finish_error: str | None
    config: dict[str, Any]

    def media_file(self, kind: str, filename: str) -> Path:
        return self.run_dir / "media" / kind / filename


def swanlab_run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in Path(root).glob("run-*") if p.is_dir())


def read_swanlab(run_dir: Path) -> SwanLabRun:
    """Decode ``run-<id>.swanlab`` with SwanLab's own ``DataStoreReader`` and protobufs."""
    import yaml
    from swanlab.proto.swanlab.metric.column.v1.column_pb2 import ColumnType
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.proto.swanlab.run.v1.run_pb2 import RunState
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    (path,) = Path(run_dir).glob("run-*.swanlab")
    reader = DataStoreReader()
    reader.open(path)
    scalars: dict[str, list[tuple[int, float]]] = {}
    media: dict[str, list[tuple[int, str, list[str]]]] = {}
    run_id, state, error = "", None, None
    try:
        while (data := reader.scan()) is not None:
            record = Record()
            record.ParseFromString(data)
            kind = record.WhichOneof("record_type")
            if kind == "start":
                run_id = record.start.id
            elif kind == "scalar":
                scalar = record.scalar
                scalars.setdefault(scalar.key, []).append((scalar.step, scalar.value.number))
            elif kind == "media":
                m = record.media
                files = [item.filename for item in m.value.items]
                kind_name = ColumnType.Name(m.type)
                media.setdefault(m.key, []).append((m.step, kind_name, files))
            elif kind == "finish":
                state = RunState.Name(record.finish.state)
                error = record.finish.error or None
    finally:
        reader.close()
    config_file = Path(run_dir) / "files" / "config.yaml"
    raw = yaml.safe_load(config_file.read_text()) if config_file.exists() else {}
    config = {k: v["value"] for k, v in (raw or {}).items()}
    return SwanLabRun(Path(run_dir), run_id, scalars, media, state, error, config)


# ---- Trackio ---------------------------------------------------------------------------------


def trackio_dir() -> Path:
    from trackio import utils

    return Path(utils.TRACKIO_DIR)


def read_trackio(project: str, run: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(rows, config)`` of a run: rows are ``{"step": N, key: value, ...}`` in log order."""
    from trackio.sqlite_storage import SQLiteStorage

    rows = SQLiteStorage.get_logs(project, run)
    config = SQLiteStorage.get_run_config(project, run) or {}
    return rows, {k: v for k, v in config.items() if not k.startswith("_")}
