"""Fault injection: a real training process killed at random points, then replayed.

- :mod:`tests.faults.plan` — what a run logs (keys and values per step) and the seeded plan of
  one iteration (where and how the process is killed, how the test tracker misbehaves).
- :mod:`tests.faults.child` — the training process (``python -m tests.faults.child PLAN``).
- :mod:`tests.faults.fault_tracker` — a file tracker made slow or raising by a control file.
- :mod:`tests.faults.driver` — starts the child, kills it, replays (also killed), reads back.
- :mod:`tests.faults.delivered` — each tracker's delivered rows, read with its own reader.
- :mod:`tests.faults.invariant` — the invariant over those rows, and the counts.
"""
