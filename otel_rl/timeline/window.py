"""Which part of a run a picture shows: a range of steps, by default the slowest step after
warm-up and the steps around it; the spans of those steps, and the stalls and GPU points within
their time."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from otel_rl.timeline.run_picture import RunPicture, Span, StallSpan, Step

#: Steps shown on each side of the slowest one when no range is asked for.
AROUND = 2


@dataclass
class Window:
    steps: list[Step]
    start: float
    end: float
    spans: list[Span]
    stalls: list[StallSpan]
    gpus: dict[str, list[tuple[float, float]]]


def parse_steps(text: str) -> tuple[int, int]:
    """``"A-B"`` or ``"A"`` → (A, B); raises ``ValueError`` naming the form expected."""
    first, sep, last = text.strip().partition("-")
    digits = [part.strip() for part in ((first, last) if sep else (first,))]
    if not all(part.isascii() and part.isdigit() for part in digits):
        raise ValueError(f"--steps {text!r}: expected A-B or A, e.g. 10-20")
    a = int(digits[0])
    b = int(digits[-1])
    if a < 0 or b < a:
        raise ValueError(f"--steps {text!r}: expected 0 <= A <= B")
    return a, b


def choose(picture: RunPicture, steps: tuple[int, int] | None = None) -> Window:
    """The steps asked for (all of them that the run has in that range), or the slowest step
    after warm-up (the first step of each launch is left out, unless it is the only one) and
    :data:`AROUND` on each side; with no step at all, the whole run."""
    ordered = sorted(picture.steps, key=lambda s: s.step)
    if steps is not None:
        chosen = [s for s in ordered if steps[0] <= s.step <= steps[1]]
        if not chosen:
            have = f"{ordered[0].step}-{ordered[-1].step}" if ordered else "none"
            raise ValueError(f"--steps {steps[0]}-{steps[1]}: the run has no such step "
                             f"(its steps: {have})")  # fmt: skip
    elif ordered:
        # warm: not the first step of a launch (of the run, or of a relaunch)
        warm = [s for i, s in enumerate(ordered) if i and s.attempt == ordered[i - 1].attempt]
        centre = ordered.index(max(warm or ordered, key=lambda s: s.seconds))
        stall = _longest_stall(picture)
        if stall is not None and stall_seconds(stall, picture) > ordered[centre].seconds:
            # A stall the run never got out of (killed in it) has no slow step of its own.
            after = [i for i, s in enumerate(ordered) if s.step > (stall.last_step or -1)]
            centre = after[0] if after else len(ordered) - 1
        chosen = ordered[max(0, centre - AROUND) : centre + AROUND + 1]
    else:
        chosen = []
    if chosen:
        start, end = chosen[0].start, chosen[-1].end
        # A stall after the last chosen step belongs to the picture of it, and so does one the
        # run died in, after its last step on record.
        last = chosen[-1].step
        last_of_run = chosen[-1] is ordered[-1]
        for stall in picture.stalls:
            held = stall.last_step is not None and (
                stall.last_step == last or (last_of_run and stall.last_step > last)
            )
            if held or start <= stall.start <= end + 1e-9:
                end = max(end, stall.start + stall_seconds(stall, picture))
    else:
        times = [s.start for s in picture.spans] + [s.end for s in picture.spans]
        start, end = min(times, default=0.0), max(times, default=0.0)
    stalls = [s for s in picture.stalls if s.start <= end and (s.end is None or s.end >= start)]
    return Window(
        steps=chosen, start=start, end=end,
        spans=spans_of(picture, chosen, stalls) if chosen else list(picture.spans),
        stalls=stalls,
        gpus={name: [(t, v) for t, v in points if start <= t <= end]
              for name, points in picture.gpus.items()},
    )  # fmt: skip


def spans_of(
    picture: RunPicture, steps: Sequence[Step], stalls: Sequence[StallSpan] = ()
) -> list[Span]:
    """The spans of ``steps``, each at the launch the step is shown at (an earlier launch that
    ran it too is left out), and the spans of no known step within their time or a stall's (a
    step the run died in has no ``rl.step`` span on disk). A span of a step whose launch it
    does not say is that step's when it lies in that step's time."""
    shown = {s.step: s for s in steps}
    in_time = overlapping([(s.start, s.end) for s in steps]
                          + [(s.start, s.start + stall_seconds(s, picture)) for s in stalls])

    def held(span: Span) -> bool:
        if span.step is None:
            return in_time(span.start, span.end)
        step = shown.get(span.step)
        if step is None or span.attempt is not None:
            return step is not None and span.attempt == step.attempt
        return step.start < span.end and span.start < step.end

    return [s for s in picture.spans if held(s)]


def overlapping(times: Iterable[tuple[float, float]]) -> Callable[[float, float], bool]:
    """Whether the time from ``a`` to ``b`` overlaps any of ``times`` (ranges of seconds)."""
    merged: list[list[float]] = []
    for a, b in sorted(times):
        if merged and a < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def test(a: float, b: float) -> bool:
        last = bisect_left(starts, b) - 1  # the last range that begins before b
        return last >= 0 and merged[last][1] > a

    return test


def _longest_stall(picture: RunPicture) -> StallSpan | None:
    return max(picture.stalls, key=lambda s: stall_seconds(s, picture), default=None)


def stall_seconds(stall: StallSpan, picture: RunPicture) -> float:
    """A stall's length; one that never ended lasts until the last thing the run recorded."""
    if stall.end is not None:
        return stall.end - stall.start
    last = max([s.end for s in picture.spans] + [s.end for s in picture.steps], default=0.0)
    return max(stall.lasted, last - stall.start)


def last_steps(picture: RunPicture, count: int) -> tuple[int, int] | None:
    """The range of the run's last ``count`` steps; ``None`` for a run without steps."""
    ordered = sorted(s.step for s in picture.steps)
    if not ordered:
        return None
    return ordered[-min(count, len(ordered))], ordered[-1]
