"""Where each process of a job is, published where the whole job can read it.

Every process otel-rl runs in (the driver's ``Logger``, each ``WorkerMetrics``) keeps a small
state — role and rank, pid, node, last step, open timer path, the innermost wait the verdict
recognises with its target, one line of stack, the collectives it entered on each process group,
and since when each was true — and publishes it on a thread of its own every
:data:`PUBLISH_EVERY` seconds (a process with a ``Logger`` also at once when its stall report
begins, and each publisher just after one of its phases passes its stall deadline).

The states go to places the job already reaches, with no server of their own (a
:class:`Board`): Ray's own key-value store in its GCS for a Ray job's driver and actors, the
``torch.distributed`` store of a torchrun or ``init_process_group`` job (through a client of its
own with a short timeout, so that a store that is down never holds a caller: the job's own store
client waits up to the process group's 30 minutes), and a shared directory where that is all
there is. The training thread never waits for any of it: the state is read from the live
frames, as the verdict reads them. A board that fails is said once, and costs the job nothing
else.

The process that sees a stall reads every state and compares them
(:mod:`otel_rl.watch.job_verdict`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path
from stat import S_ISREG
from typing import Any, Protocol, cast

from otel_rl.process.fork_safe_log import log as _log
from otel_rl.telemetry.timing import open_phases, phase_history
from otel_rl.watch.locks import where as _where
from otel_rl.watch.process_state import MAX_STATE_BYTES, GroupCount, JobState, PublishedWait
from otel_rl.watch.process_state import text as _text
from otel_rl.watch.stalls import open_phases_with_deadlines, write_whole
from otel_rl.watch.waits import frames_of, recognise, training_thread, user_frame
from otel_rl.watch.waits.collective import CollectiveWait, group_name
from otel_rl.watch.waits.http_request import HttpWait

__all__ = [
    "PUBLISH_EVERY",
    "Board",
    "DirectoryBoard",
    "JobState",
    "JobStates",
    "RayBoard",
    "StatePublisher",
    "TorchStoreBoard",
    "collective_counts",
    "process_state",
    "publish_from_a_worker",
]

#: Seconds between two publications of a process's state (and the age past which the comparing
#: process counts another as no longer heard from: :data:`SILENT_AFTER`).
PUBLISH_EVERY = 5.0
#: Seconds from the publisher's start to its first publication.
FIRST_AFTER = 1.0
#: A state older than this, in a job whose other processes publish, is "not heard from".
SILENT_AFTER = 4 * PUBLISH_EVERY
#: Process groups whose counts a state carries (a job's own groups are a handful).
MAX_GROUPS = 64
#: Seconds one board may take to be written or read.
BOARD_TIMEOUT = 5.0
_KEY_PREFIX = "otel_rl/job/"
#: The process group seen here is its parent's, inherited through fork: not this process's rank.
_GROUP_INHERITED = False


def _in_a_process_group() -> bool:
    """This process is a rank of a ``torch.distributed`` process group (its own, not one it
    inherited through fork)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return bool(not _GROUP_INHERITED and dist is not None and dist.is_available()
                    and dist.is_initialized())  # fmt: skip
    except Exception:
        return False


def launch(parent: bool = False) -> str:
    """The launch this process is part of, in words each of its processes has alike: torchrun's
    run id (unless ``none``) or Slurm's job step, then the restart, from the environment; with
    ``parent``, where neither names the run, the process that started this one (its pid and its
    start on this host: torchrun's agent, a launch script). Empty when nothing names it."""
    env = os.environ
    parts = []
    if env.get("TORCHELASTIC_RUN_ID", "none") != "none":
        parts.append(f"torchrun run {env['TORCHELASTIC_RUN_ID']}")
    elif env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        parts.append(f"Slurm step {env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}")
    elif parent:
        ppid, began = os.getppid(), "?"
        with contextlib.suppress(OSError, IndexError):  # clock ticks after boot (Linux)
            began = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        parts.append(f"started by pid {ppid} on {socket.gethostname()} (at tick {began})")
    restart = env.get("TORCHELASTIC_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT")
    if restart:
        parts.append(f"restart {restart}")
    return ", ".join(parts)


# ---- what this process publishes ---------------------------------------------------------------


