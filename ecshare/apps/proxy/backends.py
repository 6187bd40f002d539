"""Backend instances, which of them are in rotation, and the health checks that decide it.

A backend is in rotation (`healthy`) or ejected. It is ejected at once when a connection to
it is refused or a health check fails, and after `eject_after` consecutive failed calls
(timeouts, 5xx answers) unless it is the last one in rotation; only a passing health check
(`GET /health` answering 200) brings it back. Calls go to the healthy backend with the
fewest calls in flight, ties taken in turn, so one slow instance does not collect a queue
while another idles.

Backends join and leave while the proxy runs (`add`, `remove`; `discovery` decides when):
one that joins is out of rotation until its first health check passes, and one that
leaves gets no new calls, while those already under way finish.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

import aiohttp
from yarl import URL

from ecshare.apps.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

ENCODER = "encoder"
PREFILL_DECODE = "prefill_decode"
PREFILL = "prefill"  # prefill only (--prefill), its KV handed to DECODE instances
DECODE = "decode"


def describe(exc: BaseException) -> str:
    """An exception in one short line, for logs and error messages."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Backend:
    """One instance's base URL and what the proxy knows of it now."""

    __slots__ = ("_urls", "failures", "healthy", "in_flight", "role", "url")

    def __init__(self, url: str, role: str) -> None:
        self.url = url.rstrip("/")
        self.role = role
        self.healthy = True  # until a call or a health check says otherwise
        self.in_flight = 0
        self.failures = 0  # consecutive failed calls
        self._urls: dict[str, URL] = {}

    def url_for(self, path: str) -> URL:
        """The URL of `path` on this backend, parsed once rather than on every request."""
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = URL(self.url + path)
        return url

    def __repr__(self) -> str:
        state = "up" if self.healthy else "ejected"
        return f"Backend({self.role} {self.url} {state}, {self.in_flight} in flight)"


class BackendPool:
    """The backends of one role: picking one for a call, ejecting and restoring them."""

    def __init__(
        self, role: str, urls: Sequence[str], *, eject_after: int, metrics: ProxyMetrics
    ) -> None:
        self.role = role
        self.backends = tuple(Backend(u, role) for u in urls)
        self._eject_after = eject_after
        self._metrics = metrics
        self._turn = 0
        for b in self.backends:
            metrics.backend_up.labels(role, b.url).set(1)

    def __len__(self) -> int:
        return len(self.backends)

    def get(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.backends if b.url == url), None)

    def add(self, url: str) -> Backend | None:
        """A new backend, out of rotation until a health check passes; None if already here."""
        if self.get(url) is not None:
            return None
        backend = Backend(url, self.role)
        backend.healthy = False
        self.backends = (*self.backends, backend)
        self._metrics.backend_up.labels(self.role, backend.url).set(0)
        log.warning("%s %s joined; in rotation once healthy", self.role, backend.url)
        return backend

    def remove(self, url: str) -> Backend | None:
        """Take `url` out for good (calls under way finish); None if it is not here."""
        backend = self.get(url)
        if backend is None:
            return None
        self.backends = tuple(b for b in self.backends if b is not backend)
        backend.healthy = False
        self._metrics.backend_up.labels(self.role, backend.url).set(0)
        log.warning("%s %s left", self.role, backend.url)
        return backend

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Collection[Backend] = ()) -> Backend | None:
        """The healthy backend with the fewest calls in flight (None when there is none)."""
        n = len(self.backends)
        best: Backend | None = None
        start = self._turn
        self._turn = (start + 1) % n if n else 0
        for i in range(n):
            b = self.backends[(start + i) % n]
            if b.healthy and b not in exclude and (best is None or b.in_flight < best.in_flight):
                best = b
        return best

    @contextmanager
    def call(self, backend: Backend) -> Iterator[Backend]:
        """Count a call to `backend` as in flight for the duration of the block."""
        backend.in_flight += 1
        try:
            yield backend
        finally:
            backend.in_flight -= 1

    def succeeded(self, backend: Backend) -> None:
        backend.failures = 0

    def failed(self, backend: Backend, why: str, *, eject: bool = False) -> None:
        """Note a failed call; eject now when `eject` or after enough failures in a row.

        Failures in a row never eject the last backend in rotation: an instance that answers
        5xx to some requests may still answer others, and with nothing left every request
        would fail until the next health check. A refused connection (`eject`) does.
        """
        backend.failures += 1
        if eject:
            self._set(backend, False, why)
        elif backend.failures >= self._eject_after and len(self.healthy()) > 1:
            self._set(backend, False, f"{backend.failures} failures in a row, the last: {why}")

    def _set(self, backend: Backend, healthy: bool, why: str) -> None:
        if backend.healthy == healthy:
            return
        backend.healthy = healthy
        if healthy:
            backend.failures = 0
        self._metrics.backend_up.labels(self.role, backend.url).set(1 if healthy else 0)
        if healthy:
            log.warning("%s %s is back in rotation", self.role, backend.url)
        else:
            log.warning("%s %s ejected: %s", self.role, backend.url, why)

    async def check(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        """Health-check every backend at once; eject the failing, restore the passing."""
        await asyncio.gather(*(self.check_one(session, b, timeout_s) for b in self.backends))

    async def check_one(
        self, session: aiohttp.ClientSession, backend: Backend, timeout_s: float
    ) -> None:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        try:
            async with session.get(backend.url_for("/health"), timeout=timeout) as resp:
                await resp.read()
                ok, why = resp.status == 200, f"health check answered {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            ok, why = False, f"health check failed: {describe(exc)}"
        if any(b is backend for b in self.backends):  # not one that left meanwhile
            self._set(backend, ok, why)


async def watch_health(
    session: aiohttp.ClientSession,
    pools: Sequence[BackendPool],
    *,
    interval_s: float,
    timeout_s: float,
) -> None:
    """Health-check all pools every `interval_s` seconds, starting now, until cancelled."""
    while True:
        try:
            await asyncio.gather(*(p.check(session, timeout_s) for p in pools))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one round must not end the checks for good
            log.exception("health check round failed")
        await asyncio.sleep(interval_s)
