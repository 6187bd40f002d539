"""The life of a peer's own network thread: start, report start-up errors, stop.

Producer and Consumer each run their network work on one thread. Start-up
(binding sockets) happens on that thread, so `start()` waits until it is
ready and re-raises whatever stopped it; `stop()` wakes and joins it.

A peer knows nothing of how its stats are served. A layer above it (ecshare.metrics,
which serves Prometheus on `metrics_port`) adds an `Exporter` here; each started
peer is handed to every exporter from `start()` to `stop()`. The arrow points one
way: this module defines the hook, the layer above fills it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Protocol, TypeVar

from ecshare.config import Config
from ecshare.control import Waker
from ecshare.store import Store
from ecshare.transport.base import DataTransport, TransportError

_T = TypeVar("_T", bound="NetworkThread")
log = logging.getLogger(__name__)
# Binding sockets and creating the first objects takes milliseconds; this only
# bounds a start-up that hangs.
_START_TIMEOUT_S = 30.0
# How long past shutdown_timeout_s `stop()` waits for the thread's last steps.
_JOIN_GRACE_S = 2.0
_PR_SET_NAME = 15


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows it (top -H,
    /proc/PID/task/TID/comm), so that its CPU can be told apart; Python before 3.14
    leaves every thread with the process's name. Does nothing where prctl is missing."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


class Exported(Protocol):
    """What an exporter made of one peer: where it is served, and how to stop."""

    @property
    def url(self) -> str: ...

    def close(self) -> None: ...


# Called with each peer once it serves; None when it has nothing to serve (its
# config says so). Raising stops the peer's start.
Exporter = Callable[["NetworkThread"], "Exported | None"]
_exporters: list[Exporter] = []


def add_exporter(exporter: Exporter) -> None:
    """Hand every peer started from now on to `exporter` (once per exporter)."""
    if exporter not in _exporters:
        _exporters.append(exporter)


class NetworkThread:
    _store: Store
    _config: Config
    _transport: DataTransport
    _name: str

    def _init_thread(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._waker: Waker | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        # What killed the thread after start-up: set (by the thread, before it
        # cleans up) so that callers fail loudly instead of waiting on it.
        self.failure: BaseException | None = None
        self._exported: list[Exported] = []

    def _run(self) -> None:
        """The thread's body: set up, then `_started(None)` or `_started(exc)`, then serve."""
        raise NotImplementedError

    def _run_named(self) -> None:
        name_os_thread(f"ecshare-{type(self).__name__.lower()}")
        self._run()

    def _started(self, error: BaseException | None) -> None:
        self._startup_error = error
        self._ready.set()

    def start(self: _T) -> _T:
        region = self._store.region
        self._transport.register(region.address, region.size)
        self._thread = threading.Thread(
            target=self._run_named, name=f"{self._name}-net", daemon=True
        )
        self._thread.start()
        self._ready.wait(timeout=_START_TIMEOUT_S)
        if self._startup_error is not None:
            raise self._startup_error
        try:
            for exporter in tuple(_exporters):
                exported = exporter(self)
                if exported is not None:
                    self._exported.append(exported)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def config(self) -> Config:
        return self._config

    @property
    def store(self) -> Store:
        return self._store

    @property
    def healthy(self) -> bool:
        """Started, serving, and not killed by an error (see `failure` and the log)."""
        thread = self._thread
        return thread is not None and thread.is_alive() and self.failure is None

    @property
    def thread_ident(self) -> int | None:
        """The network thread's `threading` ident while it runs (for its CPU clock:
        `time.pthread_getcpuclockid`), else None."""
        thread = self._thread
        return thread.ident if thread is not None else None

    @property
    def metrics_url(self) -> str | None:
        """Where an exporter serves this peer's stats (Prometheus: metrics_port), or None."""
        return self._exported[0].url if self._exported else None

    def stop(self) -> None:
        exported, self._exported = self._exported, []
        for one in exported:
            one.close()
        self._stop.set()
        if self._waker is not None:
            self._waker.wake()
        if self._thread is not None:
            # The thread's own waits at shutdown end after shutdown_timeout_s; the grace
            # covers what follows them, so that the caller may close the transport after.
            self._thread.join(timeout=self._config.shutdown_timeout_s + _JOIN_GRACE_S)
            if self._thread.is_alive():
                log.warning(
                    "%s's network thread still runs %.1f s after stop; its transport "
                    "should not be closed under it",
                    self._name,
                    self._config.shutdown_timeout_s + _JOIN_GRACE_S,
                )
            self._thread = None

    def _ended_by_close(self, exc: BaseException) -> bool:
        """Whether `exc` is only the owner closing our data plane after asking us to
        stop (a stop that gave up waiting): an end, not a failure."""
        return self._stop.is_set() and isinstance(exc, TransportError)

    def __enter__(self: _T) -> _T:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
