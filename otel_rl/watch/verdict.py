"""The verdict of a stall: one sentence naming what the training process waits for, and what
that waits for in turn, down to what is stuck.

Built on the stall watchdog's thread when a report is made, from what the run has at that
moment: the live Python frames of this process (a wait is recognised in ``ray.get``/``ray.wait``,
an HTTP client, a ``torch.distributed`` collective, a queue, lock, condition or event, a
subprocess; a lock by its object, with the thread that holds it: :mod:`otel_rl.watch.locks`),
Ray's state API (the task behind the object ref waited on, its actor and node, the
tasks running on that actor), the actors' ``py-spy`` stacks and the workers' open-timer reports
already in the :class:`~otel_rl.watch.stalls.StallReport`, the rollout monitor's per-engine
counts and the GPU bridge's last readings. Each link of the chain says where its facts came from
and how old they are; a link that cannot be known is left out, and the reason goes to
``missing``: nothing is guessed.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import queue
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from otel_rl.watch import locks
from otel_rl.watch.locks import where as _where
from otel_rl.watch.stalls import chain_lines, p95, ray_state_address, seconds

__all__ = ["Link", "Verdict", "build_verdict", "chain_lines", "training_thread"]

#: ``torch.distributed`` functions that are collectives (or point-to-point waits) of a group.
COLLECTIVES = frozenset({
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "gather_object", "scatter",
    "scatter_object_list", "send", "recv", "batch_isend_irecv", "all_reduce_coalesced",
    "new_group", "init_process_group",
})  # fmt: skip

#: Module paths of the HTTP clients whose frames name the server waited on.
_HTTP_MODULES = ("/http/client.py", "/urllib/request.py", "/urllib3/", "/requests/", "/httpx/",
                 "/httpcore/", "/aiohttp/")  # fmt: skip


@dataclass
class Link:
    """One link of the chain: ``process`` is inside ``phase`` and waits on ``waits_on``
    (either may be unknown), for ``seconds``; ``evidence`` says where that came from."""

    process: str
    phase: str | None
    waits_on: str | None
    seconds: float | None
    evidence: str
    #: The link's words in the sentence.
    text: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "process": self.process,
            "phase": self.phase,
            "waits_on": self.waits_on,
            "seconds": None if self.seconds is None else round(self.seconds, 3),
            "evidence": self.evidence,
        }


@dataclass
class Verdict:
    """The chain from the training process down to what is stuck, and the sentence saying it."""

    chain: list[Link] = field(default_factory=list)
    #: Links that could not be known, each with its reason.
    missing: list[str] = field(default_factory=list)
    #: The job's verdict (:class:`otel_rl.watch.job_verdict.JobVerdict`): the processes that are
    #: not where the rest are, named first.
    job: Any = None

    @property
    def text(self) -> str:
        sentence = " → ".join(link.text for link in self.chain)
        if self.job is not None and self.job.sentence:
            sentence = f"{self.job.sentence}. {sentence[:1].upper()}{sentence[1:]}"
        if self.missing:
            sentence += "; not known: " + "; ".join(self.missing)
        return sentence

    def to_json(self) -> dict[str, Any]:
        out = {
            "text": self.text,
            "chain": [link.to_json() for link in self.chain],
            "missing": list(self.missing),
        }
        if self.job is not None:
            out["job"] = self.job.to_json()
        return out


# ---- what the training thread is waiting on ----------------------------------------------------


@dataclass
class _Wait:
    """A wait recognised in a thread's frames."""

    kind: str  # ray | http | collective | sync | lock | subprocess | code
    words: str  # "ray.get of 1 object ref", "HTTP GET http://h:1/x", ...
    evidence: str
    refs: list[Any] = field(default_factory=list)  # ray: the ObjectRefs
    host: str | None = None  # http: "host:port"
    url: str | None = None
    lock: locks.Taken | None = None  # lock: the lock being taken
    group: str | None = None  # collective: the process group's name (``default``, its desc)
    op: str | None = None  # collective: the torch.distributed function (``all_reduce``)
    #: What could not be known of it, for the verdict's ``missing``.
    unknown: str | None = None


def training_thread(phases: Mapping[int, Sequence[tuple[str, float]]]) -> int | None:
    """The thread that trains: the main thread when a timer is open on it, else the thread
    whose outermost open timer is the oldest, else the main thread."""
    main = threading.main_thread().ident
    if phases.get(main or -1):
        return main
    timed = [(stack[0][1], ident) for ident, stack in phases.items() if stack]
    return min(timed)[1] if timed else main


