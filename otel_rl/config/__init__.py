"""One config: file loading and interpolation, the typed schema, environment variables and the
trackers' own settings."""
