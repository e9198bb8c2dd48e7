"""What every kind of wait shares: the wait recognised in a thread's frames (:class:`Wait`, one
subclass per kind), what following it may use (:class:`Following`), and reading frames."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, ClassVar

from otel_rl.watch.chain import Link, Verdict

__all__ = ["Following", "Wait", "frames_of", "in_module", "local_vars", "training_thread",
           "user_frame"]  # fmt: skip


@dataclass
class Following:
    """What a wait may follow beyond the training thread, and where it adds what it finds: the
    chain's first link is ``head`` (``waits_on`` may be made more precise)."""

    report: Any  # the StallReport, with its other parts gathered
    verdict: Verdict
    head: Link
    deadline: float  # monotonic: when Ray's state API must have answered
    engines: Callable[[], Sequence[Mapping[str, Any]]]  # the rollout monitor's engine states
    training: int | None  # the training thread's ident
    phases: Mapping[int, Sequence[tuple[str, float]]]  # every thread's open timer paths
    now: float  # monotonic
    #: What a thread waits on, every kind tried (the package's ``recognise``): for a lock's holder
    recognise: Callable[[FrameType | None], Wait | None]


@dataclass
class Wait:
    """A wait recognised in a thread's frames: ``words`` in the sentence, ``evidence`` where they
    come from, ``unknown`` what could not be known of it (for the verdict's ``missing``)."""

    #: Each kind's own: code | ray | http | collective | sync | lock | subprocess
    kind: ClassVar[str] = ""
    words: str
    evidence: str
    unknown: str | None = None

    def follow(self, following: Following) -> None:
        """What it waits for in turn, added to the verdict (nothing, for most kinds)."""


def frames_of(frame: FrameType | None) -> list[FrameType]:
    """Innermost first."""
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back
    return out


def in_module(frame: FrameType, *parts: str) -> bool:
    name = frame.f_code.co_filename.replace("\\", "/")
    return any(part in name for part in parts)


def local_vars(frame: FrameType) -> Mapping[str, Any]:
    try:
        return frame.f_locals
    except Exception:  # a frame torn down meanwhile
        return {}


def user_frame(frames: list[FrameType]) -> FrameType:
    """The innermost frame outside the standard library and site-packages (else the innermost)."""
    libraries = tuple({os.path.join(p, "lib") for p in (sys.prefix, sys.base_prefix)})
    for frame in frames:
        name = frame.f_code.co_filename
        if "-packages" not in name and not name.startswith(libraries):
            return frame
    return frames[0]


def training_thread(phases: Mapping[int, Sequence[tuple[str, float]]]) -> int | None:
    """The thread that trains: the main thread when a timer is open on it, else the thread
    whose outermost open timer is the oldest, else the main thread."""
    main = threading.main_thread().ident
    if phases.get(main or -1):
        return main
    timed = [(stack[0][1], ident) for ident, stack in phases.items() if stack]
    return min(timed)[1] if timed else main
