"""ECShareConnector inside real vLLM Schedulers, with no model runner.

Each test builds `vllm.v1.core.sched.scheduler.Scheduler` from a `VllmConfig`
over the tiny Qwen2-VL, with an `ECTransferConfig` that names
`ECShareConnector` in `ecshare.vllm`: vLLM's own factory loads the connector,
and vLLM's own scheduling decides what is encoded, loaded, deferred or
failed. Producer and consumer talk over the real control plane (CURVE keys
generated into tmp_path) and read over NIXL.

The model runner is replaced by direct `WorkerSide` calls (`EC.step` in
conftest.py), because the real runner needs the model's forward pass: the
tests hand `save_caches` a tensor of their own as "the encoder output" and
check what `start_load_caches` rebuilds from the region. The end-to-end test
with real vLLM workers covers the runner itself.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from conftest import EC, HIDDEN, Step, embedding, free_port
from vllm.v1.engine import FinishReason

from ecshare.store import EntryMeta, EntryState
from ecshare.vllm import ECShareStats

# A consumer that gives up on an unreachable producer within about a second.
QUICK_FAILURE = {
    "handshake_timeout_s": 0.3,
    "request_timeout_s": 0.3,
    "fetch_deadline_base_s": 0.5,
    "fetch_deadline_max_s": 1.0,
}


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def unreachable_params(ec: EC, consumer_side_fingerprint: str, h: str) -> dict[str, object]:
    """Well-formed params naming a producer address where nothing listens."""
    return {
        h: {
            "peer": f"tcp://127.0.0.1:{free_port()}",
            "fingerprint": consumer_side_fingerprint,
            "nbytes": 12 * HIDDEN * 4,
            "dtype": "float32",
            "shape": [12, HIDDEN],
        }
    }


# -- producer --------------------------------------------------------------------------------


def test_producer_params_name_peer_and_item_never_memory(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    assert producer.is_mm_encoder_only  # set by vLLM for ec_producer
    side = ec.side(producer)
    assert side.producer is not None

    params = ec.encode(producer, "p1", "h-params", embedding())

    assert set(params) == {"h-params"}
    item = params["h-params"]
    # Exactly these keys: no region address, extents or NIXL agent metadata,
    # which a peer only learns after it has authenticated; the placeholder fields
    # in the shape vLLM's own EC connectors publish them.
    assert set(item) == {
        "peer", "fingerprint", "shape", "dtype", "nbytes", "modality", "metadata", "item_indices",
    }  # fmt: skip
    assert item["modality"] == "image"
    assert item["item_indices"] == [0]
    assert isinstance(item["metadata"], dict)
    assert item["peer"] == side.producer.address
    assert item["peer"].startswith("tcp://127.0.0.1:")
    assert item["fingerprint"] == side.fingerprint
    assert list(item["shape"]) == [12, HIDDEN]
    assert item["dtype"] == "float32"
    assert item["nbytes"] == 12 * HIDDEN * 4
    # They travel in an HTTP response body.
    assert json.loads(json.dumps(params))["h-params"]["nbytes"] == item["nbytes"]


def test_entry_ready_only_after_worker_reports_copy(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    store = ec.side(producer).store
    emb = embedding()
    producer.add_request(ec.request("p1", "h-ready"))

    step = ec.step(producer, {"h-ready": emb}, report=False)
    # The worker has copied the bytes into the region but not yet reported:
    # the entry must be neither servable nor announced.
    entry = store.get("h-ready")
    assert entry is not None and entry.state is EntryState.ALLOCATED
    assert b"".join(bytes(v) for v in store.views(entry)) == as_bytes(emb).numpy().tobytes()

    ec.finish_step(producer, step)
    entry = store.get("h-ready")
    assert entry is not None and entry.state is EntryState.READY
    done = step.finished("p1")
    assert done is not None and set(done.ec_transfer_params or {}) == {"h-ready"}


def test_failed_worker_copy_is_not_announced_and_frees_blocks(
    ec: EC, caplog: pytest.LogCaptureFixture
) -> None:
    producer = ec.scheduler("ec_producer")
    store = ec.side(producer).store
    free_before = store.stats().free_blocks
    producer.add_request(ec.request("p1", "h-bad"))

    # An encoder output of the wrong size: the worker refuses to copy it and
    # reports the failure.
    with caplog.at_level(logging.WARNING, logger="ecshare"):
        step = ec.step(producer, {"h-bad": embedding(rows=11)})

    done = step.finished("p1")
    assert done is not None
    assert "h-bad" not in (done.ec_transfer_params or {})
    assert store.get("h-bad") is None
    assert store.stats().free_blocks == free_before
    assert any("h-bad" in r.getMessage() and "not stored" in r.getMessage() for r in caplog.records)


def test_copy_never_reported_is_abandoned_after_a_lease_and_frees_its_blocks(
    ec: EC, caplog: pytest.LogCaptureFixture
) -> None:
    timing = {
        "save_report_timeout_s": 0.5,
        "fetch_deadline_base_s": 0.3,
        "fetch_deadline_max_s": 0.4,
        "request_timeout_s": 0.2,
    }
    producer = ec.scheduler("ec_producer", **timing)
    side = ec.side(producer)
    free_before = side.store.stats().free_blocks
    producer.add_request(ec.request("p1", "h-lost"))

    step = ec.step(producer, {"h-lost": embedding()}, report=False)
    assert ec.worker(producer).take_report() is not None  # the report is lost on the way
    with caplog.at_level(logging.WARNING, logger="ecshare"):
        ec.finish_step(producer, step)
        entry = side.store.get("h-lost")
        assert entry is not None and entry.state is EntryState.ALLOCATED
        assert side.store.stats().free_blocks < free_before

        time.sleep(0.6)  # past the lease: the next step gives the copy up
        ec.step(producer)

    assert side.store.get("h-lost") is None
    assert side.store.stats().free_blocks == free_before
    assert ec.totals(producer)["save_abandoned"] == 1
    assert any(
        "h-lost" in r.getMessage() and "save_report_timeout_s" in r.getMessage()
        for r in caplog.records
    )


# -- consumer --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_consumer_defers_until_fetched_then_loads_byte_exact(ec: EC, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    producer = ec.scheduler("ec_producer", dtype=name)
    consumer = ec.scheduler("ec_consumer", dtype=name)
    emb = embedding(dtype=dtype)
    params = ec.encode(producer, "p1", "h-fetch", emb)
    assert params["h-fetch"]["dtype"] == name

    consumer.add_request(ec.request("c1", "h-fetch", params=params))
    step, before = ec.step_until(consumer, lambda s: "c1" in s.scheduled)

    assert before, "the request was scheduled before its fetch completed"
    assert all(not s.scheduled for s in before)
    assert step.out.scheduled_encoder_inputs == {}  # loaded, not encoded
    assert [op.mm_hash for op in step.plan.loads] == ["h-fetch"]
    loaded = step.encoder_cache["h-fetch"]
    assert loaded.dtype == dtype and loaded.shape == emb.shape
    assert torch.equal(as_bytes(loaded), as_bytes(emb))


def test_has_cache_item_only_for_ready_local_entries(ec: EC) -> None:
    scheduler = ec.scheduler("ec_consumer")
    consumer = ec.connector(scheduler)
    side = ec.side(scheduler)
    store = side.store
    meta = EntryMeta(dtype="float32", shape=(8, HIDDEN))

    def present(h: str) -> bool:
        found = consumer.has_cache_item(h)
        side.build_plan()  # the step ends: a probe no load took is released
        return found

    assert not present("h-local")
    entry = store.allocate("h-local", 8 * HIDDEN * 4, meta)
    assert not present("h-local")  # ALLOCATED: still being written
    store.commit(entry)
    assert present("h-local")
    assert store.stats().pins == 0
    store.remove("h-local")
    assert not present("h-local")

    # An encoder-only instance always encodes what it serves.
    producer = ec.scheduler("ec_producer")
    ec.side(producer).store.put("h-local", embedding(rows=8))
    assert not ec.connector(producer).has_cache_item("h-local")


@pytest.mark.parametrize("why", ["producer_unreachable", "entry_missing"])
def test_failed_fetch_falls_back_to_local_encoding(ec: EC, why: str) -> None:
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    side = ec.side(consumer)
    if why == "entry_missing":
        producer = ec.scheduler("ec_producer")
        real = ec.encode(producer, "p1", "h-real", embedding())
        params = {"h-gone": real["h-real"]}  # a producer that never held h-gone
    else:
        params = unreachable_params(ec, side.fingerprint, "h-gone")
    consumer.add_request(ec.request("c1", "h-gone", params=params, max_tokens=3))
    emb = embedding()

    step, before = ec.step_until(
        consumer, lambda s: "c1" in s.scheduled, encoder_outputs={"h-gone": emb}
    )

    assert before  # deferred while the fetch was tried
    assert step.out.scheduled_encoder_inputs == {"c1": [0]}  # encoded here instead
    assert step.plan.loads == []
    assert step.encoder_cache["h-gone"] is emb
    # Once settled, the request is neither held back nor fetched again.
    while step.finished("c1") is None:
        step = ec.step(consumer)
        assert "c1" in step.scheduled
    counts = ec.totals(consumer)
    assert counts["fetches_started"] == 1
    assert counts["fetch_failed"] == 1
    assert counts["local_encode_fallbacks"] == 1


def test_request_without_media_fails_when_fetch_fails(
    ec: EC, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    params = unreachable_params(ec, ec.side(consumer).fingerprint, "h-nomedia")
    consumer.add_request(ec.request("c1", "h-nomedia", params=params, media=False))

    deadline = time.monotonic() + 10
    with caplog.at_level(logging.INFO, logger="ecshare"):
        while True:
            step = ec.step(consumer)
            assert "c1" not in step.scheduled  # never run without its encoder output
            done = step.finished("c1")
            if done is not None:
                break
            assert time.monotonic() < deadline, "the request never finished"
            time.sleep(0.002)

    assert done.finish_reason == FinishReason.ERROR
    assert "c1" not in consumer.requests
    reasons = [r for r in caplog.records if r.levelno >= logging.ERROR and "c1" in r.getMessage()]
    assert len(reasons) == 1
    assert "h-nomedia" in reasons[0].getMessage()
    assert "no media" in reasons[0].getMessage()


def test_ec_both_reuses_own_saved_entry_instead_of_encoding(ec: EC) -> None:
    both = ec.scheduler("ec_both")
    conn = ec.connector(both)
    store = ec.side(both).store
    emb = embedding()

    both.add_request(ec.request("r1", "h-both", max_tokens=1))
    step = ec.step(both, {"h-both": emb})
    assert step.out.scheduled_encoder_inputs == {"r1": [0]}
    assert step.finished("r1") is not None
    entry = store.get("h-both")
    assert entry is not None and entry.state is EntryState.READY
    assert conn.has_cache_item("h-both")

    # vLLM's in-memory encoder cache would answer first; drop it, as an
    # eviction or a restart of the engine's cache would.
    both.reset_encoder_cache()
    both.add_request(ec.request("r2", "h-both", max_tokens=1))
    step = ec.step(both, {})  # no encoder output on offer: encoding would fail

    assert step.out.scheduled_encoder_inputs == {}
    assert [op.mm_hash for op in step.plan.loads] == ["h-both"]
    assert torch.equal(step.encoder_cache["h-both"], emb)


# -- configuration ---------------------------------------------------------------------------


def test_unknown_extra_config_key_stops_scheduler_construction(ec: EC) -> None:
    with pytest.raises(ValueError, match=r"listen_prot: unknown key; did you mean `listen_port`"):
        ec.scheduler("ec_producer", listen_prot=free_port())


def test_producer_listen_port_comes_from_extra_config(
    ec: EC, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    # The environment is the lower layer: the connector's config overrides it.
    monkeypatch.setenv("ECSHARE_LISTEN_PORT", str(free_port()))
    producer = ec.scheduler("ec_producer", listen_port=port)
    side = ec.side(producer)
    assert side.producer is not None
    assert side.producer.address == f"tcp://127.0.0.1:{port}"
    params = ec.encode(producer, "p1", "h-port", embedding())
    assert params["h-port"]["peer"] == f"tcp://127.0.0.1:{port}"


# -- stats and pins --------------------------------------------------------------------------


def test_stats_report_fetches_saves_loads_failures_and_latency(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    params = ec.encode(producer, "p1", "h-stats", embedding())
    nbytes = 12 * HIDDEN * 4
    consumer.add_request(ec.request("c1", "h-stats", params=params, max_tokens=1))
    consumer.add_request(
        ec.request("c2", "h-lost", params={"h-lost": params["h-stats"]}, max_tokens=1)
    )
    seen: set[str] = set()

    def both_scheduled(step: Step) -> bool:
        seen.update(step.scheduled)
        return {"c1", "c2"} <= seen

    ec.step_until(consumer, both_scheduled, encoder_outputs={"h-lost": embedding()})

    consumed = ec.totals(consumer)
    assert consumed["fetches_started"] == 2
    assert consumed["fetched_items"] == 1
    assert consumed["fetched_bytes"] == nbytes
    assert consumed["fetch_failed"] == 1
    assert consumed["loaded_items"] == 1
    assert consumed["local_encode_fallbacks"] == 1
    assert 0 < consumed["fetch_latency_p50_ms"] <= consumed["fetch_latency_max_ms"]
    assert all(isinstance(v, int | float) for v in consumed.values())

    produced = ec.totals(producer)
    assert produced["saved_items"] == 1
    assert produced["saved_bytes"] == nbytes
    assert ECShareStats(data={}).is_empty()


def test_load_pin_released_once_worker_reports_load(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    store = ec.side(consumer).store
    params = ec.encode(producer, "p1", "h-pin", embedding())
    consumer.add_request(ec.request("c1", "h-pin", params=params))

    step, _ = ec.step_until(consumer, lambda s: "c1" in s.scheduled, report=False)
    assert "h-pin" in step.encoder_cache  # the workers have copied it ...
    # ... but the load's pin and the request's hold stay until they say so.
    assert store.stats().pins == 2

    ec.finish_step(consumer, step)
    # Reported by the load's own grant, never by mm_hash alone.
    assert step.worker_report is not None
    assert step.worker_report.loaded == {op.grant for op in step.plan.loads}
    assert store.stats().pins == 0
