"""vLLM scheduling features with the connector, in real vLLM Schedulers (see conftest.py).

Chunked prefill, prefix caching and preemption each change when, and how often,
the engine needs a request's encoder outputs. The requests here carry no media
(`media=False`): an item the connector failed to provide could not be encoded,
and the engine would fail; so each test shows the item is there exactly when
needed, and fetched no more often than needed.
"""

from __future__ import annotations

import time

import torch
from conftest import EC, Step, embedding, fill_region, ready
from vllm.v1.core.sched.scheduler import Scheduler

from ecshare.store import Store

SMALL_REGION = {"region_bytes": 1 << 20, "block_bytes": 4096}


def evict_all(store: Store) -> None:
    """Take every block an allocation can get, as other fetches would, and give them back."""
    assert fill_region(store, "other"), "something is still pinned"
    store.remove("other")


def run(ec: EC, scheduler: Scheduler, until: str, timeout_s: float = 15.0) -> list[Step]:
    """Step until request `until` finishes; the steps. No step may encode anything."""
    steps: list[Step] = []
    deadline = time.monotonic() + timeout_s
    while not steps or steps[-1].finished(until) is None:
        out = scheduler.schedule()
        assert not out.scheduled_encoder_inputs, "an item without media was to be encoded"
        steps.append(ec.run_workers(scheduler, out))
        assert time.monotonic() < deadline, f"{until} never finished"
        time.sleep(0.002)
    return steps


def test_item_split_across_prefill_chunks_is_fetched_and_loaded_once(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    # 16 tokens a step: the image (tokens 10-21 of 27) is split across two chunks.
    consumer = ec.scheduler("ec_consumer", max_num_batched_tokens=16, **SMALL_REGION)
    side = ec.side(consumer)
    emb = embedding()
    params = ec.encode(producer, "p1", "h-chunk", emb)
    consumer.add_request(ec.request("c1", "h-chunk", params=params, media=False, max_tokens=3))

    steps = run(ec, consumer, "c1")

    chunks = [s.scheduled["c1"] for s in steps if "c1" in s.scheduled]
    assert chunks[0] == 16 < 10 + 12, "the image was not split across chunks"
    loads = [op for s in steps for op in s.plan.loads]
    assert [op.mm_hash for op in loads] == ["h-chunk"]
    loaded = next(s.encoder_cache["h-chunk"] for s in steps if s.plan.loads)
    assert torch.equal(loaded, emb)
    assert ec.totals(consumer)["fetches_started"] == 1
    assert side.store.stats().pins == 0


def test_item_covered_by_a_prefix_cache_hit_is_not_fetched_again(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer", prefix_caching=True, **SMALL_REGION)
    side = ec.side(consumer)
    params = ec.encode(producer, "p1", "h-prefix", embedding())
    # 10 + 12 + 30 = 52 tokens: the image lies in the first two full 16-token blocks.
    consumer.add_request(
        ec.request("first", "h-prefix", params=params, media=False, max_tokens=1, suffix=30)
    )
    run(ec, consumer, "first")
    side.store.remove("h-prefix")  # gone from the region: only the KV prefix remains

    consumer.add_request(
        ec.request("again", "h-prefix", params=params, media=False, max_tokens=1, suffix=30)
    )
    steps = run(ec, consumer, "again")

    assert all(not s.plan.loads for s in steps)
    assert ec.totals(consumer)["fetches_started"] == 1
    assert consumer.requests.get("again") is None


def test_preempted_request_gets_its_evicted_item_again(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    # KV for 4 blocks of 16 tokens: two 27-token prompts fill it, and the first to grow
    # past 32 tokens preempts the other.
    consumer = ec.scheduler("ec_consumer", kv_blocks=5, **SMALL_REGION)
    side = ec.side(consumer)
    embs = {h: embedding() for h in ("h-first", "h-victim")}
    for h, emb in embs.items():
        params = ec.encode(producer, f"p-{h}", h, emb)
        consumer.add_request(ec.request(h, h, params=params, media=False, max_tokens=8))
    step = ec.step(consumer)  # starts both fetches
    assert not step.scheduled
    deadline = time.monotonic() + 10
    while not all(ready(side.store, h) for h in embs):
        assert time.monotonic() < deadline, "the fetches never completed"
        time.sleep(0.002)

    preempted = False
    victim_loads = 0
    while True:
        out = consumer.schedule()
        assert not out.scheduled_encoder_inputs, "an item without media was to be encoded"
        step = ec.run_workers(consumer, out)
        for op in step.plan.loads:
            assert torch.equal(step.encoder_cache[op.mm_hash], embs[op.mm_hash])
            victim_loads += op.mm_hash == "h-victim"
        if "h-victim" in out.preempted_req_ids and not preempted:
            preempted = True
            # While it waits, its item leaves the region, and the engine's encoder cache
            # lets go of it too (as it does when other items need the space).
            evict_all(side.store)
            consumer.reset_encoder_cache()
        if step.finished("h-victim") is not None:
            break
        assert time.monotonic() < deadline + 10, "never finished"
        time.sleep(0.002)

    assert preempted, "no preemption: the KV cache was not short enough"
    assert victim_loads == 2  # once at first, once after it was preempted
    assert ec.totals(consumer)["fetches_started"] == 3
    assert side.store.stats().pins == 0