def _frames(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def _in(frame: FrameType, *parts: str) -> bool:
    name = frame.f_code.co_filename.replace("\\", "/")
    return any(part in name for part in parts)


def _locals(frame: FrameType) -> Mapping[str, Any]:
    try:
        return frame.f_locals
    except Exception:  # a frame torn down meanwhile
        return {}


def recognise(frame: FrameType | None, user_locals: bool = True) -> _Wait | None:
    """What the thread whose innermost frame is ``frame`` waits on, from its frames' code and
    locals; ``None`` for an empty stack. Without ``user_locals`` only the locals of the libraries'
    own frames are read (which end with the wait), never those of the program's frames: reading
    a frame's locals from another thread leaves a copy of them on the frame, holding what the
    program has since let go (a batch, a tensor) until it reads them again. Locks are then not
    recognised."""
    frames = _frames(frame)
    if not frames:
        return None
    for find in (_ray_wait, _collective_wait, _http_wait, _subprocess_wait, _loop_wait):
        found = find(frames)
        if found is not None:
            return found
    found = _sync_wait(frames, user_locals)
    if found is not None:
        return found
    code = _user_frame(frames)
    line = linecache.getline(code.f_code.co_filename, code.f_lineno).split("  #")[0].strip()
    words = f"{_where(code)}" + (f": {line}" if line else "")
    wait = _Wait("code", words, "its Python stack (no known wait recognised in it)")
    try:
        unread = locks.unread(frames[0]) if user_locals else None
    except Exception:  # reading the frame's source and bytecode
        unread = None
    if unread is not None:
        wait.unknown = f"whether {unread} is a lock (the verdict does not run the program's code " \
                       "to read it)"  # fmt: skip
    return wait


def _user_frame(frames: list[FrameType]) -> FrameType:
    """The innermost frame outside the standard library and site-packages (else the innermost)."""
    libraries = tuple({os.path.join(p, "lib") for p in (sys.prefix, sys.base_prefix)})
    for frame in frames:
        name = frame.f_code.co_filename
        if "-packages" not in name and not name.startswith(libraries):
            return frame
    return frames[0]


def _ray_wait(frames: list[FrameType]) -> _Wait | None:
    for frame in frames:
        if not _in(frame, "/ray/") or frame.f_code.co_name not in ("get", "wait"):
            continue
        refs = _object_refs(_locals(frame))
        if refs:
            call = f"ray.{frame.f_code.co_name}"
            return _Wait("ray", call, f"its stack, frame {_where(frame)}", refs=refs)
    return None


def _object_refs(variables: Mapping[str, Any]) -> list[Any]:
    try:
        from ray import ObjectRef
    except ImportError:
        return []
    for name in ("object_refs", "ray_waitables", "object_ref", "refs"):
        value = variables.get(name)
        if isinstance(value, ObjectRef):
            return [value]
        if isinstance(value, (list, tuple)):
            found = [v for v in value if isinstance(v, ObjectRef)]
            if found:
                return found
    return []


def _collective_wait(frames: list[FrameType]) -> _Wait | None:
    for frame in frames:
        if not _in(frame, "torch/distributed/distributed_c10d.py"):
            continue
        op = frame.f_code.co_name
        if op not in COLLECTIVES:
            continue
        variables = _locals(frame)
        group = variables.get("group", variables.get("pg"))
        details = _group_details(group)
        tensor = variables.get("tensor", variables.get("tensors"))
        if hasattr(tensor, "shape") and hasattr(tensor, "dtype"):
            details.insert(0, f"{str(tensor.dtype).replace('torch.', '')} {list(tensor.shape)}")
        words = f"torch.distributed.{op}" + (f" ({', '.join(details)})" if details else "")
        wait = _Wait("collective", words, f"its stack, frame {_where(frame)}")
        wait.group, wait.op = group_name(group), op
        return wait
    return None


def group_name(group: Any) -> str:
    """A process group's name, the same on every rank: ``default`` for the default group
    (``None``), else its description or its name in ``torch.distributed``'s registry."""
    dist = sys.modules.get("torch.distributed")
    if group is None or dist is None:
        return "default"
    c10d = dist.distributed_c10d
    with contextlib.suppress(Exception):
        if group is c10d._get_default_group():
            return "default"
    desc = getattr(group, "group_desc", "")
    if isinstance(desc, str) and desc and desc != "undefined":
        return desc
    with contextlib.suppress(Exception):
        return str(c10d._world.pg_names[group])
    return "a group"


def _group_details(group: Any) -> list[str]:
    """The process group's backend and size, when torch can say."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return []
    details = []
    with contextlib.suppress(Exception):
        details.append(str(dist.get_backend(group)))
    with contextlib.suppress(Exception):
        details.append(f"{dist.get_world_size(group)} ranks")
    return details


def _http_wait(frames: list[FrameType]) -> _Wait | None:
    http = [f for f in frames if _in(f, *_HTTP_MODULES)]
    if not http:
        return None
    host = url = method = None
    client = None
    for frame in http:  # innermost first: the connection's host, then the caller's URL
        variables = _locals(frame)
        this = variables.get("self")
        if host is None and this is not None:
            h, p = getattr(this, "host", None), getattr(this, "port", None)
            if isinstance(h, str) and isinstance(p, int):
                # urllib hands http.client the URL's netloc, credentials and all
                host = f"{h.rpartition('@')[2]}:{p}"
                client = _client(frame)
        for name in ("url", "fullurl", "str_or_url"):
            value = variables.get(name)
            if isinstance(value, str) and "://" in value:
                url = value
            elif value is not None and hasattr(value, "scheme") and hasattr(value, "host"):
                url = str(value)
        for name in ("req", "request"):
            value = variables.get(name)
            full = getattr(value, "full_url", None) or getattr(value, "url", None)
            if isinstance(full, str) and "://" in full:
                url = full
            elif full is not None and hasattr(full, "host") and hasattr(full, "scheme"):
                url = str(full)
            verb = getattr(value, "method", None)
            if isinstance(verb, str) and verb:
                method = verb
            elif callable(getattr(value, "get_method", None)):
                with contextlib.suppress(Exception):
                    method = str(getattr(value, "get_method")())  # noqa: B009
        verb = variables.get("method")
        if isinstance(verb, str) and verb.isupper():
            method = verb
    if host is None and url is not None:
        parts = urlsplit(url)
        if parts.hostname:
            port = parts.port or (443 if parts.scheme == "https" else 80)
            host = f"{parts.hostname}:{port}"
    client = client or _client(http[0])
    if host is None:
        return _Wait("http", f"an HTTP request ({client})", f"its stack, frames of {client}")
    url = None if url is None else _without_credentials(url)
    target = url or f"http://{host}"
    words = f"HTTP {method + ' ' if method else ''}{target}"
    if url is not None and host not in url:
        words += f" (connection to {host})"
    evidence = f"its stack, frame {_where(http[0])} of {client}: no response yet"
    return _Wait("http", words, evidence, host=host, url=url)


def _without_credentials(url: str) -> str:
    """``url`` without its user and password: a verdict is written to files, logs and trackers."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def _client(frame: FrameType) -> str:
    name = frame.f_code.co_filename.replace("\\", "/")
    for client in ("requests", "urllib3", "httpx", "httpcore", "aiohttp"):
        if f"/{client}/" in name:
            return client
    return "urllib" if "/urllib/" in name else "http.client"


def _loop_wait(frames: list[FrameType]) -> _Wait | None:
    """A thread running an asyncio loop: what its tasks await (a suspended coroutine is on no
    thread's stack; its frames are followed through ``cr_await``)."""
    loop = next((_locals(f).get("self") for f in frames
                 if _in(f, "/asyncio/base_events.py")
                 and f.f_code.co_name in ("run_until_complete", "run_forever")), None)  # fmt: skip
    if loop is None:
        return None
    import asyncio

    try:
        tasks = list(asyncio.all_tasks(loop))
    except Exception:  # the loop closed meanwhile
        return None
    pending = [(task, _awaited_frames(task.get_coro())) for task in tasks if not task.done()]
    for task, chain in pending:
        for find in (_ray_wait, _http_wait, _subprocess_wait):
            found = find(chain) if chain else None
            if found is not None:
                found.words += f" (asyncio task {task.get_name()!r})"
                return found
    for task, chain in pending:  # none of those: what the first task awaits, and where
        user = next((frame for frame in chain if not _in(frame, "/asyncio/")), None)
        if user is None:
            continue
        line = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
        code = chain[0].f_code  # co_qualname: Python 3.11 and later
        awaited = getattr(code, "co_qualname", code.co_name) if chain[0] is not user else None
        words = f"asyncio task {task.get_name()!r} at {_where(user)}"
        words += f": {line}" if line else ""
        if awaited is not None:
            words = f"{awaited} in {words}"
        return _Wait("sync", words, "its asyncio tasks' suspended coroutines (cr_await)")
    return None


def _awaited_frames(coro: Any) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, innermost first."""
    frames: list[FrameType] = []
    while coro is not None and len(frames) < 200:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        frames.append(frame)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return frames[::-1]


def _subprocess_wait(frames: list[FrameType]) -> _Wait | None:
    for frame in reversed(frames):  # outermost first: the Popen call the code made
        if _in(frame, "/subprocess.py") and frame.f_code.co_name in (
            "wait", "communicate", "run", "call", "check_call", "check_output",
        ):  # fmt: skip
            variables = _locals(frame)
            popen = variables.get("self", variables.get("process"))
            args = getattr(popen, "args", None) or variables.get("popenargs")
            pid = getattr(popen, "pid", None)
            shown = shlex.join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            shown = " ".join(shown.split())
            shown = shown if len(shown) <= 120 else shown[:119] + "…"
            words = f"subprocess {shown}" + (f" (pid {pid})" if pid else "")
            return _Wait("subprocess", words, f"its stack, frame {_where(frame)}")
    return None


_SYNC_MODULES = ("/queue.py", "/threading.py", "/concurrent/futures/", "/multiprocessing/")


def _sync_wait(frames: list[FrameType], user_locals: bool = True) -> _Wait | None:
    outer: _Wait | None = None
    for frame in frames:  # the outermost recognised wait names what the code called
        name = frame.f_code.co_name
        library = _in(frame, *_SYNC_MODULES)
        if not (library or user_locals):
            continue
        this = _locals(frame).get("self") if library else None
        kind = type(this).__name__
        if _in(frame, "/queue.py") and name in ("get", "put", "join"):
            # the standard library's own qsize only: a subclass's may do anything, even block
            stdlib = getattr(type(this), "qsize", None) in _STDLIB_QSIZE
            size = _call(this, "qsize") if stdlib else None
            words = f"{kind}.{name}" + (f" ({size} items queued)" if size is not None else "")
        elif _in(frame, "/threading.py") and name == "join" and isinstance(this, threading.Thread):
            words = f"Thread.join of thread {this.name!r}"
        elif _in(frame, "/threading.py") and name in ("wait", "wait_for") and kind in (
            "Event", "Condition", "Barrier", "Semaphore",
        ):  # fmt: skip
            words = f"{kind}.{name}"
        elif _in(frame, "/concurrent/futures/") and name in ("result", "exception", "wait"):
            words = f"concurrent.futures {'Future.' if kind == 'Future' else ''}{name}"
        elif _in(frame, "/multiprocessing/") and name in ("get", "recv", "join", "wait", "poll"):
            words = f"multiprocessing {kind}.{name}"
        elif (taken := _taken(frame, innermost=frame is frames[0])) is not None:
            outer = _lock_wait(frame, taken)
            continue
        else:
            continue
        outer = _Wait("sync", words, f"its stack, frame {_where(frame)}")
    return outer


def _taken(frame: FrameType, innermost: bool) -> locks.Taken | None:
    try:
        return locks.taken_in(frame, innermost)
    except Exception:  # reading a frame's source and bytecode: the wait is then named by its line
        return None


def _lock_wait(frame: FrameType, taken: locks.Taken) -> _Wait:
    """A wait to take a lock, named where the program takes it."""
    line = locks.source_line(taken.frame)
    words = f"{taken.noun} at {_where(taken.frame)}" + (f": {line}" if line else "")
    what = f"{taken.expression} is a {taken.kind}" if taken.expression else f"a {taken.kind}"
    return _Wait("lock", words, f"its stack, frame {_where(frame)}: {what}", lock=taken)


_STDLIB_QSIZE = (queue.Queue.qsize, queue.SimpleQueue.qsize)


def _call(obj: Any, method: str) -> Any:
    try:
        return getattr(obj, method)()
    except Exception:
        return None


# ---- the links beyond this process -------------------------------------------------------------


def _ray_links(
    wait: _Wait, report: Any, verdict: Verdict, deadline: float
) -> tuple[str | None, str | None]:
    """The task behind the first object ref waited on, and what its worker is doing; the words
    of the wait, and the IP of the node the task runs on (``None``: not known)."""
    ref, more = wait.refs[0], ""
    if len(wait.refs) > 1:  # a worker group's gather: follow the first call not yet returned
        more = f" (1 of {len(wait.refs)} refs)"
        with contextlib.suppress(Exception):
            import ray

            done, rest = ray.wait(list(wait.refs), num_returns=len(wait.refs), timeout=0)
            ref = rest[0] if rest else ref
            more = f" ({len(done)} of {len(wait.refs)} returned)"
    try:
        task_id = ref.task_id().hex()
    except Exception as exc:
        verdict.missing.append(f"the task behind the object ref ({type(exc).__name__}: {exc})")
        return None, None
    try:
        from ray.util.state import get_task

        left = max(1, int(deadline - time.monotonic()))
        task: Any = get_task(task_id, address=ray_state_address(), timeout=left)
    except Exception as exc:
        said = str(exc).strip().split(". ")[0]  # Ray's messages run on with install advice
        if "dashboard" in str(exc).lower():
            said += "; it needs the dashboard"
        verdict.missing.append(f"task {task_id[:8]}… behind the object ref: Ray's state API did "
                               f"not answer ({type(exc).__name__}: {said})")  # fmt: skip
        return None, None
    if isinstance(task, list):  # one entry per attempt: the latest
        task = task[-1] if task else None
    if task is None:
        verdict.missing.append(f"task {task_id[:8]}…: Ray's state API does not know it (yet)")
        return None, None
    info = task if isinstance(task, Mapping) else vars(task)
    name = str(info.get("name") or info.get("func_or_class_name") or "a task")
    actor_id, node_id = info.get("actor_id"), info.get("node_id")
    node_ip = _node_ip(node_id)
    place = []
    if actor_id:
        place.append(f"actor {actor_id[:8]}…")
    if node_id:
        place.append(f"node {node_ip or node_id[:8] + '…'}")
    words = f"{wait.words} of {name}{more}" + (f" ({', '.join(place)})" if place else "")
    state = str(info.get("state") or "")
    started = info.get("start_time_ms")
    age = time.time() - started / 1000 if started and state == "RUNNING" else None
    who = "that actor" if actor_id else "that task"
    process = f"actor {name.split('.')[0]} {actor_id[:8]}…" if actor_id else f"task {name}"
    evidence = (f"Ray's state API at report time: task {task_id[:8]}… {state or 'state unknown'}"
                + (f", on worker pid {info.get('worker_pid')}" if info.get("worker_pid") else ""))
    if state in ("FINISHED", "FAILED"):
        text = ("that call has finished: its result is on the way (Ray: FINISHED)"
                if state == "FINISHED" else
                f"that call failed (Ray: FAILED, {info.get('error_type') or 'no error type'})")
        verdict.chain.append(Link(process, None, state, None, evidence, text=text))
        return words, node_ip
    if state != "RUNNING":
        busy = _running_on_actor(actor_id, deadline) if actor_id else []
        text = f"that call has not started (Ray: {state or 'no state'})"
        if busy:
            text += f"; {who} runs {', '.join(busy)}"
            evidence += "; the tasks running on the actor from Ray's state API"
        verdict.chain.append(Link(process, None, state or None, None, evidence, text=text))
        return words, node_ip
    method = name.rsplit(".", 1)[-1]
    function, stack_evidence = _actor_function(report, actor_id, info, method, node_ip, deadline)
    if function is None:
        verdict.missing.append(f"where in {method} {who} is: {stack_evidence}")
    timers, reported_ago, timer_evidence = _worker_timers(report, info.get("worker_pid"))
    phase = function or (timers[-1][0] if timers else None)
    if phase is None:
        text = f"{who} runs {method}" + (f" for {seconds(age)}" if age is not None else "")
    else:
        text = f"{who} is inside {phase}" + (f" for {seconds(age)}" if age is not None else "")
    if timers:
        inside = " > ".join(n for n, _ in timers)
        text += f" (its open timers: {inside}, open {seconds(timers[-1][1])} when it reported"
        text += f" {seconds(reported_ago)} ago)" if reported_ago is not None else ")"
        evidence += f"; {timer_evidence}"
    if stack_evidence:
        evidence += f"; {stack_evidence}"
    verdict.chain.append(Link(process, phase, method, age, evidence, text=text))
    return words, node_ip


def _node_ip(node_id: Any) -> str | None:
    if not node_id:
        return None
    try:
        import ray

        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node.get("NodeID") == node_id:
                return str(node.get("NodeManagerAddress") or "") or None
    except Exception:
        return None
    return None


def _running_on_actor(actor_id: str, deadline: float) -> list[str]:
    try:
        from ray.util.state import list_tasks

        tasks = list_tasks(
            address=ray_state_address(),
            filters=[("actor_id", "=", actor_id), ("state", "=", "RUNNING")],
            timeout=max(1, int(deadline - time.monotonic())), raise_on_missing_output=False,
        )  # fmt: skip
    except Exception:
        return []
    names = []
    for task in tasks:
        info = task if isinstance(task, Mapping) else vars(task)
        names.append(str(info.get("name")))
    return names


def _actor_function(
    report: Any,
    actor_id: Any,
    task: Mapping[str, Any],
    method: str,
    node_ip: str | None,
    deadline: float,
) -> tuple[str | None, str]:
    """The innermost function of the thread running ``method`` in the task's worker, from the
    report's py-spy stacks (or a dump of a plain task's worker on this node)."""
    stack: str | None = None
    source = ""
    actors = report.ray.get("actors") if isinstance(report.ray, Mapping) else None
    for entry in actors or []:
        if actor_id and entry.get("actor_id") == actor_id:
            stack = entry.get("stack")
            source = f"py-spy dump of pid {entry.get('pid')} at report time"
            if entry.get("via"):
                source += f" by {entry['via']}"
            if stack is None:
                return None, f"no stack of the actor: {entry.get('reason')}"
    if stack is None:
        pid = task.get("worker_pid")
        if not pid:
            why = report.ray.get("reason") if isinstance(report.ray, Mapping) else None
            return None, f"no stack of the task's worker ({why or 'its pid is not known'})"
        from otel_rl.watch.stalls import _local_addresses, py_spy_dump

        if node_ip is None or node_ip not in _local_addresses():
            return None, f"the task's worker is on another node ({node_ip}): run py-spy there"

        stack, why_not = py_spy_dump(int(pid), max(0.5, deadline - time.monotonic()))
        if stack is None:
            return None, f"no stack of the task's worker: {why_not}"
        source = f"py-spy dump of pid {pid} at report time"
    found = innermost_of(stack, str(task.get("name") or method)) or innermost_of(stack, method)
    if found is None:
        return None, f"{source}: no thread of it runs {method}"
    return found, source


def innermost_of(stack: str, function: str) -> str | None:
    """In a ``py-spy dump``, the innermost frame (``name (file:line)``) of the thread whose
    stack holds ``function``."""
    for block in re.split(r"^Thread ", stack, flags=re.MULTILINE)[1:]:
        frames = [m.groups() for m in re.finditer(r"^\s+(\S+) \((.+?)\)\s*$", block, re.M)]
        # py-spy names a frame by its qualified name: ``Rollout.generate.<locals>.wait``.
        if any(name == function or name.endswith("." + function) for name, _ in frames):
            name, where = frames[0]
            return f"{name.rsplit('<locals>.', 1)[-1]} ({os.path.basename(where)})"
    return None


def _worker_timers(
    report: Any, pid: Any
) -> tuple[list[tuple[str, float]], float | None, str]:
    """The open timers the worker process ``pid`` last reported (seconds open then), how long
    ago it reported, and the evidence."""
    if not pid or not isinstance(report.workers, Mapping):
        return [], None, ""
    for name, info in report.workers.items():
        if f"(pid {pid} " not in str(name) or not isinstance(info, Mapping):
            continue
        stacks = [s for s in (info.get("timers") or {}).values() if s]
        if not stacks:
            return [], None, ""
        at = info.get("at")
        ago = max(0.0, time.time() - at) if isinstance(at, (int, float)) else None
        old = f", {seconds(ago)} old" if ago is not None else ""
        timers = [(str(n), float(s)) for n, s in stacks[0]]
        return timers, ago, f"the open-timer report of {name} to the aggregator{old}"
    return [], None, ""


def _engine_links(host: str | None, engines: Sequence[Mapping[str, Any]], verdict: Verdict) -> None:
    """The engines on ``host`` (``ip`` or ``ip:port``) with their in-flight and finished
    requests, as one link."""
    if host is None:
        return
    ip, _, port = host.partition(":")
    mine = [
        e for e in engines
        if urlsplit(e["url"]).hostname == ip and (not port or str(urlsplit(e["url"]).port) == port)
    ]  # fmt: skip
    if not mine:
        return
    parts, ages = [], []
    for engine in mine[:4]:
        label = engine["url"]
        if engine.get("label"):  # as the monitor names it: vLLM's engine label, or Ray's
            shown = engine["label"]
            label += f" {shown}" if "=" in shown else f" engine={shown}"
        said = []
        if engine.get("running") is not None:
            said.append(f"{engine['running']:.0f} running")
        if engine.get("finished") is not None:
            said.append(f"{engine['finished']:.0f} finished in {seconds(engine['window_seconds'])}")
        parts.append(f"engine {label}: {', '.join(said) or 'no request counts'}")
        ages.append(engine["seconds_ago"])
    if len(mine) > 4:
        parts.append(f"{len(mine) - 4} more engines")
    evidence = f"the rollout monitor's latest scrape, {seconds(max(ages))} old"
    running = sum(e.get("running") or 0 for e in mine)
    verdict.chain.append(Link(f"engines on {host}", None, f"{running:.0f} requests running", None,
                              evidence, text="; ".join(parts)))  # fmt: skip


def _gpu_link(ip: str | None, gpus: Any, verdict: Verdict) -> None:
    """The GPU bridge's last reading of the node at ``ip``, appended to the last link."""
    if ip is None or not isinstance(gpus, Mapping) or not gpus.get("available"):
        return
    for reading in (gpus.get("nodes") or {}).values():
        if reading.get("host") != ip:
            continue
        shown = [f"{label} at {g.get('util_percent', float('nan')):.0f} %"
                 for label, g in (reading.get("gpus") or {}).items()]  # fmt: skip
        if not shown:
            return
        link = verdict.chain[-1]
        more = f" (+{len(shown) - 8})" if len(shown) > 8 else ""
        link.text += f"; GPUs on {ip}: " + ", ".join(shown[:8]) + more
        age = seconds(reading.get("seconds_ago", 0))
        link.evidence += f"; the GPU bridge's reading, {age} old"
        return


