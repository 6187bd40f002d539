"""Encoder slots shared fairly between tenants.

A proxy process has `total` encoder calls in flight at most. One tenant holds at most
`per_tenant` of them, so however hard it bursts, the rest stay for the others. A call
that finds no slot waits in its tenant's queue; when a slot frees, it goes to the next
tenant in turn (round robin over the tenants with a call waiting and under their share),
and within a tenant, first come first served. A tenant over its share therefore never
delays another tenant's call: a waiting tenant is served at the next free slot, before
the flooding tenant's next call.

A call waits at most `wait_s`; past it, `SlotTimeout` (the proxy answers 429 with
`Retry-After`). Where the proxy has no keys every client is one tenant, `default`, and
the shares mean nothing between clients (docs/SECURITY.md says so).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress


class SlotTimeout(Exception):
    """No encoder slot came free for the tenant within the wait."""


class FairSlots:
    """`total` slots, at most `per_tenant` to one tenant, handed out in turn."""

    def __init__(self, total: int, per_tenant: int, wait_s: float) -> None:
        self.total = total
        self.per_tenant = per_tenant
        self.wait_s = wait_s
        self.in_use = 0
        self._held: dict[str, int] = {}
        # Tenants with calls waiting, in turn order; each with its waiters, oldest first.
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()

    def resize(self, total: int, per_tenant: int) -> None:
        """Hold `total` slots from now, at most `per_tenant` to one tenant. Calls holding
        more than that keep their slots; no new one is handed out until they are back
        under it."""
        grew = total > self.total or per_tenant > self.per_tenant
        self.total, self.per_tenant = total, per_tenant
        if grew:
            self._hand_out()

    def held(self, tenant: str) -> int:
        return self._held.get(tenant, 0)

    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one slot for `tenant` for the block; `SlotTimeout` past the wait."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._release(tenant)

    async def _acquire(self, tenant: str) -> None:
        if tenant not in self._waiting and self._free_for(tenant):
            self._take(tenant)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.wait_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                self._release(tenant)  # given a slot in the same turn it gave up
            else:
                waiter.cancel()
                self._drop(tenant, waiter)
            if isinstance(exc, asyncio.TimeoutError):
                raise SlotTimeout(f"no encoder slot came free within {self.wait_s:g} s") from None
            raise

    def _free_for(self, tenant: str) -> bool:
        return self.in_use < self.total and self.held(tenant) < self.per_tenant

    def _take(self, tenant: str) -> None:
        self.in_use += 1
        self._held[tenant] = self.held(tenant) + 1

    def _release(self, tenant: str) -> None:
        self.in_use -= 1
        left = self._held[tenant] - 1
        if left:
            self._held[tenant] = left
        else:
            del self._held[tenant]
        self._hand_out()

    def _drop(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is None:
            return
        with suppress(ValueError):
            queue.remove(waiter)
        if not queue:
            del self._waiting[tenant]

    def _hand_out(self) -> None:
        """Give free slots to waiting tenants in turn."""
        while self.in_use < self.total:
            tenant = next((t for t in self._waiting if self.held(t) < self.per_tenant), None)
            if tenant is None:
                return
            queue = self._waiting.pop(tenant)
            waiter = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # to the back of the turn
            self._take(tenant)
            waiter.set_result(None)
