"""Route code that only uses the OTel API (``metrics.get_meter(...)``) to the active Logger.

OTel lets a process set its global MeterProvider once. A training script may create several
Loggers over its life (one per run, in notebooks, in tests), so otel-rl installs one
:class:`RoutedMeterProvider` as the global provider and points it at the newest live Logger's
SDK provider. Instruments obtained through it keep working across Loggers: each resolves its
real instrument again when the target changes (one integer comparison per measurement). When the
newest Logger finishes, routing goes back to the newest one still live, and to nothing only when
none is.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import MeterProvider as ApiMeterProvider

from otel_rl.process.fork_safe_log import log as _log

_SYNC_KINDS = ("create_counter", "create_up_down_counter", "create_histogram", "create_gauge")
_ASYNC_KINDS = (
    "create_observable_counter",
    "create_observable_gauge",
    "create_observable_up_down_counter",
)


class RoutedMeterProvider(ApiMeterProvider):
    """A MeterProvider whose meters forward to whichever SDK provider is current."""

    def __init__(self) -> None:
        self._target: ApiMeterProvider | None = None
        self._generation = 0
        self._lock = threading.Lock()
        self._observables: weakref.WeakSet[_RoutedInstrument] = weakref.WeakSet()
        # Providers of the live Loggers, oldest first (weak: a dropped Logger is not pinned).
        self._live: list[weakref.ref[ApiMeterProvider]] = []

    # A _RoutedMeter is a Meter by delegation, not by inheritance.
    def get_meter(  # type: ignore[override]
        self,
        name: str,
        version: str | None = None,
        schema_url: str | None = None,
        attributes: Any = None,
    ) -> _RoutedMeter:
        return _RoutedMeter(self, (name, version, schema_url, attributes))

    def route_to(self, target: ApiMeterProvider | None) -> None:
        """Route to ``target``, the provider of the newest live Logger (``None``: to nothing)."""
        with self._lock:
            if target is not None:
                self._live = [r for r in self._live if r() not in (None, target)]
                self._live.append(weakref.ref(target))
            self._switch_locked(target)
        self._resolve_observables()

    def unroute(self, target: ApiMeterProvider) -> None:
        """``target``'s Logger finished: if it was the current one, route to the newest Logger
        still live, or to nothing when none is."""
        with self._lock:
            self._live = [r for r in self._live if r() not in (None, target)]
            if self._target is not target:
                return
            newest = self._live[-1]() if self._live else None
            self._switch_locked(newest)
        self._resolve_observables()

    def reset_after_fork(self) -> None:
        """In a fork child: a parent thread may have held the lock at fork; the inherited Loggers
        are disabled there (:mod:`otel_rl.process.lifecycle`) and unroute themselves next."""
        self._lock = threading.Lock()

    def _switch_locked(self, target: ApiMeterProvider | None) -> None:
        self._target = target
        self._generation += 1

    def _resolve_observables(self) -> None:
        with self._lock:
            observables = list(self._observables)
        for instrument in observables:  # callbacks must be registered on the new provider now
            instrument.resolve()

    @property
    def target(self) -> ApiMeterProvider | None:
        return self._target


class _RoutedMeter:
    def __init__(self, provider: RoutedMeterProvider, meter_args: tuple[Any, ...]) -> None:
        self._provider = provider
        self._meter_args = meter_args

    def __getattr__(self, kind: str) -> Callable[..., _RoutedInstrument]:
        if kind not in _SYNC_KINDS and kind not in _ASYNC_KINDS:
            raise AttributeError(kind)

        def create(*args: Any, **kwargs: Any) -> _RoutedInstrument:
            instrument = _RoutedInstrument(self._provider, self._meter_args, kind, args, kwargs)
            if kind in _ASYNC_KINDS:
                self._provider._observables.add(instrument)
                instrument.resolve()
            return instrument

        return create


class _RoutedInstrument:
    """Forwards ``add``/``record``/``set`` to the real instrument of the current provider."""

    def __init__(
        self,
        provider: RoutedMeterProvider,
        meter_args: tuple[Any, ...],
        kind: str,
        args: Sequence[Any],
        kwargs: dict[str, Any],
    ) -> None:
        self._provider = provider
        self._meter_args = meter_args
        self._kind = kind
        self._args = args
        self._kwargs = kwargs
        self._generation = -1
        self._real: Any = None

    def resolve(self) -> Any:
        provider = self._provider
        generation = provider._generation
        if generation != self._generation:
            target = provider._target
            real = None
            if target is not None:
                try:
                    meter = target.get_meter(*self._meter_args)
                    real = getattr(meter, self._kind)(*self._args, **self._kwargs)
                except Exception as exc:  # an invalid name must not break library code
                    _log.warning("otel-rl: cannot create instrument %r: %s", self._args[:1], exc)
            self._real, self._generation = real, generation
        return self._real

    def add(self, amount: float, attributes: Any = None, context: Any = None) -> None:
        real = self.resolve()
        if real is not None:
            real.add(amount, attributes, context)

    def record(self, amount: float, attributes: Any = None, context: Any = None) -> None:
        real = self.resolve()
        if real is not None:
            real.record(amount, attributes, context)

    def set(self, amount: float, attributes: Any = None, context: Any = None) -> None:
        real = self.resolve()
        if real is not None:
            real.set(amount, attributes, context)


_GLOBAL: RoutedMeterProvider | None = None
_GLOBAL_LOCK = threading.Lock()


def global_router() -> RoutedMeterProvider | None:
    """Install the routed provider as OTel's global one (once); ``None`` if someone else did."""
    global _GLOBAL
    with _GLOBAL_LOCK:
        if _GLOBAL is not None:
            return _GLOBAL
        current = otel_metrics.get_meter_provider()
        if isinstance(current, RoutedMeterProvider):
            _GLOBAL = current
            return _GLOBAL
        if type(current).__name__ not in ("_ProxyMeterProvider", "NoOpMeterProvider"):
            _log.warning(
                "otel-rl: a global MeterProvider (%s) is already set; meters from "
                "opentelemetry.metrics.get_meter() go there, not to otel-rl's trackers. Use "
                "Logger.meter_provider to create instruments that reach them.",
                type(current).__name__,
            )
            return None
        router = RoutedMeterProvider()
        otel_metrics.set_meter_provider(router)
        _GLOBAL = router
        return router


def reset_after_fork() -> None:
    """Fresh locks in a fork child (called by :mod:`otel_rl.process.lifecycle`'s fork hook)."""
    global _GLOBAL_LOCK
    _GLOBAL_LOCK = threading.Lock()
    if _GLOBAL is not None:
        _GLOBAL.reset_after_fork()