def collective_counts() -> dict[str, GroupCount]:
    """``{group: GroupCount}`` for each ``torch.distributed`` process group this
    process belongs to: ``count`` is the backend's own sequence number, the collectives this
    process entered on that group (``None`` where the backend keeps none). Empty without
    ``torch.distributed`` or before ``init_process_group``."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not _in_a_process_group():
            return {}
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:
        return {}
    out: dict[str, GroupCount] = {}
    for group in groups[:MAX_GROUPS]:
        count = size = backend = None
        with contextlib.suppress(Exception):
            count = int(group._get_sequence_number_for_group())
        with contextlib.suppress(Exception):
            size = int(group.size())
        with contextlib.suppress(Exception):
            backend = str(dist.get_backend(group))
        out[group_name(group)] = GroupCount(count, size, backend)
    return out


def _identity(role: str | None, rank: int | None) -> dict[str, Any]:
    """Role, rank and where this process runs: the process group's rank when ``rank`` is not
    given, the Ray node and actor when in Ray."""
    out: dict[str, Any] = {"pid": os.getpid(), "node": socket.gethostname()}
    dist = sys.modules.get("torch.distributed")
    with contextlib.suppress(Exception):
        if dist is not None and _in_a_process_group():
            out["world_rank"] = int(dist.get_rank())
            out["world_size"] = int(dist.get_world_size())
    ray = sys.modules.get("ray")
    with contextlib.suppress(Exception):
        if ray is not None and ray.is_initialized():
            context = ray.get_runtime_context()
            out["node_id"] = context.get_node_id()
            actor = context.get_actor_id()
            if actor:
                out["actor_id"] = actor
                with contextlib.suppress(Exception):  # the class, as Ray names its tasks
                    descriptor = context.current_actor._ray_actor_creation_function_descriptor
                    out["actor"] = str(descriptor.class_name).rsplit(".", 1)[-1]
            ip = ray.util.get_node_ip_address()
            if ip:
                out["ip"] = ip
    if rank is None:
        rank = out.get("world_rank")
    if role is None:
        role = ("rank" if rank is not None else "actor" if "actor_id" in out
                else "driver" if "node_id" in out else "process")  # fmt: skip
    out["role"], out["rank"] = _text(role), rank
    return out


class _Since:
    """When each published fact became true: a fact that did not change keeps its first time."""

    def __init__(self) -> None:
        self._facts: dict[str, tuple[Any, float]] = {}

    def of(self, name: str, value: Any, now: float) -> float:
        held = self._facts.get(name)
        if held is None or held[0] != value:
            self._facts[name] = (value, now)
            return now
        return held[1]


def process_state(
    identity: Mapping[str, Any],
    step: int | None,
    step_at: float | None,
    since: _Since,
) -> JobState:
    """This process's state now (read on the calling thread, never the training thread's):
    ``step_at`` is the Unix time ``step`` was last logged."""
    now, mono = time.time(), time.monotonic()
    phases = open_phases()
    ident = training_thread(phases)
    state: dict[str, Any] = dict(identity)
    state.update(step=step, step_at=step_at, published=now, every=PUBLISH_EVERY)
    stack = phases.get(ident or -1) or []
    if stack:
        path, began = stack[-1]
        state["phase"], state["phase_since"] = _text(path), now - (mono - began)
    frame = sys._current_frames().get(ident) if ident is not None else None
    try:
        frames = frames_of(frame)
        if frames:
            line = _text(_where(user_frame(frames)))
            state["at"], state["at_since"] = line, since.of("at", line, now)
        wait = recognise(frame, user_locals=False)  # every 5 s: the program's locals untouched
    except Exception:  # a frame torn down meanwhile: this publication goes without it
        wait = None
    finally:
        del frame
    if wait is not None and wait.kind != "code":
        words = _text(wait.words)
        host = _text(wait.host) if isinstance(wait, HttpWait) and wait.host else None
        op, group = (wait.op, wait.group) if isinstance(wait, CollectiveWait) else (None, None)
        began = since.of("wait", words, now)
        state["wait"] = PublishedWait(words, began, wait.kind, host, op, group)
    state["collectives"] = collective_counts()
    return JobState.of(state)


# ---- where the states go -----------------------------------------------------------------------


class Board(Protocol):
    """A place every process of the job reaches. ``put`` replaces this process's state; ``read``
    returns every state there and the ranks that should be there but are not."""

    #: How it is named in a message: "the torch.distributed store at 127.0.0.1:29500".
    where: str
    #: The job its states are of, as each state says it: a process compares only its own job's.
    job: str

    def put(self, state: JobState, payload: bytes) -> None: ...

    def read(self) -> tuple[list[JobState], list[str]]: ...

class DirectoryBoard:
    """One file per process in a directory the job shares (``<log_dir>/job``), its job the
    launch's (:func:`launch`); a file older than the reading process is another job's, and is
    not read."""

    def __init__(self, directory: Path, started: float | None = None) -> None:
        self.directory = Path(directory)
        self.where = f"the directory {self.directory}"
        self.job = launch(parent=True)
        self._started = time.time() if started is None else started

    def put(self, state: JobState, payload: bytes) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        write_whole(self.directory / f"{state.key().replace('/', '_')}.json", payload)

    def read(self) -> tuple[list[JobState], list[str]]:
        states: list[JobState] = []
        for path in sorted(self.directory.glob("*.json")):
            state = JobState.from_json(_state_file(path, self._started - 2 * SILENT_AFTER))
            if state is not None:
                states.append(state)
        return states, []


def _state_file(path: Path, not_before: float) -> bytes | None:
    """The bytes of a regular file modified since ``not_before``, as many as a state may have: a
    link (which may lead out of the directory), a pipe or a device (which may block or never end)
    is neither opened nor read, and the file is opened without blocking."""
    with contextlib.suppress(OSError):
        if S_ISREG(os.lstat(path).st_mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                found = os.fstat(fd)  # the file opened, should its name have changed hands
                if S_ISREG(found.st_mode) and found.st_mtime >= not_before \
                        and found.st_size <= MAX_STATE_BYTES:  # fmt: skip
                    return os.read(fd, MAX_STATE_BYTES + 1)
            finally:
                os.close(fd)
    return None


class TorchStoreBoard:
    """The job's ``torch.distributed`` store: one key per rank of the default group, under the
    launch and restart (:func:`launch`: what an earlier one left on the store is not read),
    written and read through clients of its own whose every call gives up after
    :data:`BOARD_TIMEOUT`."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.host, self.port, self.world_size = host, int(port), int(world_size)
        self.where = f"the torch.distributed store at {host}:{port}"
        scope = launch()
        self.job = f"{self.where}, {scope}" if scope else self.where
        self._prefix = f"{_KEY_PREFIX}{scope}/" if scope else _KEY_PREFIX
        self._store: Any = None

    @classmethod
    def of_this_job(cls) -> TorchStoreBoard | None:
        """The board of the process group this process joined, if its store is a TCP store."""
        dist = sys.modules.get("torch.distributed")
        try:
            if dist is None or not _in_a_process_group():
                return None
            store = dist.distributed_c10d._get_default_store()
            while hasattr(store, "underlying_store"):
                store = store.underlying_store
            host, port = getattr(store, "host", None), getattr(store, "port", None)
            if not isinstance(host, str) or not isinstance(port, int):
                return None
            return cls(host, port, dist.get_world_size())
        except Exception:
            return None

    def _connect(self) -> Any:
        # A plain connection first: a store that is down then costs a refused connect, where
        # c10d's client would retry for its whole timeout and log each try, with a C++ stack,
        # to the job's stderr.
        socket.create_connection((self.host, self.port), timeout=BOARD_TIMEOUT).close()
        import torch.distributed as dist

        return dist.TCPStore(  # type: ignore[attr-defined]
            self.host, self.port, is_master=False,
            timeout=timedelta(seconds=BOARD_TIMEOUT), wait_for_workers=False,
        )  # fmt: skip

    def put(self, state: JobState, payload: bytes) -> None:
        try:
            if self._store is None:
                self._store = self._connect()
            self._store.set(self._prefix + state.key(), payload)
        except Exception:
            self._store = None  # a new connection next time: the store may be back
            raise

    def read(self) -> tuple[list[JobState], list[str]]:
        store = self._connect()  # the read's own: one that never returns holds no publication
        states: list[JobState] = []
        missing: list[str] = []
        for rank in range(self.world_size):
            key = f"{self._prefix}rank-{rank}"
            if not store.check([key]):
                missing.append(f"rank {rank}")
                continue
            state = JobState.from_json(store.get(key))
            if state is not None:
                states.append(state)
        return states, missing


