"""A tracker that appends rows to a JSON-lines file and misbehaves on demand.

It is not a real tracker SDK: it stands for a backend that is slow or down (raising a
``ConnectionError``, as a tracker client does when its server is unreachable), which no real
tracker is on demand. The misbehaviour is read from a control file before every write, so the
test process can start and end an outage while the training process runs:

- ``ok``: write at once;
- ``slow <seconds>``: sleep that long before each write;
- ``raise``: raise ``ConnectionError``.

It is found by name through a real ``otel_rl.exporters`` entry point
(:func:`install_entry_point`), so ``otel-rl replay`` rebuilds it from the spooled config.
Each write is one ``os.write`` on an ``O_APPEND`` descriptor, which a kill can still cut short:
a torn last line is cut when the tracker opens, and ``holds_since`` counts whole lines.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from otel_rl.core.records import RowValue, StepBatch
from otel_rl.exporters import RowRejected
from otel_rl.exporters.base import TrackerExporter
from otel_rl.exporters.jsonl import holds_lines_since

NAME = "faultfile"


class FaultFileTracker(TrackerExporter):
    name: ClassVar[str] = NAME
    max_batch: ClassVar[int] = 16

    def __init__(self, path: str, control: str, **kwargs: Any) -> None:
        self.path = path
        self.control = control
        self._fd: int | None = None
        super().__init__(**kwargs)

    def open(self) -> None:
        self._fault()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.lseek(self._fd, 0, os.SEEK_END)
        if size:
            tail = os.pread(self._fd, min(size, 1 << 16), max(0, size - (1 << 16)))
            if not tail.endswith(b"\n"):
                os.ftruncate(self._fd, size - len(tail) + tail.rfind(b"\n") + 1)

    def write_step(self, step: int, rows: Mapping[str, RowValue], batch: StepBatch) -> None:
        self.write_batches([batch])

    def write_batches(self, batches: Sequence[StepBatch]) -> None:
        self._fault()
        refused = self._mode()
        if refused[:1] == ["refuse"] and any(b.step == int(refused[1]) for b in batches):
            raise RowRejected(f"faultfile: refuses step {refused[1]} (control file says so)")
        lines = [
            json.dumps({"step": b.step, "rows": {k: v for k, v in b.rows.items()
                                                  if type(v) is float}}) + "\n"
            for b in batches
        ]
        assert self._fd is not None
        os.write(self._fd, "".join(lines).encode())

    def write_position(self) -> Any:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def holds_since(self, position: Any, records: int | None = None) -> bool:
        # One os.write per batch, which a kill may still cut short: count the whole lines.
        return holds_lines_since(self.path, position, records)

    def close(self, exit_code: int) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _mode(self) -> list[str]:
        try:
            return Path(self.control).read_text().split()
        except OSError:
            return ["ok"]

    def _fault(self) -> None:
        mode = self._mode()
        if not mode or mode[0] == "ok":
            return
        if mode[0] == "slow":
            time.sleep(float(mode[1]))
        elif mode[0] == "raise":
            raise ConnectionError("faultfile: backend down (control file says so)")


def set_mode(control: str | os.PathLike, mode: str) -> None:
    """Switch the tracker's behaviour (atomically: a reader never sees half a word)."""
    control = Path(control)
    tmp = control.with_name(control.name + ".tmp")
    tmp.write_text(mode)
    tmp.replace(control)


def install_entry_point(site: Path) -> Path:
    """Make ``faultfile`` an installed tracker for processes with ``site`` on their path."""
    info = site / "otel_rl_faultfile-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otel-rl-faultfile\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[otel_rl.exporters]\n{NAME} = tests.faults.fault_tracker:FaultFileTracker\n"
    )
    return site


def env_with_faultfile(tmp_path: Path) -> dict[str, str]:
    """The environment of a child process that finds ``faultfile`` (and ``tests``)."""
    site = install_entry_point(tmp_path / "site")
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([str(site), root, env.get("PYTHONPATH", "")])
    return env


def read_rows(path: str | os.PathLike) -> list[tuple[int, dict[str, float]]]:
    """``[(step, {key: value})]`` in the order the tracker wrote them."""
    if not Path(path).exists():
        return []
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            rows.append((record["step"], record["rows"]))
    return rows
