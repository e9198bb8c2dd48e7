"""The invariant over delivered rows, and the counts that go with it.

Every step whose ``log_metrics`` call returned at least ``fsync_interval`` before the kill is
delivered exactly once to every tracker, in step order, with its values; no step is ever
delivered twice, expected or not, and nothing is delivered that was not logged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise

from tests.faults.delivered import Delivered
from tests.faults.plan import keys_of, value_of


@dataclass
class Finding:
    tracker: str
    kind: str  # missing, duplicate, order, value, phantom, unreadable (+ driver kinds)
    steps: list[int]
    detail: str = ""

    def __str__(self) -> str:
        steps = f" steps {ranges(self.steps)}" if self.steps else ""
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.tracker}: {self.kind}{steps}{detail}"


@dataclass
class Counts:
    expected: int = 0  # rows that must be there
    delivered: int = 0  # rows there (distinct steps, expected or not)
    expected_delivered: int = 0
    duplicates: int = 0  # extra copies of a row
    missing: int = 0

    def __iadd__(self, other: Counts) -> Counts:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def ranges(steps: list[int] | set[int]) -> str:
    """``[0, 1, 2, 5]`` → ``"0-2, 5"`` (long lists cut after 12 ranges)."""
    ordered = sorted(set(steps))
    spans: list[str] = []
    start = prev = None
    for s in [*ordered, None]:
        if start is not None and (s is None or s != prev + 1):
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if s is not None and start is None:
            start = s
        prev = s
    more = f", ... ({len(spans) - 12} more ranges)" if len(spans) > 12 else ""
    return ", ".join(spans[:12]) + more


def check(
    delivered: Delivered,
    returned: dict[int, float],
    cutoff: float,
    damaged: frozenset[int] = frozenset(),
) -> tuple[list[Finding], Counts]:
    """Check one tracker's rows. ``returned``: step → when its last ``log_metrics`` returned
    (CLOCK_MONOTONIC); steps that returned at or before ``cutoff`` must be there, but for the
    ``damaged`` ones (their spool lines were overwritten: they may be lost, never doubled)."""
    name = delivered.tracker
    findings = [Finding(name, "unreadable", [], p) for p in delivered.problems]
    expected = {s for s, at in returned.items() if at <= cutoff} - damaged
    # The step being logged at the kill may be there, whole or in part, without its line.
    highest = max(returned, default=-1) + 1
    per_step: dict[int, Counter] = {}
    duplicated: set[int] = set()
    backwards: set[int] = set()
    wrong: list[str] = []
    phantom: set[int] = set()
    for key, series in sorted(delivered.series.items()):
        seen = Counter(step for step, _ in series)
        for step, count in seen.items():
            per_step.setdefault(step, Counter())[key] = count
            if count > 1:
                duplicated.add(step)
        if delivered.ordered:
            for (before, _), (step, _) in pairwise(series):
                if step < before and step not in duplicated:
                    backwards.add(step)
        for step, value in series:
            if not 0 <= step <= highest:
                phantom.add(step)
            elif key not in keys_of(step) or value != value_of(step, key):
                wrong.append(f"{key}@{step}={value!r}")
    missing = sorted(
        s for s in expected if any(per_step.get(s, Counter())[k] == 0 for k in keys_of(s))
    )
    if missing:
        detail = f"{len(missing)} of {len(expected)}"
        if cutoff != float("inf"):  # how far inside the promise the oldest missing step is
            detail += f"; step {missing[0]} returned {cutoff - returned[missing[0]]:.3f}s before "
            detail += "the cutoff (kill - fsync_interval - grace)"
        findings.append(Finding(name, "missing", missing, detail))
    if duplicated:
        findings.append(Finding(name, "duplicate", sorted(duplicated)))
    if backwards:
        findings.append(Finding(name, "order", sorted(backwards), "came after a later step"))
    if phantom:
        findings.append(Finding(name, "phantom", sorted(phantom), "never logged"))
    if wrong:
        findings.append(Finding(name, "value", [], ", ".join(wrong[:10])))
    counts = Counts(
        expected=len(expected),
        delivered=len(per_step),
        expected_delivered=len(expected) - len(missing),
        duplicates=sum(max(c.values()) - 1 for c in per_step.values()),
        missing=len(missing),
    )
    return findings, counts