class RayBoard:
    """Ray's own key-value store, in the GCS every process of a Ray cluster reaches: one key per
    actor (and one for the driver) under the job's id, so that two worker groups whose process
    groups both have a rank 0 keep a key each.

    Only the driver and actors publish here: a task's worker outlives the task, and Ray could
    not say that the task behind a silent state had simply ended. The states of actors Ray
    reports dead are not read (and their keys are removed): a killed actor the driver waits on
    fails the driver's ``ray.get`` instead. Ray's internal client is used for its timeout (its
    public ``internal_kv`` functions take none) and its actor table for liveness, which needs no
    dashboard; both are Ray's developer APIs, and a Ray without them leaves the board out.
    """

    NAMESPACE = b"otel_rl_job"

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.where = f"Ray's key-value store (job {job_id})"
        self.job = f"Ray job {job_id}"
        self._prefix = f"{job_id}/".encode()

    @classmethod
    def of_this_job(cls) -> RayBoard | None:
        """The board of the Ray job this process is the driver or an actor of."""
        ray = sys.modules.get("ray")
        try:
            if ray is None or not ray.is_initialized():
                return None
            context = ray.get_runtime_context()
            if context.worker.mode != ray.SCRIPT_MODE and not context.get_actor_id():
                return None  # a task's worker
            return cls(str(context.get_job_id()))
        except Exception:
            return None

    @staticmethod
    def _gcs() -> Any:
        from ray._private.worker import global_worker

        return global_worker.gcs_client  # type: ignore[attr-defined]

    def put(self, state: JobState, payload: bytes) -> None:
        who = state.actor_id or f"driver-{state.pid}"
        self._gcs().internal_kv_put(self._prefix + str(who).encode(), payload, True,
                                    self.NAMESPACE, timeout=BOARD_TIMEOUT)  # fmt: skip

    def read(self) -> tuple[list[JobState], list[str]]:
        gcs = self._gcs()
        keys = gcs.internal_kv_keys(self._prefix, self.NAMESPACE, timeout=BOARD_TIMEOUT)
        if not keys:
            return [], []
        values = gcs.internal_kv_multi_get(keys, self.NAMESPACE, timeout=BOARD_TIMEOUT)
        dead = self._dead_actors()
        states: list[JobState] = []
        for key, payload in values.items():
            state = JobState.from_json(payload)
            if state is None:
                continue
            if state.actor_id in dead:
                with contextlib.suppress(Exception):
                    gcs.internal_kv_del(key, False, self.NAMESPACE, timeout=BOARD_TIMEOUT)
                continue
            states.append(state)
        return states, []

    def _dead_actors(self) -> set[str]:
        try:
            import ray
            from ray._private import state as ray_state

            dead = ray_state.actors(job_id=ray.JobID.from_hex(self.job_id),
                                    actor_state_name="DEAD")  # fmt: skip
            return set(dead)
        except Exception:  # liveness unknown: every state is read, a dead one as silent
            return set()


