"""What the tests and the benchmarks share: real servers on 127.0.0.1, the trackers' own
readers, fixture pages and data. Not installed with otel-rl."""
