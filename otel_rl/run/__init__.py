"""The parts of one run behind the Logger facade: step assembly, the trackers, the sources and
the pending-step checkpoints, and the OTel SDK's own readers' trackers."""
