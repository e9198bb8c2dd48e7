"""What an operator runs: ``otel-rl demo``, ``otel-rl replay``, ``otel-rl gpu-monitor``."""
