"""The sockets around the item directory: one CURVE SUB per watched backend, in the event loop.

Each backend's item feed (`ecshare.peer.items`) is read by a task of its own, which hands
every message to the `ItemDirectory`. When the directory asks for a snapshot (a gap, a
restart, a forgotten picture), the task unsubscribes and subscribes again, which makes the
feed send one; it asks again every `resync_s` while the picture is not synced. A backend
silent past `timeout_s` (its feed heartbeats every second) is forgotten until it speaks
again. A message that does not decode is dropped and counted.

The proxy authenticates each feed by the public key its role publishes under, and the
feed admits the proxy's key only if it is on the instance's admin list: a wrong key on
either side gets no messages at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from yarl import URL

from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.control import KeyPair
from ecshare.peer.items import MAX_FEED_MESSAGE_BYTES, decode

log = logging.getLogger(__name__)


def events_address(backend_url: str, port: int) -> str:
    """The feed of the instance at `backend_url`: its host, the given port."""
    host = URL(backend_url).host
    if not host:
        raise ValueError(f"{backend_url!r} names no host")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class DirectoryFeeds:
    """Feeds an `ItemDirectory` from the backends' item events, until `close()`."""

    def __init__(
        self,
        directory: ItemDirectory,
        *,
        keys: KeyPair | None,
        timeout_s: float = 5.0,
        resync_s: float = 1.0,
        context: zmq.asyncio.Context | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._keys = keys
        self._timeout_s = timeout_s
        self._resync_s = resync_s
        self._context = context if context is not None else zmq.asyncio.Context()
        self._own_context = context is None
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._ending: set[asyncio.Task[None]] = set()  # cancelled, closing their socket
        self._stats = {"bad_messages": 0, "resync_requests": 0}

    def watch(self, backend: str, address: str, *, encoder: bool, server_key: bytes | None) -> None:
        """Subscribe to `backend`'s feed at `address` (tcp://HOST:PORT), which must present
        `server_key` (None: no CURVE, only where the proxy was told its feeds are insecure)."""
        if backend in self._tasks:
            self.directory.watch(backend, encoder=encoder)
            return
        if (server_key is None) != (self._keys is None):
            raise ValueError("a feed's server key and the proxy's own key go together")
        sock: zmq.asyncio.Socket = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FEED_MESSAGE_BYTES)
        if self._keys is not None and server_key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self._keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self._keys.secret)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(address)
        self.directory.watch(backend, encoder=encoder)
        self._tasks[backend] = asyncio.get_running_loop().create_task(
            self._pump(backend, sock), name=f"ecshare-feed {backend}"
        )
        log.info("item directory: watching %s at %s", backend, address)

    def unwatch(self, backend: str) -> None:
        """Stop reading `backend`'s feed and forget what it held."""
        task = self._tasks.pop(backend, None)
        if task is not None:
            task.cancel()
            self._ending.add(task)
            task.add_done_callback(self._ending.discard)
        self.directory.unwatch(backend)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def close(self) -> None:
        for backend in list(self._tasks):
            self.unwatch(backend)
        for task in list(self._ending):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._own_context:
            self._context.destroy(linger=0)

    async def _pump(self, backend: str, sock: zmq.asyncio.Socket) -> None:
        asked = -float("inf")
        wait_ms = int(min(self._timeout_s, self._resync_s) * 1000 / 2) + 1
        try:
            while True:
                if await sock.poll(wait_ms):
                    data: Any = await sock.recv()
                    try:
                        message = decode(data)
                    except (msgspec.ValidationError, msgspec.DecodeError):
                        self._stats["bad_messages"] += 1
                        continue
                    want = self.directory.apply(backend, message, self._clock())
                else:
                    self.directory.expire(self._clock(), self._timeout_s)
                    want = not self.directory.synced(backend)
                now = self._clock()
                if want and now - asked >= self._resync_s:
                    asked = now
                    self._stats["resync_requests"] += 1
                    sock.setsockopt(zmq.UNSUBSCRIBE, b"")
                    sock.setsockopt(zmq.SUBSCRIBE, b"")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("item directory: the feed of %s failed; forgetting it", backend)
            self.directory.forget(backend)
        finally:
            sock.close(0)
