"""Notice training steps that reach a tracker out of order.

Trackers treat a step that goes backwards differently (W&B drops it, SwanLab keeps only the first
value per key and step, Trackio and MLflow keep both); each exporter decides what to do, this
only detects it and keeps the count.
"""

from __future__ import annotations


class StepOrder:
    """The highest training step sent so far, and how many steps arrived below it."""

    def __init__(self, *, repeat_is_backwards: bool = False) -> None:
        #: Whether a step equal to the highest one also counts (trackers that keep one value
        #: per step lose the repeat just as they lose an earlier step).
        self.repeat_is_backwards = repeat_is_backwards
        self.highest: int | None = None
        self.backwards = 0

    def check(self, step: int) -> int | None:
        """Record ``step``; return the highest earlier step when ``step`` goes backwards."""
        highest = self.highest
        if highest is None or step > highest:
            self.highest = step
            return None
        if step < highest or self.repeat_is_backwards:
            self.backwards += 1
            return highest
        return None
