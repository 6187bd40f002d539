"""Backend slots shared fairly between tenants: encoder calls, prefill/decode requests.

A stage of a proxy process has `total` calls in flight at most (`StageSlots` sizes it to
the stage's backends in rotation, so that what a backend cannot start at once waits here,
in turn, not inside the backend first come first served). One tenant holds at most
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

from ecshare.apps.proxy.backends import BackendPool
from ecshare.apps.proxy.errors import ProxyError


class SlotTimeout(Exception):
    """No slot came free for the tenant within the wait."""


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


class StageSlots:
    """A stage's `FairSlots`, sized to its backends in rotation: `per_backend` each (0: no
    bound per backend), at most `max_total` in all (None: none), a tenant's share
    `tenant_share` (None: half). A call past the wait is answered 429 (`reason`)."""

    def __init__(
        self,
        pool: BackendPool,
        *,
        per_backend: int,
        max_total: int | None,
        tenant_share: int | None,
        wait_s: float,
        calls: str,
        wait_flag: str,
        reason: str,
    ) -> None:
        self._pool = pool
        self._per_backend = per_backend
        self._max_total = max_total
        self._tenant_share = tenant_share
        self._calls, self._wait_flag, self._reason = calls, wait_flag, reason
        self.slots = FairSlots(1, 1, wait_s)
        self.fit()

    @property
    def bounded(self) -> bool:
        return bool(self._per_backend) or self._max_total is not None

    def fit(self) -> None:
        """Size the slots to the backends in rotation now (one's worth while there is none,
        so that a call finds out at once that none is there)."""
        totals = []
        if self._max_total is not None:
            totals.append(self._max_total)
        if self._per_backend:
            in_rotation = max(1, len(self._pool.healthy()))
            totals.append(self._per_backend * in_rotation)
        total = min(totals) if totals else 1 << 30
        share = self._tenant_share if self._tenant_share is not None else (total + 1) // 2
        self.slots.resize(total, max(1, min(share, total)))

    @asynccontextmanager
    async def slot(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of `tenant`'s slots for the block; `ProxyError` 429 past the wait."""
        if not self.bounded:
            yield
            return
        self.fit()
        try:
            async with self.slots.slot(tenant):
                yield
        except SlotTimeout:
            raise ProxyError(
                429,
                f"this tenant's {self._calls} waited {self.slots.wait_s:g} s for a slot "
                f"({self._wait_flag}; a tenant holds at most {self.slots.per_tenant} of "
                f"{self.slots.total}); retry later",
                reason=self._reason,
                retry_after=1,
            ) from None
