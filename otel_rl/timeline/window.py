"""Which part of a run a picture shows: a range of steps, by default the slowest step and the
steps around it, and the spans, stalls and GPU points within that time."""

from __future__ import annotations

from dataclasses import dataclass

from otel_rl.timeline.run_picture import RunPicture, Span, Stall, Step

#: Steps shown on each side of the slowest one when no range is asked for.
AROUND = 2


@dataclass
class Window:
    steps: list[Step]
    start: float
    end: float
    spans: list[Span]
    stalls: list[Stall]
    gpus: dict[str, list[tuple[float, float]]]


def parse_steps(text: str) -> tuple[int, int]:
    """``"A-B"`` or ``"A"`` → (A, B); raises ``ValueError`` naming the form expected."""
    first, sep, last = text.strip().partition("-")
    try:
        a = int(first)
        b = int(last) if sep else a
    except ValueError:
        raise ValueError(f"--steps {text!r}: expected A-B or A, e.g. 10-20") from None
    if a < 0 or b < a:
        raise ValueError(f"--steps {text!r}: expected 0 <= A <= B")
    return a, b


def choose(picture: RunPicture, steps: tuple[int, int] | None = None) -> Window:
    """The steps asked for (all of them that the run has in that range), or the slowest step
    and :data:`AROUND` on each side; with no step at all, the whole run."""
    ordered = sorted(picture.steps, key=lambda s: s.step)
    if steps is not None:
        chosen = [s for s in ordered if steps[0] <= s.step <= steps[1]]
        if not chosen:
            have = f"{ordered[0].step}-{ordered[-1].step}" if ordered else "none"
            raise ValueError(f"--steps {steps[0]}-{steps[1]}: the run has no such step "
                             f"(its steps: {have})")  # fmt: skip
    elif ordered:
        slowest = ordered.index(max(ordered, key=lambda s: s.seconds))
        chosen = ordered[max(0, slowest - AROUND) : slowest + AROUND + 1]
    else:
        chosen = []
    if chosen:
        start, end = chosen[0].start, chosen[-1].end
        # A stall after the last chosen step belongs to the picture of it.
        for stall in picture.stalls:
            if start <= stall.start <= end + 1e-9 or (
                stall.last_step == chosen[-1].step and stall.end is not None
            ):
                end = max(end, stall.end if stall.end is not None else stall.start)
    else:
        times = [s.start for s in picture.spans] + [s.end for s in picture.spans]
        start, end = min(times, default=0.0), max(times, default=0.0)
    return Window(
        steps=chosen, start=start, end=end,
        spans=[s for s in picture.spans if s.end >= start and s.start <= end],
        stalls=[s for s in picture.stalls
                if s.start <= end and (s.end is None or s.end >= start)],
        gpus={name: [(t, v) for t, v in points if start <= t <= end]
              for name, points in picture.gpus.items()},
    )  # fmt: skip
