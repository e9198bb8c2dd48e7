"""The OpenTelemetry side: meter providers and readers, OTLP and Prometheus outputs, tracing,
timers and otel-rl's own health instruments."""