# ---- the thread that publishes -----------------------------------------------------------------


def _weakly(
    activity: Callable[[], tuple[int | None, float | None]],
) -> Callable[[], tuple[int | None, float | None]]:
    """``activity`` without keeping its object alive: the publisher lives as long as the process,
    a ``Logger`` or ``WorkerMetrics`` does not; once it is gone, no step is known."""
    if not hasattr(activity, "__self__"):
        return activity
    method = weakref.WeakMethod(activity)

    def call() -> tuple[int | None, float | None]:
        bound = method()
        return (None, None) if bound is None else bound()

    return call


class JobStates:
    """What the comparing process read: every state found, the ranks that never published, and
    what could not be read (each board's failure, in words)."""

    def __init__(self) -> None:
        self.states: list[JobState] = []
        self.missing: list[str] = []
        #: Each board that could not be read (its ``where``), and why, in words.
        self.unread: dict[str, str] = {}

    @property
    def unreadable(self) -> list[str]:
        return list(self.unread.values())

    def drop_found_ranks(self) -> None:
        """A rank that one board misses and another holds has published: it is not missing."""
        ranks = {s.world_rank for s in self.states}
        self.missing = [m for m in self.missing if int(m.split()[-1]) not in ranks]

    def updated_by(self, later: JobStates) -> JobStates:
        """These states with a later read's newer ones: a re-read that a slow board cut short
        (the job's store under load) takes nothing away from what an earlier read found."""
        merged = {s.where: s for s in self.states}
        for state in later.states:
            held = merged.get(state.where)
            if held is None or held.published < state.published:
                merged[state.where] = state
        out = JobStates()
        out.states = list(merged.values())
        out.missing = list(dict.fromkeys(self.missing + later.missing))
        out.drop_found_ranks()
        out.unread = {where: why for where, why in later.unread.items() if where in self.unread}
        return out


