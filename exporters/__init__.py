"""Tracker exporters: one OTel ``MetricExporter`` per experiment tracker.

Each module imports its tracker's SDK lazily, on the exporter's own thread. Use
:func:`otel_rl.registry.exporter_class` to find one by name.
"""