# ---- who holds the lock waited on --------------------------------------------------------------

#: The most holders followed from lock to lock.
_HOLDERS = 4


def _holder_links(
    wait: _Wait,
    training: int | None,
    verdict: Verdict,
    phases: Mapping[int, Sequence[tuple[str, float]]],
    now: float,
) -> None:
    """The thread holding the lock ``wait`` is on and what it waits on in turn; when that is a
    lock again, its holder, until a thread waits on something else, or on a lock held by a
    thread already in the chain: a deadlock."""
    frames = sys._current_frames()
    names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
    chain = [training]
    try:
        while wait.lock is not None and len(chain) <= _HOLDERS:
            that = "it" if len(chain) == 1 else "that one"
            try:
                found, why = locks.holders(wait.lock.lock, frames)
            except Exception as exc:  # the threads' stacks and sources: the rest stands
                found, why = [], f"reading the threads' stacks failed ({type(exc).__name__}: {exc})"
            if not found:
                verdict.missing.append(f"which thread holds {that}: {why}")
                return
            if len(found) > 1:  # a semaphore's
                who = ", ".join(_thread_words(h, training, names) for h in found)
                places = "; ".join(h.how for h in found)
                evidence = "; ".join(_holder_evidence(h, wait.lock) for h in found)
                verdict.chain.append(Link(who, None, None, None, evidence,
                                          text=f"{who} hold {that} ({places})"))  # fmt: skip
                return
            holder = found[0]
            who = _thread_words(holder, training, names)
            evidence = _holder_evidence(holder, wait.lock)
            frame = None if holder.ended else frames.get(holder.ident)
            ending = None
            if holder.ident in chain and not holder.ended:
                ending = "it waits on itself, a deadlock" if holder.ident == chain[-1] else \
                    "a deadlock"  # fmt: skip
            elif frame is None:
                ending = "it is never released"
            if ending is not None:
                text = f"{who} holds {that} ({holder.how}): {ending}"
                verdict.chain.append(Link(who, None, None, None, evidence, text=text))
                return
            inner = recognise(frame)
            if inner is None:
                return
            stack = phases.get(holder.ident) or []
            path, age, place = None, None, ""
            if stack:
                path, began = stack[-1]
                age = now - began
                place = f" in {' > '.join(path.split('/'))} ({seconds(age)})"
                evidence += f"; open timer {path!r} since {seconds(age)} ago"
            verb = "is" if inner.kind == "code" else "waits"
            text = (f"{who} holds {that} ({holder.how}) and {verb}{place} "
                    f"{'at' if verb == 'is' else 'on'} {inner.words}")  # fmt: skip
            verdict.chain.append(Link(who, path, inner.words, age,
                                      f"{evidence}; {inner.evidence}", text=text))  # fmt: skip
            chain.append(holder.ident)
            wait = inner
    finally:
        del frames  # each frame holds every local of its stack


