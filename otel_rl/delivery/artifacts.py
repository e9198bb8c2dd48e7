"""Large artifact dumps (JSONL files of rollouts) written off the training thread.

A batch of 1,024 rollouts x 4,096 tokens is 8 M numbers; turning it into Python lists and
``json.dumps`` on the training thread takes many seconds per step. Here the caller only takes a
snapshot — tensors become CPU numpy copies (a memcpy), lists are copied as containers — and one
background thread per :class:`ArtifactWriter` serializes and writes it: with ``orjson`` (numpy
arrays natively) when it is installed, else with the standard ``json`` module.

File layout, as NeMo RL writes it: one line per sample, every value sliced as a batch of one
(``tensor[i:i+1]`` → ``[[...]]``, ``list[i:i+1]`` → ``[item]``) plus ``"idx": i``. Samples holding
NaN or ±inf are written with ``json`` so they keep Python's ``NaN``/``Infinity`` tokens (orjson
would turn them into ``null``). A dump is written to ``<file>.tmp`` and renamed, so a reader never
sees half a file; :meth:`ArtifactWriter.flush` waits until every queued dump is on disk.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_rl.process.fork_safe_log import log as _log
from otel_rl.process.lifecycle import weak_atexit


def _optional_orjson() -> Any:
    """orjson is optional (extra "compat"); json is the fallback."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - depends on the environment
        return None
    return orjson


_orjson = _optional_orjson()

#: Which serializer the background thread uses: "orjson" or "json".
JSON_ENGINE = "orjson" if _orjson is not None else "json"

_SCALARS = (str, int, float, bool, type(None))
_WRITE_CHUNK = 8 << 20  # bytes buffered before one write call


