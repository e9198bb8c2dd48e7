"""A wait in ``ray.get``/``ray.wait``, followed through Ray's state API: the task behind the
first object ref not yet returned, its actor and node, what that actor runs (from the report's
``py-spy`` stacks) and the worker's open timers, then the engines and GPUs of that node."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, ClassVar

from otel_rl.watch.chain import Link
from otel_rl.watch.locks import where as _where
from otel_rl.watch.stalls import ray_state_address, seconds
from otel_rl.watch.waits.base import Following, Wait, in_module, local_vars
from otel_rl.watch.waits.serving import engine_links, gpu_link

__all__ = ["RayWait", "innermost_of", "recognise"]


@dataclass
class RayWait(Wait):
    kind: ClassVar[str] = "ray"
    refs: list[Any] = field(default_factory=list)  # the ObjectRefs waited on

    def follow(self, following: Following) -> None:
        words, node_ip = _task_links(self, following)
        following.head.waits_on = words or self.words
        if node_ip is not None:
            engine_links(node_ip, following.engines(), following.verdict)
            gpu_link(node_ip, following.report.gpus, following.verdict)


def recognise(frames: list[FrameType]) -> RayWait | None:
    for frame in frames:
        if not in_module(frame, "/ray/") or frame.f_code.co_name not in ("get", "wait"):
            continue
        refs = _object_refs(local_vars(frame))
        if refs:
            call = f"ray.{frame.f_code.co_name}"
            return RayWait(call, f"its stack, frame {_where(frame)}", refs=refs)
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


def _task_links(wait: RayWait, following: Following) -> tuple[str | None, str | None]:
    """The task behind the first object ref waited on, and what its worker is doing; the words
    of the wait, and the IP of the node the task runs on (``None``: not known)."""
    verdict, deadline, report = following.verdict, following.deadline, following.report
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

