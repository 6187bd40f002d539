"""What a request's `ec_transfer_params` can and cannot make a consumer do (real Schedulers).

A client controls the request body, so the params are hostile input: a peer
outside `trusted_producers` is never contacted, malformed params never crash
the engine, and an entry whose shape is not what the model computes for the
item is never handed to the model, whoever claimed what. Each of these ends
in local encoding, counted. And a fetch that a dead consumer thread never
settles ends too.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from conftest import EC, HIDDEN, embedding
from vllm.v1.core.sched.scheduler import Scheduler

from ecshare.vllm.shapes import itemsize

QUICK_FAILURE = {
    "handshake_timeout_s": 0.3,
    "request_timeout_s": 0.3,
    "fetch_deadline_base_s": 0.5,
    "fetch_deadline_max_s": 1.0,
}


def run_until_done(
    ec: EC, scheduler: Scheduler, request_id: str, outputs: dict[str, torch.Tensor]
) -> dict[str, int]:
    """Step until the request finishes; how often its item was encoded vs loaded."""
    (mm_hash,) = [f.identifier for f in scheduler.requests[request_id].mm_features]
    return run_all(ec, scheduler, {request_id: mm_hash}, outputs)[request_id]


def run_all(
    ec: EC, scheduler: Scheduler, items: dict[str, str], outputs: dict[str, torch.Tensor]
) -> dict[str, dict[str, int]]:
    """Step until every request (id -> its item) finishes; per request, encoded vs loaded."""
    seen = {r: {"encoded": 0, "loaded": 0} for r in items}
    running = set(items)
    deadline = time.monotonic() + 15
    while running:
        step = ec.step(scheduler, outputs)
        for r, mm_hash in items.items():
            seen[r]["encoded"] += len(step.out.scheduled_encoder_inputs.get(r, []))
            if r in step.scheduled:
                seen[r]["loaded"] += sum(op.mm_hash == mm_hash for op in step.plan.loads)
            if step.finished(r) is not None:
                running.discard(r)
        assert time.monotonic() < deadline, f"{sorted(running)} never finished"
        time.sleep(0.002)
    return seen


# -- peers -----------------------------------------------------------------------------------


def test_untrusted_producer_in_params_is_refused_and_counted(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    trusted = ec.side(producer).producer
    assert trusted is not None
    consumer = ec.scheduler("ec_consumer", trusted_producers=[trusted.address])
    emb = embedding()
    params = ec.encode(producer, "p1", "h-trusted", emb)
    with socket.socket() as trap:  # where a forged peer points: nothing may connect
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(0.5)
        forged = {
            "h-forged": {**params["h-trusted"], "peer": f"tcp://127.0.0.1:{trap.getsockname()[1]}"}
        }
        consumer.add_request(ec.request("c1", "h-trusted", params=params))
        consumer.add_request(ec.request("c2", "h-forged", params=forged))

        seen = run_all(
            ec, consumer, {"c1": "h-trusted", "c2": "h-forged"}, {"h-forged": embedding()}
        )

        with pytest.raises(TimeoutError):
            trap.accept()
    assert seen["c1"] == {"encoded": 0, "loaded": 1}
    assert seen["c2"]["encoded"] == 1
    counts = ec.totals(consumer)
    assert counts["peer_refused"] == 1
    assert counts["fetches_started"] == 1
    assert counts["local_encode_fallbacks"] == 1


def test_trusted_producers_must_be_endpoints(ec: EC) -> None:
    ec.scheduler("ec_consumer", trusted_producers=["tcp://10.0.0.5:5555", "tcp://enc-0:7000"])
    with pytest.raises(ValueError, match="list of producer endpoints"):
        ec.scheduler("ec_consumer", trusted_producers=["http://example.com/"])


@pytest.mark.parametrize(
    "params",
    [
        "not an object",
        ["h-bad"],
        {"h-bad": "not an object"},
        {"h-bad": {"peer": 5, "fingerprint": None}},
        {"h-bad": {"peer": "tcp://127.0.0.1:1", "fingerprint": "x", "nbytes": -1}},
    ],
    ids=["string", "list", "item_string", "item_wrong_types", "wrong_fingerprint"],
)
def test_malformed_params_are_counted_and_the_item_encoded_locally(ec: EC, params: object) -> None:
    consumer = ec.scheduler("ec_consumer")
    consumer.add_request(ec.request("c1", "h-bad", params=params))

    seen = run_until_done(ec, consumer, "c1", {"h-bad": embedding()})

    assert seen == {"encoded": 1, "loaded": 0}
    counts = ec.totals(consumer)
    assert counts["params_unusable"] == 1
    assert "fetches_started" not in counts


# -- modality --------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["vllm_034", "vllm_032"])
def test_params_with_or_without_modality_are_fetched_and_loaded(ec: EC, shape: str) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    emb = embedding()
    params = ec.encode(producer, "p1", "h-mod", emb)
    assert params["h-mod"]["modality"] == "image"
    if shape == "vllm_032":  # what vLLM 0.32's helper and earlier encoders publish
        del params["h-mod"]["modality"]
    consumer.add_request(ec.request("c1", "h-mod", params=params))

    seen = run_until_done(ec, consumer, "c1", {"h-mod": emb})

    assert seen == {"encoded": 0, "loaded": 1}
    assert "params_unusable" not in ec.totals(consumer)


@pytest.mark.parametrize("modality", ["audio", 5])
def test_params_of_another_modality_are_counted_and_the_item_encoded_locally(
    ec: EC, modality: object
) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    params = ec.encode(producer, "p1", "h-mod", embedding())
    params["h-mod"] = {**params["h-mod"], "modality": modality}  # the request's item is an image
    consumer.add_request(ec.request("c1", "h-mod", params=params))

    seen = run_until_done(ec, consumer, "c1", {"h-mod": embedding()})

    assert seen == {"encoded": 1, "loaded": 0}
    counts = ec.totals(consumer)
    assert counts["params_unusable"] == 1
    assert "fetches_started" not in counts


# -- sizes -----------------------------------------------------------------------------------


def test_local_entry_of_the_wrong_size_is_never_loaded(ec: EC) -> None:
    consumer = ec.scheduler("ec_consumer")
    side = ec.side(consumer)
    side.store.put("h-size", embedding(rows=11))  # the placeholder has 12 embeddings
    consumer.add_request(ec.request("c1", "h-size"))

    seen = run_until_done(ec, consumer, "c1", {"h-size": embedding()})

    assert seen == {"encoded": 1, "loaded": 0}
    assert side.store.get("h-size") is None  # wrong for everyone: removed
    assert ec.totals(consumer)["size_mismatch"] == 1


@pytest.mark.parametrize("lie", ["params_name_another_shape", "producer_holds_another_shape"])
def test_fetch_of_the_wrong_size_is_never_loaded(ec: EC, lie: str) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    if lie == "params_name_another_shape":
        params = ec.encode(producer, "p1", "h-size", embedding())
        params["h-size"] = {**params["h-size"], "shape": [11, HIDDEN], "nbytes": 11 * HIDDEN * 4}
    else:
        params = ec.encode(producer, "p1", "h-size", embedding(rows=11))
        params["h-size"] = {**params["h-size"], "shape": [12, HIDDEN], "nbytes": 12 * HIDDEN * 4}
    consumer.add_request(ec.request("c1", "h-size", params=params))

    seen = run_until_done(ec, consumer, "c1", {"h-size": embedding()})

    assert seen == {"encoded": 1, "loaded": 0}
    assert ec.side(consumer).store.get("h-size") is None
    assert ec.totals(consumer)["size_mismatch"] == 1


def test_an_item_size_comes_from_the_store_table_and_an_unknown_dtype_is_refused() -> None:
    assert [itemsize(d) for d in ("float32", "bfloat16", "float16", "float8_e4m3fn")] == [
        4,
        2,
        2,
        1,
    ]
    # float128 is numpy's platform-sized long double: never a guessed size either.
    for name in ("float128", "Tensor"):
        with pytest.raises(ValueError, match="not a dtype ecshare stores"):
            itemsize(name)


# -- a consumer that stops answering ---------------------------------------------------------


# The thread's death is the injected fault itself; pytest would print it as a warning.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_fetches_of_a_dead_consumer_thread_end_in_local_encoding_and_report_unhealthy(
    ec: EC, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    side = ec.side(consumer)
    assert side.consumer is not None
    params = ec.encode(producer, "p1", "h-dead", embedding())

    def crash(*_: object) -> None:
        raise RuntimeError("injected: the consumer's network thread dies")

    # A fault injected into the real Consumer: its loop raises, and its thread ends.
    monkeypatch.setattr(side.consumer, "_step", crash)
    time.sleep(0.3)  # the loop wakes at least every 0.1 s
    consumer.add_request(ec.request("c1", "h-dead", params=params))

    seen = run_until_done(ec, consumer, "c1", {"h-dead": embedding()})

    assert seen == {"encoded": 1, "loaded": 0}
    time.sleep(1.1)  # the core metrics are read at most once a second
    ec.step(consumer)
    counts = ec.totals(consumer)
    assert counts["local_encode_fallbacks"] == 1
    assert counts["fetch_failed"] == 1
    assert counts["healthy"] == 0  # reported to vLLM's metrics as vllm:ecshare_healthy


def test_fetch_a_hung_consumer_thread_never_settles_is_given_up(
    ec: EC, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    side = ec.side(consumer)
    assert side.consumer is not None
    params = ec.encode(producer, "p1", "h-hung", embedding())
    release = threading.Event()

    def hang(*_: object) -> None:
        release.wait()

    # A fault injected into the real Consumer: its loop stops in the middle of a step,
    # alive but answering nothing (a deadlock, a blocking call that never returns).
    monkeypatch.setattr(side.consumer, "_step", hang)
    try:
        time.sleep(0.3)
        consumer.add_request(ec.request("c1", "h-hung", params=params))
        started = time.monotonic()
        seen = run_until_done(ec, consumer, "c1", {"h-hung": embedding()})
        elapsed = time.monotonic() - started
    finally:
        release.set()

    assert seen == {"encoded": 1, "loaded": 0}
    # Given up past the consumer's own longest deadline: 1.0 + 0.3 + 1 s.
    assert 2.3 <= elapsed < 10
    counts = ec.totals(consumer)
    assert counts["fetches_overdue"] == 1
    assert counts["local_encode_fallbacks"] == 1
