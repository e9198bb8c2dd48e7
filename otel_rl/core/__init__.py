"""Plain data and rules every layer shares: records, values, keys, errors, paths, the metric
catalogue, failure classes, redaction. No threads, no I/O, no imports from other layers."""
