"""The life of a peer's own network thread: start, report start-up errors, stop.

Producer and Consumer each run their network work on one thread. Start-up
(binding sockets) happens on that thread, so `start()` waits until it is
ready and re-raises whatever stopped it; `stop()` wakes and joins it. With
`metrics_port` set, the peer (and its store) is served as Prometheus metrics
from `start()` to `stop()` (see ecshare/metrics.py).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, TypeVar

from ecshare.config import Config
from ecshare.control import Waker
from ecshare.store import Store
from ecshare.transport.base import DataTransport

if TYPE_CHECKING:
    from ecshare.metrics import Exposure

_T = TypeVar("_T", bound="NetworkThread")
# Binding sockets and creating the first objects takes milliseconds; this only
# bounds a start-up that hangs.
_START_TIMEOUT_S = 30.0


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
        self._metrics: Exposure | None = None

    def _run(self) -> None:
        """The thread's body: set up, then `_started(None)` or `_started(exc)`, then serve."""
        raise NotImplementedError

    def _started(self, error: BaseException | None) -> None:
        self._startup_error = error
        self._ready.set()

    def start(self: _T) -> _T:
        region = self._store.region
        self._transport.register(region.address, region.size)
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-net", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=_START_TIMEOUT_S)
        if self._startup_error is not None:
            raise self._startup_error
        if self._config.metrics_port is not None:
            # Imported here: the metrics module reads peers, so it sits above them.
            from ecshare.metrics import expose

            try:
                self._metrics = expose(self._config, self._store, self)
            except BaseException:
                self.stop()
                raise
        return self

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
        """Where this peer's Prometheus metrics are served (metrics_port), or None."""
        return self._metrics.url if self._metrics is not None else None

    def stop(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        self._stop.set()
        if self._waker is not None:
            self._waker.wake()
        if self._thread is not None:
            self._thread.join(timeout=self._config.shutdown_timeout_s)
            self._thread = None

    def __enter__(self: _T) -> _T:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
