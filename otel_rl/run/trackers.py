"""The run's tracker exporters: built from the config (plus those the caller gives), each given
the run's ``export.*`` options and a spool folder of its own, started, and stopped by a deadline.

Where a tracker spools is decided here, once: ``<log_dir>/.otel-rl/spool/<tracker>/<run id>``,
the run id always a single folder name, and never the folder of a dead run whose records still
wait for ``otel-rl replay``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from otel_rl.config.schema import LoggerSettings, plain
from otel_rl.core.errors import ConfigError
from otel_rl.core.paths import folder_name
from otel_rl.core.redaction import Patterns, redact_nested
from otel_rl.delivery.channel import Channel
from otel_rl.delivery.fanout import Delivery
from otel_rl.delivery.options import ExportOptions
from otel_rl.delivery.registry import enabled_backends, exporter_class
from otel_rl.delivery.service_link import ServiceLink
from otel_rl.delivery.spool import (
    SpoolBusy,
    handoff_dir,
    held_by_a_live_run,
    spool_root,
    spools_of_run,
    waiting_records,
)
from otel_rl.delivery.tracker import Tracker
from otel_rl.process.deadline import (
    SHUTDOWN_GRACE,
    Deadline,
    Part,
    Stopping,
    still_stopping,
    stop_in_parallel,
)
from otel_rl.process.fork_safe_log import log as _log
from otel_rl.run.history import (
    ATTEMPT_KEY,
    LAUNCH_KEY,
    PREVIOUS_LAUNCH_TIMEOUT,
    PreviousLaunch,
    RunHistory,
)


class RunTrackers:
    """The trackers of one run, each in its delivery (``exporters``), in the order they were
    enabled: a :class:`~otel_rl.delivery.channel.Channel` around each tracker built here, or,
    for the trackers of the delivery process, its stand-in."""

    def __init__(
        self,
        cfg: LoggerSettings,
        given: Sequence[Tracker],
        *,
        run_id: str,
        options: ExportOptions,
        redaction: Patterns,
        here: bool = False,
    ) -> None:
        self._cfg = cfg
        self._run_id = run_id
        # The spools stay where log_dir is now, whatever the script's directory later.
        self._log_dir = Path(cfg.log_dir).absolute()
        self._options = options
        self._redaction = redaction
        classes = [exporter_class(name) for name in enabled_backends(cfg)]
        #: The delivery process of ``export.delivery: process`` (the trackers the config
        #: builds run there; those given as instances stay here), else None. ``here``: this is
        #: the delivery process.
        self.link: ServiceLink | None = None
        if cfg.export.delivery == "process" and classes and not here:
            self.link = ServiceLink(
                [sys.executable, "-m", "otel_rl.run.service"],
                classes,
                # sys.path: trackers (and their entry points) importable here are there too.
                {"cfg": cfg, "run_id": run_id, "cwd": os.getcwd(), "pid": os.getpid(),
                 "log_dir": str(cfg.log_dir), "shutdown_timeout": options.shutdown_timeout,
                 "log_level": _log.getEffectiveLevel(), "sys_path": list(sys.path)},
                options,
                handoff_dir=handoff_dir(self._log_dir) if cfg.export.spool else None,
            )
        #: The deliveries of the trackers built in this process (the config's, unless the
        #: delivery process holds them, and those given; a tracker given twice is one).
        self.local = list(dict.fromkeys(Channel.of(tracker) for tracker in _trackers(given)))
        if self.link is None:
            self.local[:0] = [Channel.of(cls.from_config(cfg)) for cls in classes]
        self.exporters: list[Delivery] = [*(self.link.trackers if self.link else ()), *self.local]
        # The delivery process spools its trackers under their names: instances given here with
        # the same name spool beside them, as they would beside trackers built in this process.
        self._folders = {folder_name(name) for name in self.link.names} if self.link else set()
        #: A relaunch's delivery of what its run's earlier launches left in their spools, which
        #: every tracker here waits for before its first write (``run/history.py``).
        self.previous: PreviousLaunch | None = None

    def start(self) -> None:
        """Attach and start every exporter; on failure, stop those started and raise."""
        try:
            if self.link is not None:  # its spools are taken (or refused) before this returns
                self.link.start()
            else:  # the process that holds the run's trackers completes its earlier launches
                self.previous = self._previous_launch()
            for channel in self.local:  # the same export.* for every tracker
                self._attach(channel)
            if self.previous is not None:  # this launch's spools are set up: none is replayed
                self.previous.start()
        except BaseException:
            self.abandon()
            raise

    def stopping(self, deadline: Deadline, exit_code: int) -> list[Part]:
        """Each exporter's shutdown by ``deadline`` (drained, then closed with the exit code), and
        the delivery process's end."""
        parts: list[Part] = [
            (f"tracker {c.name}", partial(_shutdown, c, deadline, exit_code)) for c in self.local
        ]
        if self.link is not None:
            parts.append((self._link_part, partial(self.link.finish, deadline, exit_code)))
        if self.previous is not None:
            # Still delivering the earlier launch: it stops between two writes (what is left
            # stays for replay) and closes its runs before this launch's trackers close them
            # with this launch's status, which is the run's.
            parts.append(("the earlier launch's delivery", partial(self.previous.stop, deadline)))
        return parts

    def still_stopping(self, stopping: Stopping, deadline: Deadline) -> list[str]:
        """The names of the parts of ``stopping`` (:meth:`stopping`'s, started) still stopping
        a grace after ``deadline``. The delivery process's end is waited for one grace more:
        killed at the deadline, it leaves this process to write what it never spooled to the
        leftover file and to count what it left, local work that the exit would cut (those
        records lost, the count never said) on a machine too busy to do it in time."""
        late = still_stopping(stopping, deadline.at + SHUTDOWN_GRACE)
        link = [(name, thread) for name, thread in stopping if name == self._link_part]
        if self._link_part not in late or not link:
            return late
        others = [name for name in late if name != self._link_part]
        return others + still_stopping(link, deadline.at + 2 * SHUTDOWN_GRACE)

    @property
    def _link_part(self) -> str:
        return f"delivery process ({', '.join(self.link.names if self.link else ())})"

    def abandon(self) -> None:
        """The run failed to start: stop the trackers started so far (nothing was logged)."""
        deadline = Deadline(1.0)
        started = [c for c in self.local if c.started]
        parts = [(f"tracker {c.name}", partial(_shutdown, c, deadline, 0)) for c in started]
        if self.link is not None and self.link.process is not None:
            parts.append(("delivery process", partial(self.link.finish, deadline, 0)))
        stop_in_parallel(parts, deadline.at + SHUTDOWN_GRACE)

    def _attach(self, channel: Channel) -> None:
        if channel.started:
            _log.warning(
                "otel-rl: exporter %s was started before it was given to the Logger; it keeps "
                "its own export options and spool", channel.name,
            )  # fmt: skip
            return
        spool = self._spool_options(channel.name)
        channel.attach(self._options, spool.get("spool_dir"), spool.get("spool_meta"),
                       self.previous)  # fmt: skip
        channel.tracker.redact_own_config(self._redaction)
        try:
            channel.start()
        except SpoolBusy as busy:
            raise ConfigError(
                f"run_id {self._run_id!r} is already in use in {self._log_dir}: its "
                f"{channel.name} spool is held by {busy.holder}; give each run its own run_id "
                "(or leave it unset for a fresh one)"
            ) from None
        except OSError as exc:  # a read-only, full or wrong-kind log_dir: said at Logger()
            raise ConfigError(
                f"logger config 'log_dir': {str(self._log_dir)!r} cannot hold {channel.name}'s "
                f"spool ({exc}); give a writable folder, or set export.spool: false"
            ) from None

    def _previous_launch(self) -> PreviousLaunch | None:
        """A relaunch whose earlier launches left records undelivered delivers them first."""
        cfg = self._cfg
        resumed = cfg.resume != "never" and cfg.attempt > 1
        if not resumed or not cfg.export.spool:
            return None
        waiting = sum(map(waiting_records, spools_of_run(self._log_dir, self._run_id)))
        if not waiting:
            return None
        _log.info("otel-rl: run %s, attempt %s: delivering the %d record(s) its earlier launch "
                  "left in its spools first", self._run_id, cfg.attempt,
                  waiting)  # fmt: skip
        return PreviousLaunch(RunHistory.of_launch(self._cfg), waiting, PREVIOUS_LAUNCH_TIMEOUT)

    def _spool_options(self, tracker: str) -> dict[str, Any]:
        if not self._cfg.export.spool:
            return {}
        # Two exporters of one name (instances given twice) each get a spool of their own.
        folder, n = folder_name(tracker), 2
        while folder in self._folders:
            folder, n = f"{folder_name(tracker)}-{n}", n + 1
        self._folders.add(folder)
        return {
            "spool_dir": self._spool_dir_of(spool_root(self._log_dir) / folder, tracker),
            "spool_meta": {
                "run_id": self._run_id,
                # Which launch wrote it: a relaunch reopens the tracker run of the latest one.
                ATTEMPT_KEY: self._cfg.attempt,
                LAUNCH_KEY: self._cfg.launch,
                "log_dir": str(self._cfg.log_dir),  # as given: replay follows a moved one
                # Relative paths of the config start here (``otel-rl replay`` runs there).
                "cwd": os.getcwd(),
                "config": redact_nested(plain(self._cfg), extra_patterns=self._redaction),
            },
        }

    def _spool_dir_of(self, tracker_root: Path, tracker: str) -> Path:
        """The run's spool folder for one tracker. The run id names a folder of its own
        whatever it holds ("exp/1", ".."). A run started again with the run id of one that died
        with records waiting (for ``otel-rl replay``) spools beside them, never over them: its
        deliveries would otherwise mark the dead run's records done."""
        base = tracker_root / folder_name(self._run_id)
        directory, n = base, 2
        while (waiting := waiting_records(directory)) and not held_by_a_live_run(directory):
            if directory == base and self.previous is None:
                _log.warning(
                    "otel-rl: %s: run_id %r already has %d record(s) waiting in %s from an "
                    "earlier process; they stay there for `otel-rl replay %s`, and this run "
                    "spools beside them", tracker, self._run_id, waiting, base, self._log_dir,
                )  # fmt: skip
            directory, n = base.with_name(f"{base.name}%restart-{n}"), n + 1
        return directory


def _shutdown(channel: Channel, deadline: Deadline, exit_code: int) -> None:
    channel.shutdown(deadline.left(), exit_code)


def _trackers(given: Sequence[object]) -> list[Tracker]:
    """The trackers given to a Logger, each checked to be one."""
    for tracker in given:
        if not isinstance(tracker, Tracker):
            raise ConfigError(
                f"Logger(exporters=...) takes trackers, and {tracker!r} is a "
                f"{type(tracker).__name__}: subclass otel_rl.exporters.Tracker "
                "(docs/backends/README.md, 'Adding a tracker')"
            )
    return list(given)  # type: ignore[arg-type]
