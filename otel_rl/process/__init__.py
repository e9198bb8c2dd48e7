"""The process around a run: otel-rl's log lines under the fork lock, signals, ``atexit``, fork,
and the one deadline every part stops by."""
