"""Encoder slots shared between tenants (`slots.FairSlots`), with no sockets: shares, turns,
bounded waits, and a slot given back whatever way its holder ends."""

from __future__ import annotations

import asyncio

import pytest

from ecshare.apps.proxy.slots import FairSlots, SlotTimeout


async def hold(slots: FairSlots, tenant: str, order: list[str], release: asyncio.Event) -> None:
    async with slots.slot(tenant):
        order.append(tenant)
        await release.wait()


def test_one_tenant_holds_at_most_its_share_and_another_finds_a_slot_at_once() -> None:
    async def run() -> None:
        slots = FairSlots(total=4, per_tenant=2, wait_s=10)
        order: list[str] = []
        release = asyncio.Event()
        flood = [asyncio.create_task(hold(slots, "flood", order, release)) for _ in range(6)]
        await asyncio.sleep(0)
        assert (slots.held("flood"), slots.waiting()) == (2, 4)
        victim = asyncio.create_task(hold(slots, "victim", order, release))
        await asyncio.sleep(0)
        assert order == ["flood", "flood", "victim"]
        release.set()
        await asyncio.gather(*flood, victim)
        assert slots.in_use == 0 and slots.waiting() == 0

    asyncio.run(run())


def test_waiting_tenants_are_served_in_turn_as_slots_free() -> None:
    async def run() -> None:
        slots = FairSlots(total=1, per_tenant=1, wait_s=10)
        order: list[str] = []
        gates = {t: asyncio.Event() for t in "abc"}
        first = asyncio.create_task(hold(slots, "a", order, gates["a"]))
        await asyncio.sleep(0)
        # a queues three more calls before b and c each queue one.
        later = [asyncio.create_task(hold(slots, "a", order, gates["a"])) for _ in range(3)]
        later += [asyncio.create_task(hold(slots, t, order, gates[t])) for t in "bc"]
        await asyncio.sleep(0)
        for event in gates.values():
            event.set()
        await asyncio.gather(first, *later)
        # One slot at a time, in turn: b and c are not kept behind a's queue.
        assert order == ["a", "a", "b", "c", "a", "a"]

    asyncio.run(run())


def test_a_wait_past_its_bound_is_a_slot_timeout_and_leaves_no_trace() -> None:
    async def run() -> None:
        slots = FairSlots(total=1, per_tenant=1, wait_s=0.05)
        release = asyncio.Event()
        holder = asyncio.create_task(hold(slots, "a", [], release))
        await asyncio.sleep(0)
        with pytest.raises(SlotTimeout):
            async with slots.slot("b"):
                pass
        assert slots.waiting() == 0 and slots.held("b") == 0
        release.set()
        await holder
        async with slots.slot("b"):
            assert slots.held("b") == 1
        assert slots.in_use == 0

    asyncio.run(run())


def test_a_cancelled_waiter_and_a_cancelled_holder_give_everything_back() -> None:
    async def run() -> None:
        slots = FairSlots(total=1, per_tenant=1, wait_s=10)
        release = asyncio.Event()
        holder = asyncio.create_task(hold(slots, "a", [], release))
        waiter = asyncio.create_task(hold(slots, "b", [], release))
        await asyncio.sleep(0)
        waiter.cancel()
        holder.cancel()
        await asyncio.gather(holder, waiter, return_exceptions=True)
        assert (slots.in_use, slots.waiting(), slots.held("a"), slots.held("b")) == (0, 0, 0, 0)

    asyncio.run(run())


def test_a_slot_handed_to_a_waiter_in_the_turn_it_is_cancelled_is_given_back() -> None:
    async def run() -> None:
        slots = FairSlots(total=1, per_tenant=1, wait_s=10)
        release = asyncio.Event()
        holder = asyncio.create_task(hold(slots, "a", [], release))
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold(slots, "b", [], asyncio.Event()))
        await asyncio.sleep(0)
        release.set()
        waiter.cancel()  # before it runs again: the slot is handed to it meanwhile
        await asyncio.gather(holder, waiter, return_exceptions=True)
        assert (slots.in_use, slots.waiting()) == (0, 0)

    asyncio.run(run())


def test_resized_slots_hand_out_what_grew_and_none_past_what_shrank() -> None:
    async def run() -> None:
        slots = FairSlots(total=2, per_tenant=2, wait_s=10)
        order: list[str] = []
        release = asyncio.Event()
        calls = [asyncio.create_task(hold(slots, "a", order, release)) for _ in range(5)]
        await asyncio.sleep(0)
        assert (slots.in_use, slots.waiting()) == (2, 3)
        slots.resize(4, 3)  # an encoder joined: waiting calls start at once, up to the share
        await asyncio.sleep(0)
        assert (slots.in_use, slots.waiting()) == (3, 2)
        slots.resize(1, 1)  # it left: the three keep their slots, no new one is handed out
        await asyncio.sleep(0)
        assert (slots.in_use, slots.waiting()) == (3, 2)
        release.set()
        await asyncio.gather(*calls)
        assert slots.in_use == 0 and slots.waiting() == 0 and len(order) == 5

    asyncio.run(run())