class StatePublisher:
    """This process's state, published to the job's boards on a daemon thread.

    A ``Logger`` holds it from its start to its ``finish()`` (:meth:`hold`, :meth:`release`): when
    the last one finishes, the state is published once more, saying when the process ended
    (``ended``), and the thread stops, whatever workers of the process used it too (the process is
    the ``Logger``'s). A worker (``WorkerMetrics``, a drop-in's timer) has no end: in a process
    with no ``Logger``, once one publishes, the thread runs for the life of the process.

    ``activity`` returns ``(last step, its Unix time)``. ``boards`` finds the boards each time
    (a process group may be set up after the logger); ``directory`` adds a shared
    directory board. ``role`` and ``rank`` name the process (default: its process-group rank),
    ``run_id`` and ``attempt`` its ``Logger``'s run.
    """

    def __init__(
        self, activity: Callable[[], tuple[int | None, float | None]], **given: Any
    ) -> None:
        self._since = _Since()
        self._boards: dict[str, Any] = {}
        self._failed: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()
        self._directory: DirectoryBoard | None = None
        #: Loggers that have not finished.
        self._holders = 0
        #: Unix time the last Logger finished (the thread's last publication says it).
        self._ended: float | None = None
        self.adopt(activity, **given)

    def adopt(
        self,
        activity: Callable[[], tuple[int | None, float | None]],
        *,
        role: str | None = None,
        rank: int | None = None,
        directory: Path | None = None,
        phase_after: float = 30.0,
        factor: float = 10.0,
        run_id: str | None = None,
        attempt: int | None = None,
    ) -> None:
        """Who the process is and what it publishes (given again by a ``Logger`` in a process whose
        worker published first: the process is the ``Logger``'s)."""
        with self._lock:
            self._activity, self._role, self._rank = _weakly(activity), role, rank
            self._of_run = {"run_id": run_id, "attempt": attempt}
            if directory is not None:
                self._directory = DirectoryBoard(directory)
            self._phase_after, self._factor = phase_after, factor

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="otel-rl-job-state", daemon=True)
        self._thread.start()

    def hold(self) -> None:
        """A ``Logger`` starts using the publisher (registry lock held)."""
        self._holders += 1

    def release(self, timeout: float) -> None:
        """A ``Logger`` finished. The last one: the thread publishes the state once more, with
        ``ended``, and stops; waited for up to ``timeout`` seconds (a board that does not answer
        keeps it, never the caller)."""
        with _PUBLISHERS_LOCK:
            self._holders -= 1
            if self._holders > 0:
                return
            if _PUBLISHERS.get(self._pid) is self:
                del _PUBLISHERS[self._pid]  # the process's next Logger starts a new one
            self._ended = time.time()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

    def boards(self) -> list[Any]:
        found: list[Any] = []
        for board in (RayBoard.of_this_job(), TorchStoreBoard.of_this_job()):
            if board is not None:
                found.append(self._boards.setdefault(board.where, board))
        if not found and self._directory is not None:  # where the job has nothing else
            found.append(self._boards.setdefault(self._directory.where, self._directory))
        return found

    def state(self, boards: list[Any] | None = None) -> JobState:
        """This process's state now, of the job of ``boards`` (the first's: a Ray actor in a
        process group is of its Ray job)."""
        boards = self.boards() if boards is None else boards
        with self._lock:
            step, step_at = self._activity()
            identity = {**_identity(self._role, self._rank), **self._of_run,
                        "job": boards[0].job if boards else None}  # fmt: skip
            state = process_state(identity, step, step_at, self._since)
            return state if self._ended is None else dataclasses.replace(state, ended=self._ended)

    def publish(self) -> None:
        """One publication, on the calling thread (the publisher's own, or a stall report's)."""
        if os.getpid() != self._pid:  # a forked child is a process of its own
            return
        boards = self.boards()
        if not boards:  # a process of its own: no job to tell
            return
        state = self.state(boards)
        payload = state.to_json()
        for board in boards:
            try:
                board.put(state, payload)
            except Exception as exc:
                self._say_once(board, "published to", exc)
            else:
                self._failed.discard(board.where)

    def publish_soon(self) -> None:
        """Publish now on the publisher's own thread, without waiting for it: a store that does
        not answer holds that thread, never the caller (the watchdog's, when a stall begins)."""
        self._wake.set()

    def _read_board(self, board: Any, timeout: float) -> tuple[list[JobState], list[str]]:
        """``board.read()`` on a thread of its own, given ``timeout`` seconds (a store that
        accepts connections and never answers holds c10d's client whatever its own timeout):
        the thread of one that does not return is left to it, holding nothing a publication
        needs."""
        done: list[Any] = []

        def call() -> None:
            try:
                done.append(board.read())
            except BaseException as exc:
                done.append(exc)

        reader = threading.Thread(target=call, name="otel-rl-job-read", daemon=True)
        reader.start()
        reader.join(timeout)
        if not done:
            raise TimeoutError(f"no answer within {timeout:.1f} s")
        if isinstance(done[0], BaseException):
            raise done[0]
        return cast(tuple[list[JobState], list[str]], done[0])

    def read(
        self, boards: Iterable[Any] | None = None, timeout: float = 2 * BOARD_TIMEOUT
    ) -> JobStates:
        """Every state of this job on its boards (this process's own made now), merged by
        process; a board that has not answered within ``timeout`` seconds is said unreadable.
        A state of another job, or of another attempt of this process's run, is left out; so is
        one that names no job (an older otel-rl's)."""
        found = JobStates()
        merged: dict[tuple[str | None, int | None], JobState] = {}
        deadline = time.monotonic() + timeout
        boards = self.boards() if boards is None else list(boards)
        job, run = (boards[0].job if boards else None), self._of_run
        for board in boards:
            try:
                states, missing = self._read_board(board, max(0.5, deadline - time.monotonic()))
            except Exception as exc:
                found.unread[board.where] = (f"{board.where} could not be read "
                                             f"({type(exc).__name__}: {_text(exc)})")  # fmt: skip
                continue
            found.missing += [m for m in missing if m not in found.missing]
            for state in states:
                earlier = run["run_id"] is not None and state.run_id == run["run_id"]
                if state.job != job or (earlier and state.attempt != run["attempt"]):
                    continue
                held = merged.get(state.where)
                if held is None or held.published < state.published:
                    merged[state.where] = state
        own = self.state(boards)
        merged[own.where] = own
        found.states = list(merged.values())
        found.drop_found_ranks()
        return found

    def read_fresh(self, since: float, wait: float) -> JobStates:
        """The states as :meth:`read`, read again until each process still publishing has
        published after ``since`` (Unix time: when the stall was seen), for at most ``wait``
        seconds in all: a state from before the stall would show a process where it was."""
        deadline = time.monotonic() + wait
        found: JobStates | None = None
        while True:
            read = self.read(timeout=max(0.5, deadline - time.monotonic()))
            found = read if found is None else found.updated_by(read)
            now = time.time()
            stale = [s for s in found.states if s.ended is None and s.published < since
                     and now - s.published <= SILENT_AFTER]  # fmt: skip
            if not stale or time.monotonic() + 0.5 > deadline:
                return found
            time.sleep(0.5)

    def _say_once(self, board: Any, verb: str, exc: BaseException) -> None:
        if board.where in self._failed:
            return
        self._failed.add(board.where)
        _log.warning(
            "otel-rl: this process's state cannot be %s %s (%s: %s); the job's stall verdict "
            "will miss it until it can (tried again every %g s)",
            verb, board.where, type(exc).__name__, _text(exc), PUBLISH_EVERY,
        )  # fmt: skip

    def _next_deadline(self) -> float | None:
        """Seconds until an open phase of this process passes its stall deadline, if sooner
        than the next publication."""
        _, step_at = self._activity()
        last = None if step_at is None else time.monotonic() - (time.time() - step_at)
        watched = open_phases_with_deadlines(
            self._phase_after, self._factor, open_phases(), phase_history, last
        )
        now = time.monotonic()
        due = [p.due - now for p in watched if p.due > now]
        return min(due) if due else None

    def _run(self) -> None:
        # Not at once: the process is still starting this thread, and would be told waiting
        # for it.
        self._wake.wait(FIRST_AFTER)
        self._wake.clear()
        while True:  # until the last Logger finished (a worker's: the life of the process)
            ended = self._ended is not None
            try:
                self.publish()
            except Exception as exc:  # the publisher must outlive any bug of its own
                _log.warning("otel-rl: job state: %s: %s", type(exc).__name__, exc)
            if ended:
                return
            wait = PUBLISH_EVERY
            with contextlib.suppress(Exception):
                due = self._next_deadline()
                if due is not None:
                    wait = min(wait, due + 0.05)  # just past it: the phase is then overdue
            self._wake.wait(wait)
            self._wake.clear()