def _thread_words(holder: locks.Holder, training: int | None, names: Mapping[int, str]) -> str:
    ident = holder.ident
    if holder.ended:
        return f"thread {ident} (ended)"
    if ident == training:
        return "the training thread"
    return f"thread {names[ident]!r}" if ident in names else f"thread {ident}"


def _holder_evidence(holder: locks.Holder, taken: locks.Taken) -> str:
    if holder.frame is None:
        said = f"the {taken.kind}'s record of its owner (thread id {holder.ident}"
        if holder.ended:
            return said + ", a thread that has ended)"
        # Taken with acquire(); or its owner ended and the id was given to a later thread.
        return said + ": no with block on it in that thread's stack)"
    said = f"its frame {_where(holder.frame)} is inside {holder.statement}, on that {taken.kind}"
    return f"the lock's record of its owner; {said}" if holder.owner else said


# ---- the verdict -------------------------------------------------------------------------------


def process_name() -> str:
    """How this process is named in the chain: its rank under ``torch.distributed``, the
    driver of a Ray job, else the training process."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return f"rank {dist.get_rank()}"
    except Exception:
        pass
    ray = sys.modules.get("ray")
    try:
        if ray is not None and ray.is_initialized():
            return "the driver"
    except Exception:
        pass
    return "the training process"


def build_verdict(
    report: Any,
    *,
    timeout: float = 5.0,
    engines: Callable[[], Sequence[Mapping[str, Any]]] | None = None,
    skip: int | None = None,
    job: Any = None,
) -> Verdict:
    """The verdict of ``report`` (a :class:`~otel_rl.watch.stalls.StallReport` with its other
    parts gathered), spending at most about ``timeout`` seconds on Ray's state API. ``engines``
    returns the rollout monitor's ``engine_states()``; ``skip`` is the calling thread; ``job`` is
    the job's verdict (:func:`otel_rl.watch.job_verdict.job_verdict`), when the process is one of
    a job's."""
    from otel_rl.telemetry.timing import open_phases, phase_history

    deadline = time.monotonic() + timeout
    verdict = Verdict(job=job)
    if job is not None:
        verdict.missing += job.unknown
    phases = {i: s for i, s in open_phases().items() if i != skip}
    ident = training_thread(phases)
    now = time.monotonic()
    process = process_name()
    frame = sys._current_frames().get(ident) if ident is not None else None
    try:
        stack = phases.get(ident or -1) or []
        if stack:
            path, began = stack[-1]
            age = now - began
            history = phase_history(path)
            told = (f"p95 {seconds(p95(history))} of {len(history)}" if history
                    else "never completed before")  # fmt: skip
            where = f"in {' > '.join(path.split('/'))} ({seconds(age)}; {told})"
            evidence = f"open timer {path!r} since {seconds(age)} ago"
        else:
            path, age = None, report.since_step
            where = f"outside any timer ({seconds(age)} since the last log_metrics call)"
            evidence = "no timer open on the training thread"
        wait = recognise(frame)
        if wait is None:
            verdict.chain.append(Link(process, path, None, age, evidence + "; no Python stack",
                                      text=f"{process} waits {where}"))  # fmt: skip
            verdict.missing.append("what the training thread runs: its stack is gone")
            return verdict
        head = Link(process, path, wait.words, age, f"{evidence}; {wait.evidence}")
        verdict.chain.append(head)
        if wait.unknown is not None:
            verdict.missing.append(wait.unknown)
        node_ip: str | None = None
        if wait.kind == "ray":
            words, node_ip = _ray_links(wait, report, verdict, deadline)
            head.waits_on = words or wait.words
        elif wait.kind == "http":
            _engine_links(wait.host, engines() if engines else [], verdict)
        elif wait.kind == "collective" and job is None:
            verdict.missing.append("which rank has not joined it (each rank's own stall report "
                                   "says where that rank is)")  # fmt: skip
        elif wait.kind == "collective" and not job.sentence:
            verdict.missing.append("which rank has not joined it: every rank that published its "
                                   "state is in it")  # fmt: skip
        elif wait.kind == "lock":
            _holder_links(wait, ident, verdict, phases, now)
        verb = "waits" if wait.kind != "code" else "is"
        head.text = f"{process} {verb} {where} " + ("on " if verb == "waits" else "at ")
        head.text += head.waits_on or wait.words
        if node_ip is not None:
            _engine_links(node_ip, engines() if engines else [], verdict)
            _gpu_link(node_ip, report.gpus, verdict)
        return verdict
    finally:
        del frame  # a frame holds every local of the stack it belongs to
