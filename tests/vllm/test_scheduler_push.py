"""Push inside real vLLM Schedulers: the encoder writes an item into the prefill/decode
instance named in its request, and that instance's admission waits for it or pulls.

An encoder (ec_producer) and a prefill/decode instance (ec_consumer, `push_name`
"pd0", the encoder in its `trusted_producers`, so that it holds a push session
from start-up) run as in test_scheduler_connector.py: real Schedulers, real
CURVE sessions, NIXL reads and writes between two agents of this process,
`WorkerSide` in the model runner's place. Each test checks what the model
would see: the loaded tensor equals the encoder's output, byte for byte.
"""

from __future__ import annotations

import time

import pytest
import torch
from conftest import EC, embedding, fill_region, ready
from test_connector_metrics import exported, value
from vllm.v1.core.sched.scheduler import Scheduler
from waiting import wait_until

from ecshare.vllm.settings import split_extra

PUSH_NAME = "pd0"


def push_pair(ec: EC, **consumer: object) -> tuple[Scheduler, Scheduler]:
    """(encoder, prefill/decode accepting pushes as PUSH_NAME), its push session up."""
    producer = ec.scheduler("ec_producer")
    core = ec.side(producer).producer
    assert core is not None
    consumer_scheduler = ec.scheduler(
        "ec_consumer", push_name=PUSH_NAME, trusted_producers=[core.address], **consumer
    )
    wait_until(lambda: PUSH_NAME in core.push_names(), "the consumer's push session")
    return producer, consumer_scheduler


def loaded(ec: EC, consumer: Scheduler, rid: str, h: str) -> torch.Tensor:
    """Step until `rid` is scheduled; the tensor its step loaded from the region for `h`."""
    step, _ = ec.step_until(consumer, lambda s: rid in s.scheduled)
    assert [op.mm_hash for op in step.plan.loads] == [h]
    assert step.out.scheduled_encoder_inputs == {}  # nothing encoded here
    return step.encoder_cache[h]


def test_item_pushed_before_the_scheduler_asks_is_found_local_and_counted_pushed(
    ec: EC,
) -> None:
    producer, consumer = push_pair(ec)
    emb = embedding()

    params = ec.encode(producer, "p1", "h-early", emb, params={"push_to": [PUSH_NAME]})

    assert params["h-early"]["pushed_to"] == [PUSH_NAME]
    wait_until(lambda: ready(ec.side(consumer).store, "h-early"), "the push landing")
    consumer.add_request(ec.request("c1", "h-early", params=params))
    step = ec.step(consumer)
    assert "c1" in step.scheduled  # the first step: nothing to wait for
    assert [op.mm_hash for op in step.plan.loads] == ["h-early"]
    assert torch.equal(step.encoder_cache["h-early"], emb)
    counts = ec.totals(consumer)
    assert counts["push_announced"] == 1
    assert counts["push_received"] == 1
    assert "fetched_items" not in counts  # nothing was read from the encoder
    assert "exposed_pushed_p50_ms" in counts and "exposed_pulled_p50_ms" not in counts
    assert ec.totals(producer)["pushes_started"] == 1
    # On vLLM's endpoint: one exposed latency, labelled pushed.
    shown = exported(consumer, ec.stats[id(consumer)])
    assert value(shown, "vllm:ecshare_exposed_latency_seconds_count", mode="pushed") == 1
    assert value(shown, "vllm:ecshare_exposed_latency_seconds_count", mode="pulled") == 0
    assert value(shown, "vllm:ecshare_push_received_total") == 1


def test_announced_push_keeps_the_request_waiting_until_it_lands(ec: EC) -> None:
    producer, consumer = push_pair(ec, push_wait_s=30.0)
    emb = embedding()
    params = ec.encode(producer, "p1", "h-wait", emb)  # no push asked: none comes by itself
    params["h-wait"]["pushed_to"] = [PUSH_NAME]  # as if one were on its way

    consumer.add_request(ec.request("c1", "h-wait", params=params))
    for _ in range(5):
        assert "c1" not in ec.step(consumer).scheduled
        time.sleep(0.02)
    assert ec.side(consumer).pending_fetches() == 1
    core = ec.side(producer).producer
    assert core is not None
    outcome = core.push("h-wait", PUSH_NAME).result(timeout=10)

    assert outcome.pushed, outcome
    assert torch.equal(loaded(ec, consumer, "c1", "h-wait"), emb)
    counts = ec.totals(consumer)
    assert counts["push_received"] == 1
    assert "fetched_items" not in counts
    assert "exposed_pushed_p50_ms" in counts


