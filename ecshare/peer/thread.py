"""The life of a peer's own network thread: start, report start-up errors, stop.

Producer and Consumer each run their network work on one thread. Start-up
(binding sockets) happens on that thread, so `start()` waits until it is
ready and re-raises whatever stopped it; `stop()` wakes and joins it.
"""

from __future__ import annotations

import threading
from typing import TypeVar

from ecshare.config import Config
from ecshare.control import Waker
from ecshare.store import Store
from ecshare.transport.base import DataTransport

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
        return self

    def stop(self) -> None:
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
