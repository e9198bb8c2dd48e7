"""Records to trackers: the fan-out, each tracker's channel (queue, worker, retries), its
write-ahead spool, the tracker registry and background artifact dumps."""
