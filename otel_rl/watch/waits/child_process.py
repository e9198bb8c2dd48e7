"""A wait for a subprocess (``Popen.wait``/``communicate``, ``subprocess.run`` and its kin): the
command the code ran, and its pid."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from types import FrameType
from typing import ClassVar

from otel_rl.watch.locks import where as _where
from otel_rl.watch.waits.base import Wait, in_module, local_vars

__all__ = ["SubprocessWait", "recognise"]


@dataclass
class SubprocessWait(Wait):
    kind: ClassVar[str] = "subprocess"


def recognise(frames: list[FrameType]) -> SubprocessWait | None:
    for frame in reversed(frames):  # outermost first: the Popen call the code made
        if in_module(frame, "/subprocess.py") and frame.f_code.co_name in (
            "wait", "communicate", "run", "call", "check_call", "check_output",
        ):  # fmt: skip
            variables = local_vars(frame)
            popen = variables.get("self", variables.get("process"))
            args = getattr(popen, "args", None) or variables.get("popenargs")
            pid = getattr(popen, "pid", None)
            shown = shlex.join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            shown = " ".join(shown.split())
            shown = shown if len(shown) <= 120 else shown[:119] + "…"
            words = f"subprocess {shown}" + (f" (pid {pid})" if pid else "")
            return SubprocessWait(words, f"its stack, frame {_where(frame)}")
    return None
