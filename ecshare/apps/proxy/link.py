"""A proxy worker's end of its channel to the supervisor (`shared` has the protocol).

`SupervisorLink.start` applies the registered members the supervisor sends first before
the worker serves, then reads the channel in the worker's event loop (no polling: it waits
on the socket). From then on:

* a registration through this worker is relayed (`Membership.relay`) and answered once
  this worker has applied the set that says it; every other worker gets the same set at
  the same time;
* `SharedFlights` makes the routing's single flight hold across workers: a content is
  encoded by one request of one worker, and the requests of every worker carrying it
  wait for that one encode.

When the channel closes (the supervisor ended, or it dropped this worker for not reading),
the worker stops (SIGTERM to itself): a worker that no longer hears of membership changes
must not go on serving, and the supervisor, if alive, starts a fresh one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
import socket

from ecshare.apps.proxy.discovery import Membership
from ecshare.apps.proxy.routing import SingleFlight
from ecshare.apps.proxy.shared import (
    HEADER_BYTES,
    MAX_TO_WORKER_BYTES,
    Change,
    Changed,
    Claim,
    Claimed,
    FrameError,
    Land,
    Landed,
    Members,
    ToSupervisor,
    decode_to_worker,
    frame,
    read_length,
)
from ecshare.protocol import TransferParam

log = logging.getLogger(__name__)

FIRST_MEMBERS_TIMEOUT_S = 30.0

Outcome = tuple[set[tuple[str, str]], set[tuple[str, str]]]  # (joined, left)


class SupervisorLink:
    """This worker's channel to its supervisor, on an inherited socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._task: asyncio.Task[None] | None = None
        self._membership: Membership | None = None
        self._applying: asyncio.Task[Outcome] | None = None
        self._ids = itertools.count()
        self._changes: dict[int, asyncio.Future[tuple[bool, Outcome | None]]] = {}
        self._claims: dict[str, collections.deque[asyncio.Future[bool]]] = {}
        self.flights = SharedFlights(self)
        self._closing = False

    async def start(self, membership: Membership | None) -> None:
        """Apply the supervisor's first set of members, then follow the channel."""
        self._membership = membership
        self._reader, self._writer = await asyncio.open_unix_connection(sock=self._sock)
        async with asyncio.timeout(FIRST_MEMBERS_TIMEOUT_S):
            first = await self._read()
        if not isinstance(first, Members):
            raise FrameError(f"the supervisor's first message is {type(first).__name__}")
        self._applying = asyncio.create_task(self._apply(first, None))
        await self._applying
        if membership is not None:
            membership.relay = self.change
        self._task = asyncio.create_task(self._follow(), name="ecshare-proxy supervisor link")

    async def close(self) -> None:
        self._closing = True
        for task in (self._task, self._applying):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._writer is not None:
            self._writer.close()
        self._fail_pending()

    async def change(self, join: bool, role: str, url: str) -> bool:
        """Register (`join`) or unregister a member in every worker; True when it joined
        (left) this worker's pool, as `Membership.join` (`leave`) would say."""
        change_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._changes[change_id] = future
        try:
            self._send(Change(change_id, join, role, url))  # type: ignore[arg-type]
            changed, outcome = await future
        finally:
            self._changes.pop(change_id, None)
        if not changed or outcome is None:
            return False
        return (role, url) in outcome[0 if join else 1]

    async def claim(self, key: str) -> bool:
        """Whether this worker leads the flight of `key` (True too where the channel is
        gone: then it is this worker's alone)."""
        future = asyncio.get_running_loop().create_future()
        if not self._send(Claim(key)):
            return True
        # The supervisor answers the claims of one key in the order they were sent.
        self._claims.setdefault(key, collections.deque()).append(future)
        return await asyncio.shield(future)

    def land(self, key: str, result: object) -> None:
        mm_hash, param = _parts(result)
        self._send(Land(key, mm_hash, param))

    def _send(self, message: ToSupervisor) -> bool:
        if self._writer is None or self._writer.is_closing():
            return False
        self._writer.write(frame(message))
        return True

    async def _read(self) -> Members | Changed | Claimed | Landed:
        assert self._reader is not None
        size = read_length(await self._reader.readexactly(HEADER_BYTES))
        if size > MAX_TO_WORKER_BYTES:
            raise FrameError(f"a frame of {size} bytes from the supervisor")
        return decode_to_worker(await self._reader.readexactly(size))

    async def _follow(self) -> None:
        try:
            while True:
                message = await self._read()
                if isinstance(message, Members):
                    self._applying = asyncio.create_task(self._apply(message, self._applying))
                elif isinstance(message, Changed):
                    future = self._changes.get(message.id)
                    if future is not None:
                        # The set it changed came just before: answer once it is applied.
                        self._answer(future, message.changed, self._applying)
                elif isinstance(message, Claimed):
                    waiting = self._claims.get(message.key)
                    if waiting:
                        claim = waiting.popleft()
                        if not waiting:
                            del self._claims[message.key]
                        if not claim.done():
                            claim.set_result(message.lead)
                else:
                    self.flights.landed(message.key, _result(message.mm_hash, message.param))
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError, FrameError) as exc:
            if not self._closing:
                log.error("proxy worker: the channel to the supervisor closed (%s); stopping", exc)
                self._fail_pending()
                os.kill(os.getpid(), signal.SIGTERM)

    def _answer(
        self,
        future: asyncio.Future[tuple[bool, Outcome | None]],
        changed: bool,
        applying: asyncio.Task[Outcome] | None,
    ) -> None:
        def done(task: asyncio.Task[Outcome]) -> None:
            if not future.done():
                ok = not task.cancelled() and task.exception() is None
                future.set_result((changed, task.result() if ok else None))

        if not changed or applying is None:
            future.set_result((changed, None))
        else:
            applying.add_done_callback(done)

    async def _apply(self, members: Members, before: asyncio.Task[Outcome] | None) -> Outcome:
        if before is not None:
            with contextlib.suppress(Exception):
                await before
        if self._membership is None:
            return set(), set()
        return await self._membership.apply_registered(set(members.registered))

    def _fail_pending(self) -> None:
        for future in self._changes.values():
            if not future.done():
                future.set_result((False, None))
        for waiting in self._claims.values():
            for claim in waiting:
                if not claim.done():
                    claim.set_result(True)
        self._claims.clear()
        self.flights.land_all(None)