# ---- one publisher per process -----------------------------------------------------------------

_PUBLISHERS: dict[int, StatePublisher] = {}
_PUBLISHERS_LOCK = threading.Lock()


def shared_directory(log_dir: Path | None) -> Path | None:
    """The directory board of a job launched as several processes (``WORLD_SIZE`` above 1, as
    torchrun and accelerate set it) that share ``log_dir``; ``None`` for a single process."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    return None if log_dir is None or world <= 1 else Path(log_dir) / "job"


def publisher_of_this_process(
    activity: Callable[[], tuple[int | None, float | None]],
    *,
    driver: bool = False,
    **options: Any,
) -> StatePublisher:
    """The process's one publisher (``options``: :class:`StatePublisher`'s), started on first
    use. A ``driver`` (a ``Logger``; the latest one) names the process and gives its steps, even
    when a worker of the same process came first, and holds it until it releases it at its
    ``finish()``; a later worker leaves it as it is."""
    pid = os.getpid()
    with _PUBLISHERS_LOCK:
        publisher = _PUBLISHERS.get(pid)
        if publisher is None:
            publisher = StatePublisher(activity, **options)
            _PUBLISHERS.clear()  # a parent's, inherited through fork, is not this process's
            _PUBLISHERS[pid] = publisher
            publisher.start()
        elif driver:  # the latest Logger of the process
            publisher.adopt(activity, **options)
        if driver:
            publisher.hold()
        return publisher


_FROM_A_WORKER_IN: int | None = None


def _a_job_s_worker() -> bool:
    """This process is a Ray actor or a rank of a process group."""
    if _in_a_process_group():
        return True
    ray = sys.modules.get("ray")
    try:
        return bool(ray is not None and ray.is_initialized()
                    and ray.get_runtime_context().get_actor_id())  # fmt: skip
    except Exception:
        return False


def _no_step() -> tuple[int | None, float | None]:
    return None, None


def _forked() -> None:
    # A child forked from a job's worker (a data loader's worker, say) inherits its process
    # group or Ray connection, and would publish as that worker's rank: its timers do not
    # publish, and a Logger or WorkerMetrics it makes is not that rank. (No Ray call here:
    # Ray's client is not safe to use in a forked child.)
    global _FROM_A_WORKER_IN, _GROUP_INHERITED
    _GROUP_INHERITED = _in_a_process_group()
    if _GROUP_INHERITED or os.getppid() == _FROM_A_WORKER_IN:
        _FROM_A_WORKER_IN = os.getpid()


os.register_at_fork(after_in_child=_forked)


def publish_from_a_worker() -> None:
    """A framework's own timer (the NeMo RL and verl drop-ins') began in this process: in one of
    a job's workers (a Ray actor, a rank of a process group) that has no ``WorkerMetrics``, the
    process then publishes its state as a worker's (no step is known). Once per process: after
    that, a call costs one comparison."""
    global _FROM_A_WORKER_IN
    pid = os.getpid()
    if pid == _FROM_A_WORKER_IN or not _a_job_s_worker():
        return
    _FROM_A_WORKER_IN = pid
    publisher_of_this_process(_no_step)
