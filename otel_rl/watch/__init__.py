"""Watching the run: the stall watchdog, its reports, and the straggler watch."""