class SharedFlights(SingleFlight):
    """The routing's single flight, held across the workers of one supervisor: the
    requests of this worker share one flight (as `SingleFlight`), and that flight leads
    or waits for the one of another worker."""

    def __init__(self, link: SupervisorLink) -> None:
        super().__init__()
        self._link = link
        self._led: set[str] = set()

    async def join(self, key: str) -> asyncio.Future[object] | None:
        flight = self._flights.get(key)
        if flight is not None:
            return flight
        flight = self._flights[key] = asyncio.get_running_loop().create_future()
        try:
            lead = await self._link.claim(key)
        except BaseException:
            self.land(key, None)  # gave up before the answer: whatever it was, it ends
            raise
        if lead:
            self._led.add(key)
            return None
        return flight

    def land(self, key: str, result: object) -> None:
        super().land(key, result)
        self._led.discard(key)
        self._link.land(key, result)

    def landed(self, key: str, result: object) -> None:
        """Another worker's flight of `key` is over."""
        if key not in self._led:
            super().land(key, result)

    def land_all(self, result: object) -> None:
        for key in list(self._flights):
            super().land(key, result)


def _parts(result: object) -> tuple[str | None, TransferParam | None]:
    if isinstance(result, tuple) and len(result) == 2:
        mm_hash, param = result
        if isinstance(mm_hash, str) and isinstance(param, TransferParam):
            return mm_hash, param
    return None, None


def _result(mm_hash: str | None, param: TransferParam | None) -> object:
    return (mm_hash, param) if mm_hash is not None and param is not None else None