def test_push_that_never_comes_falls_back_to_pull(ec: EC) -> None:
    producer, consumer = push_pair(ec, push_wait_s=0.2)
    emb = embedding()
    params = ec.encode(producer, "p1", "h-late", emb)
    params["h-late"]["pushed_to"] = [PUSH_NAME]  # announced, never pushed

    consumer.add_request(ec.request("c1", "h-late", params=params))

    assert torch.equal(loaded(ec, consumer, "c1", "h-late"), emb)
    counts = ec.totals(consumer)
    assert counts["push_announced"] == 1
    assert counts["fetched_items"] == 1  # pulled
    assert "push_received" not in counts
    assert "exposed_pulled_p50_ms" in counts and "exposed_pushed_p50_ms" not in counts
    shown = exported(consumer, ec.stats[id(consumer)])
    assert value(shown, "vllm:ecshare_exposed_latency_seconds_count", mode="pulled") == 1


def test_push_refused_for_a_full_region_falls_back_to_pull(ec: EC) -> None:
    producer, consumer = push_pair(ec)
    side = ec.side(consumer)
    assert side.consumer is not None
    store = side.store
    assert fill_region(store, "filler")
    store.pin("filler", "test", "g1", 60.0)  # nothing can evict it: no room for a push
    emb = embedding()

    params = ec.encode(producer, "p1", "h-full", emb, params={"push_to": [PUSH_NAME]})

    assert params["h-full"]["pushed_to"] == [PUSH_NAME]  # started; the consumer refuses it
    consumer_core = side.consumer
    wait_until(
        lambda: consumer_core.counter_snapshot().get("push_refused.full", 0) == 1,
        "the consumer refusing the push",
    )
    store.unpin("test", "g1")
    store.remove("filler")
    consumer.add_request(ec.request("c1", "h-full", params=params))
    assert torch.equal(loaded(ec, consumer, "c1", "h-full"), emb)
    counts = ec.totals(consumer)
    assert counts["fetched_items"] == 1
    assert "push_received" not in counts


def test_encoder_pushes_only_to_allowed_names_with_a_session_and_counts_the_rest(
    ec: EC,
) -> None:
    producer = ec.scheduler("ec_producer", push_targets=[PUSH_NAME, "pd1"])
    core = ec.side(producer).producer
    assert core is not None
    ec.scheduler("ec_consumer", push_name=PUSH_NAME, trusted_producers=[core.address])
    wait_until(lambda: PUSH_NAME in core.push_names(), "the consumer's push session")

    # pd1 is allowed but no consumer of that name holds a session; pd9 is not allowed.
    asked = {"push_to": ["pd1", "pd9", PUSH_NAME]}
    params = ec.encode(producer, "p1", "h-a", embedding(), params=asked)
    assert params["h-a"]["pushed_to"] == [PUSH_NAME]
    for i, bad in enumerate([{"push_to": PUSH_NAME}, {"push_to": ["../x"]}, {"push_to": [1]}]):
        params = ec.encode(producer, f"p-bad{i}", f"h-bad{i}", embedding(), params=bad)
        assert "pushed_to" not in params[f"h-bad{i}"]  # announced, pulled as without push

    counts = ec.totals(producer)
    assert counts["push_names_refused"] == 2
    assert counts["push_params_unusable"] == 3
    assert counts["pushes_started"] == 1


@pytest.mark.parametrize("bad", [["bad name"], "pd0", [""], ["x" * 65]])
def test_malformed_push_targets_is_a_clear_error(bad: object) -> None:
    with pytest.raises(ValueError, match="push_targets"):
        split_extra({"push_targets": bad})