class ArtifactWriter:
    """A background thread that runs artifact jobs (serialize + write) in submission order.

    ``max_pending`` bounds the snapshots held in memory: when that many dumps wait, the next
    :meth:`submit` waits for the oldest to finish (with one warning) instead of growing memory
    without limit.

    Why not ``ThreadPoolExecutor(max_workers=1)`` plus a semaphore: the executor's worker is
    joined by ``threading``'s own exit hook, before any ``atexit`` function and without a time
    limit, so a dump stuck on a dead filesystem would hang the process's exit for good. Here the
    thread is a daemon and the exit drain is bounded (300 s, then a warning naming how many dumps
    were lost), and a fork child's exit skips it (:func:`otel_rl.process.lifecycle.weak_atexit`).
    """

    def __init__(self, max_pending: int = 4, name: str = "otel-rl-artifacts") -> None:
        self.max_pending = max(1, int(max_pending))
        self.name = name
        self._cond = threading.Condition()
        self._jobs: deque[tuple[str, Callable[[], int]]] = deque()
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._warned_full = False
        self.stats = {"written": 0, "failed": 0, "bytes": 0, "waits": 0}
        self._atexit = weak_atexit(self, _flush_at_exit)

    def submit(self, description: str, job: Callable[[], int]) -> None:
        """Queue ``job`` (returns the bytes it wrote); ``description`` names it in warnings."""
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after close ({description})")
            if len(self._jobs) >= self.max_pending:
                self.stats["waits"] += 1
                if not self._warned_full:
                    self._warned_full = True
                    _log.warning(
                        "otel-rl: %d artifact dumps are waiting to be written; %s waits for the "
                        "oldest (artifacts are produced faster than the disk takes them)",
                        len(self._jobs),
                        description,
                    )
                while len(self._jobs) >= self.max_pending:
                    self._cond.wait()
            self._jobs.append((description, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Jobs queued or being written."""
        with self._cond:
            return len(self._jobs) + (1 if self._busy else 0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished; returns ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Finish the queued jobs and stop the thread; returns whether everything was written."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and done:
            self._thread.join(1.0)
        atexit.unregister(self._atexit)
        return done

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                description, job = self._jobs.popleft()
                self._busy = True
                self._cond.notify_all()  # a submit waiting for room may go on
            try:
                written = job()
                self.stats["written"] += 1
                self.stats["bytes"] += int(written or 0)
            except Exception as exc:  # a failed dump must not stop the next ones
                self.stats["failed"] += 1
                _log.warning(
                    "otel-rl: artifact %s failed: %s: %s", description, type(exc).__name__, exc
                )
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def _flush_at_exit(writer: ArtifactWriter) -> None:
    if not writer.flush(timeout=300):
        _log.warning("otel-rl: %d artifact dump(s) not written before exit", writer.pending)


# ---- snapshots (caller's thread) ----------------------------------------------------------------


def snapshot_batch(data: Mapping[Any, Any]) -> tuple[dict[Any, Any], int]:
    """``(columns, batch size)``: a copy of ``data`` that later changes by the caller cannot touch.

    Tensors become C-contiguous CPU numpy copies (bfloat16 as float32), numpy arrays are copied,
    lists are copied with their nested lists; strings and numbers are immutable and kept.
    """
    columns = {key: snapshot_value(value) for key, value in data.items()}
    sizes = {key: _batch_len(value) for key, value in columns.items()}
    if not sizes:
        return columns, 0
    distinct = set(sizes.values())
    if None in distinct or len(distinct) != 1:
        detail = ", ".join(
            f"{k!s}: {v if v is not None else 'not a batch'}" for k, v in sizes.items()
        )
        raise ValueError(
            f"every value must be a batch (tensor, array or list) of the same length; got {detail}"
        )
    size = distinct.pop()
    assert size is not None  # refused above
    return columns, size


def snapshot_value(value: Any) -> Any:
    """A private copy of one value (see :func:`snapshot_batch`)."""
    if isinstance(value, _SCALARS):
        return value
    if _is_tensor(value):
        return _tensor_to_numpy(value)
    if _is_ndarray(value):
        return value.copy(order="C")
    if isinstance(value, (list, tuple)):
        items = list(value)
        # A list of scalars (the common case for text and ids) is copied by one C call; only
        # lists that hold containers are walked.
        if items and not isinstance(items[0], _SCALARS):
            items = [snapshot_value(item) for item in items]
        return items
    if isinstance(value, Mapping):
        return {k: snapshot_value(v) for k, v in value.items()}
    return value


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy")


def _is_ndarray(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "shape") and hasattr(value, "copy")


def _tensor_to_numpy(tensor: Any) -> Any:
    import torch  # a tensor exists, so torch is already imported

    t = tensor.detach()
    # A device-to-host copy is already private; a CPU tensor is cloned (a memcpy).
    t = t.cpu() if t.device.type != "cpu" else t.clone(memory_format=torch.contiguous_format)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        t = t.float()
    try:
        array = t.numpy()
    except RuntimeError:  # torch built without numpy
        return t.tolist()
    return array if array.flags.c_contiguous else array.copy(order="C")


def _batch_len(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        return len(value)
    shape = getattr(value, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[0])
    return None


# ---- encoding and writing (background thread) ------------------------------------------------


def iter_batch_lines(columns: Mapping[Any, Any], size: int) -> Iterator[bytes]:
    """One JSON line (bytes, with ``\\n``) per sample, NeMo RL's layout (see module docstring)."""
    nonfinite = _nonfinite_rows(columns, size)
    for i in range(size):
        row: dict[Any, Any] = {key: value[i : i + 1] for key, value in columns.items()}
        row["idx"] = i
        yield dumps_line(row, keep_nonfinite=i in nonfinite)


def dumps_line(obj: Any, keep_nonfinite: bool = True) -> bytes:
    """``obj`` as one JSON line. ``keep_nonfinite``: NaN/±inf as Python's tokens (via ``json``);
    otherwise orjson (when installed) may write them as ``null``."""
    if _orjson is not None and not keep_nonfinite:
        line: bytes = _orjson.dumps(
            obj,
            default=_orjson_default,
            option=_orjson.OPT_SERIALIZE_NUMPY
            | _orjson.OPT_NON_STR_KEYS
            | _orjson.OPT_APPEND_NEWLINE,
        )
        return line
    return (json.dumps(to_plain(obj), default=str, separators=(", ", ": ")) + "\n").encode()


def to_plain(value: Any) -> Any:
    """numpy arrays and scalars (anywhere in ``value``) as Python lists and numbers."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], _SCALARS):
            return value
        return [to_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _orjson_default(value: Any) -> Any:
    if hasattr(value, "tolist"):  # arrays orjson cannot take (strings, non-native byte order)
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return str(value)


def _nonfinite_rows(columns: Mapping[Any, Any], size: int) -> set[int]:
    """Indices of the samples that hold a NaN or ±inf anywhere (vectorized for arrays)."""
    rows: set[int] = set()
    for value in columns.values():
        if _is_ndarray(value):
            if value.dtype.kind in "fc" and size:
                import numpy as np

                finite = np.isfinite(value.reshape(size, -1)).all(axis=1)
                rows.update(int(i) for i in np.flatnonzero(~finite))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if i not in rows and has_nonfinite(item):
                    rows.add(i)
    return rows


def has_nonfinite(value: Any) -> bool:
    """Whether ``value`` (a number, array, list or mapping) holds NaN or ±inf."""
    kind = type(value)
    if kind is float:
        return not math.isfinite(value)
    if kind in (str, int, bool) or value is None:
        return False
    if _is_ndarray(value):
        if value.dtype.kind not in "fc":
            return False
        import numpy as np

        return not bool(np.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        if not value:
            return False
        if type(value[0]) in (int, float):
            try:  # one C-level pass; an overflow to inf only sends the row to the slow path
                return not math.isfinite(math.fsum(value))
            except (TypeError, ValueError, OverflowError):
                pass
        return any(has_nonfinite(v) for v in value)
    if isinstance(value, Mapping):
        return any(has_nonfinite(v) for v in value.values())
    if hasattr(value, "dtype") and hasattr(value, "item"):  # numpy scalar
        try:
            return not math.isfinite(float(value))
        except (TypeError, ValueError):
            return False
    return False


def write_lines_atomically(path: str | os.PathLike[str], lines: Iterator[bytes]) -> int:
    """Write ``lines`` to ``path`` through ``<path>.tmp`` and a rename; returns bytes written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    written = 0
    with open(tmp, "wb") as f:
        chunk: list[bytes] = []
        size = 0
        for line in lines:
            chunk.append(line)
            size += len(line)
            if size >= _WRITE_CHUNK:
                f.write(b"".join(chunk))
                written += size
                chunk, size = [], 0
        if chunk:
            f.write(b"".join(chunk))
            written += size
    os.replace(tmp, target)
    return written


def append_lines(path: str | os.PathLike[str], lines: Sequence[str]) -> int:
    """Append ``lines`` (each followed by ``\\n``) to ``path`` in one write; returns bytes."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(f"{line}\n" for line in lines).encode("utf-8")
    with open(target, "ab") as f:
        f.write(data)
    return len(data)
