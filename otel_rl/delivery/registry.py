"""Find tracker exporters by name.

Trackers are registered under the ``otel_rl.exporters`` entry-point group, otel-rl's own ones
included (pyproject.toml), so a third-party package can add one (``[project.entry-points.
"otel_rl.exporters"] mytracker = "pkg:MyExporter"``). The entry points are the one list of
trackers: the config's ``<name>_enabled`` flags and sections come from the classes of otel-rl's
own (:func:`builtin_trackers`), each of which declares what the config needs of it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, distribution, entry_points
from typing import Any

from otel_rl.core.errors import ConfigError
from otel_rl.core.failures import install_hint
from otel_rl.delivery.tracker import Tracker

ENTRY_POINT_GROUP = "otel_rl.exporters"
#: The distribution whose entry points are the built-in trackers.
DISTRIBUTION = "otel-rl"


def available_exporters() -> dict[str, str]:
    """``{name: "module:Class"}`` for every installed tracker exporter."""
    found = dict(_own_entry_points())  # raises, with what to do, when otel-rl is not installed
    found.update((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP))
    return found


def builtin_trackers() -> list[str]:
    """The trackers otel-rl registers itself, in the order their ``config`` declares: the order
    of the config's flags and of the trackers a config enables."""
    return list(_builtin_classes())


def builtin_tracker_classes() -> dict[str, type[Any]]:
    """``{name: exporter class}`` of :func:`builtin_trackers`, in that order (their modules are
    imported, their SDKs not: exporters import those when they open)."""
    return dict(_builtin_classes())


@functools.cache
def _builtin_classes() -> dict[str, type[Any]]:
    classes = {name: _load(name, target) for name, target in _own_entry_points().items()}
    return dict(sorted(classes.items(), key=lambda item: (item[1].config.order, item[0])))


@functools.cache
def _own_entry_points() -> dict[str, str]:
    try:
        eps = list(distribution(DISTRIBUTION).entry_points)
    except PackageNotFoundError:
        eps = []
    own = {ep.name: ep.value for ep in eps if ep.group == ENTRY_POINT_GROUP}
    if not own:
        raise ConfigError(
            f"otel-rl's tracker entry points (group '{ENTRY_POINT_GROUP}') are not installed: "
            "install otel-rl (from a source checkout: pip install -e .) rather than running it "
            "from a folder on sys.path"
        )
    return own


def _load(name: str, target: str) -> type[Any]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"the '{name}' backend needs an optional dependency: {exc}; "
            f"{install_hint(name, exc.name)}"
        ) from exc
    cls: type[Any] = getattr(module, attr)
    return cls


def exporter_class(name: str) -> type[Tracker]:
    """Import and return the exporter class registered as ``name``."""
    target = available_exporters().get(name)
    if target is None:
        raise ConfigError(
            f"no tracker exporter named '{name}' (available: "
            f"{', '.join(sorted(available_exporters()))})"
        )
    cls = _load(name, target)
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        raise ConfigError(
            f"the tracker '{name}' ({target}) is not an otel_rl.exporters.Tracker subclass; "
            "a tracker subclasses it (docs/backends/README.md, 'Adding a tracker')"
        )
    for requirement in cls.requires:
        if importlib.util.find_spec(requirement) is None:
            raise ConfigError(
                f"the '{name}' backend needs the '{requirement}' package; "
                f"{install_hint(name, requirement)}"
            )
    return cls


def enabled_backends(cfg: Any) -> list[str]:
    """Names of the tracker backends a resolved config enables, in a stable order: the built-in
    ones whose ``<name>_enabled`` is on, then those under ``trackers``. ``cfg`` is the typed
    config (:class:`otel_rl.config.schema.LoggerSettings`) or its plain mapping."""
    values: Mapping[str, Any] = cfg if isinstance(cfg, Mapping) else vars(cfg)
    names = [name for name in builtin_trackers() if values.get(f"{name}_enabled")]
    names.extend(name for name in values.get("trackers") or {} if name not in names)
    return names
