"""What the engine's scheduler side pins, in real vLLM Schedulers (see conftest.py).

An item the connector reports present must stay present until its load has
copied, whatever the consumer thread's allocations evict meanwhile; a fetched
item stays with the request that waits for it; every pin is released by its
own grant; and pins whose release was lost are reaped, also on an instance
that runs no Producer (whose reaper would otherwise do it).

The region pressure of a concurrent fetch is made by allocating in the same
store from the test, at the moment in `schedule()` the consumer thread could:
`allocate_slots` runs between `has_cache_item` and `update_state_after_alloc`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import EC, Step, embedding, fill_region, ready
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from ecshare import protocol as p
from ecshare.vllm.pins import ENGINE_PIN_OWNER

SMALL_REGION = {"region_bytes": 1 << 20, "block_bytes": 4096}  # 256 blocks


def on_allocate_slots(scheduler: Scheduler, hook: Callable[[], None]) -> None:
    """Run `hook` the first time the scheduler allocates KV slots: after it asked
    has_cache_item, before it calls update_state_after_alloc."""
    manager = scheduler.kv_cache_manager
    real = manager.allocate_slots
    fired = False

    def allocate_slots(*args: Any, **kwargs: Any) -> Any:
        nonlocal fired
        if not fired:
            fired = True
            hook()
        return real(*args, **kwargs)

    manager.allocate_slots = allocate_slots  # type: ignore[method-assign]


@pytest.mark.parametrize("role", ["ec_consumer", "ec_both"])
def test_item_reported_present_stays_until_its_load_is_planned(ec: EC, role: str) -> None:
    consumer = ec.scheduler(role, **SMALL_REGION)
    store = ec.side(consumer).store
    emb = embedding()
    store.put("h-present", emb)
    consumer.add_request(ec.request("c1", "h-present"))
    refused: list[bool] = []
    on_allocate_slots(consumer, lambda: refused.append(not fill_region(store, "other-fetch")))

    step = ec.step(consumer, {})  # nothing to encode with: the item must be loaded

    assert refused == [True], "the region gave away the blocks of an item reported present"
    assert step.out.scheduled_encoder_inputs == {}
    assert [op.mm_hash for op in step.plan.loads] == ["h-present"]
    assert torch.equal(step.encoder_cache["h-present"], emb)
    assert store.stats().pins == 0  # the load's pin went with its report


def test_fetched_item_stays_pinned_while_its_request_waits(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    # KV for 3 blocks of 16 tokens: the running request leaves too few for the second.
    consumer = ec.scheduler("ec_consumer", kv_blocks=4, **SMALL_REGION)
    side = ec.side(consumer)
    emb = embedding()
    params = ec.encode(producer, "p1", "h-wait", emb)
    consumer.add_request(ec.request("running", "h-other", max_tokens=8))
    step = ec.step(consumer, {"h-other": embedding()})
    assert "running" in step.scheduled
    # No media: if its item were lost while it waits, nothing could encode it.
    consumer.add_request(ec.request("c1", "h-wait", params=params, media=False))

    step = ec.step(consumer)  # starts its fetch; no KV room for it yet
    assert "c1" not in step.scheduled
    deadline = time.monotonic() + 10
    while not ready(side.store, "h-wait"):  # the consumer thread fetches meanwhile
        assert time.monotonic() < deadline, "the fetch never completed"
        time.sleep(0.002)
    step = ec.step(consumer)  # its fetch settles while it waits for KV blocks
    assert "c1" not in step.scheduled and "running" in step.scheduled
    assert not fill_region(side.store, "other-fetch"), "a waiting request's item was evicted"

    seen: list[Step] = []
    while not seen or "c1" not in seen[-1].scheduled:
        out = consumer.schedule()
        assert "c1" not in out.scheduled_encoder_inputs, "its item is gone: encoded instead"
        seen.append(ec.run_workers(consumer, out))
        assert time.monotonic() < deadline + 10, "never scheduled"
    assert [op.mm_hash for op in seen[-1].plan.loads] == ["h-wait"]
    assert torch.equal(seen[-1].encoder_cache["h-wait"], emb)


def test_report_of_one_step_never_releases_the_pin_planned_for_the_next(ec: EC) -> None:
    consumer = ec.scheduler("ec_consumer", async_scheduling=True, **SMALL_REGION)
    store = ec.side(consumer).store
    emb = embedding()
    store.put("h-async", emb)

    consumer.add_request(ec.request("a", "h-async", max_tokens=4))
    first = ec.run_workers(consumer, consumer.schedule(), report=False)
    assert [op.mm_hash for op in first.plan.loads] == ["h-async"]
    # The engine's encoder cache lets go of the item (as an eviction under pressure, or a
    # weight reload, does), so the next step loads it again: the same mm_hash, a new grant.
    consumer.reset_encoder_cache()
    consumer.add_request(ec.request("b", "h-async", max_tokens=4))
    # Async scheduling: step N+1 is planned before step N's output is processed.
    second_out = consumer.schedule()
    assert [op.mm_hash for op in second_out.ec_connector_metadata.plan.loads] == ["h-async"]

    ec.finish_step(consumer, first)  # step N's report: its own load copied
    assert not fill_region(store, "other-fetch"), "step N's report released step N+1's pin"

    second = ec.run_workers(consumer, second_out)
    assert torch.equal(second.encoder_cache["h-async"], emb)
    assert store.stats().pins == 0


LOST_REPORT_TIMING = {
    "engine_pin_s": 0.5,
    "fetch_deadline_base_s": 0.3,
    "fetch_deadline_max_s": 0.4,
    "request_timeout_s": 0.2,
    "reap_interval_s": 0.05,
}


def test_consumer_only_instance_reaps_pins_whose_report_was_lost(ec: EC) -> None:
    consumer = ec.scheduler("ec_consumer", **LOST_REPORT_TIMING)
    side = ec.side(consumer)
    assert side.producer is None  # no Producer reaper on this instance
    side.store.put("h-lost", embedding())
    consumer.add_request(ec.request("c1", "h-lost", max_tokens=1))

    step = ec.step(consumer, report=False)
    assert [op.mm_hash for op in step.plan.loads] == ["h-lost"]
    assert ec.worker(consumer).take_report() is not None  # the report is lost on the way
    ec.finish_step(consumer, step)
    assert side.store.stats().pins == 1

    time.sleep(0.6)  # past the load's lease
    ec.step(consumer)

    assert side.store.stats().pins == 0
    assert ec.totals(consumer)["pins_reaped"] == 1
    # With its pin gone the entry is evictable again: the region is not lost for good.
    assert fill_region(side.store, "next-fetch")


@pytest.mark.parametrize("outcome", ["in_flight", "completes_later"])
def test_aborted_request_leaves_no_fetch_and_no_pin_behind(ec: EC, outcome: str) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    side = ec.side(consumer)
    params = ec.encode(producer, "p1", "h-abort", embedding())
    if outcome == "in_flight":
        # A producer endpoint that accepts nothing: the fetch stays in flight.
        params = {"h-abort": {**params["h-abort"], "peer": "tcp://127.0.0.1:9"}}
    consumer.add_request(ec.request("c1", "h-abort", params=params))
    step = ec.step(consumer)
    assert "c1" not in step.scheduled and side.pending_fetches() == 1

    consumer.finish_requests("c1", RequestStatus.FINISHED_ABORTED)

    assert side.pending_fetches() == 0
    if outcome == "completes_later":
        deadline = time.monotonic() + 10
        while not ready(side.store, "h-abort"):
            assert time.monotonic() < deadline, "the fetch never completed"
            time.sleep(0.005)
    ec.step(consumer)
    # The entry turns READY a moment before its fetch's future is resolved (at the end
    # of the consumer thread's pass): the step that sees it settled lets the pin go.
    deadline = time.monotonic() + 5
    while side.store.stats().pins and time.monotonic() < deadline:
        time.sleep(0.01)
        ec.step(consumer)
    assert side.store.stats().pins == 0
    assert ec.totals(consumer)["fetches_abandoned"] == 1


def test_no_session_id_can_name_the_engines_pin_owner() -> None:
    """A producer session's pins are owned by its session id, which the client chooses; the
    engine's own pins share the entry table, and ending a session releases its owner's pins.
    No session id may be the engine's owner name (it is longer than any can be)."""

    def hello(session_id: str) -> bytes:
        message = p.Hello(versions=[2], session_id=session_id, client_name="c", fingerprint="f")
        return p.encode(message)

    p.decode(hello("x" * (len(ENGINE_PIN_OWNER) - 1)))  # the longest session id there is
    with pytest.raises(p.ProtocolError):
        p.decode(hello(ENGINE_PIN_OWNER))
