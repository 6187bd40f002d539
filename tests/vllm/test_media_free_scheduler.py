"""Media-free prefill/decode in real vLLM Schedulers: items that carry placeholder metadata only.

A request from `ecshare proxy` in media-free mode carries each item as its
placeholder fields alone (Qwen2-VL's `image_grid_thw`), with no pixels to
encode. The consumer counts such items, fetches them as usual, and fails the
request, typed and logged, whenever one can come neither from a producer nor
from its own region: the engine must never try to encode an item it has no
media for. The producer publishes those fields in its params.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch
from conftest import EC, embedding
from test_scheduler_connector import QUICK_FAILURE
from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldElem, MultiModalKwargsItem
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request

from ecshare.vllm.placeholders import Placeholders


def metadata_only(request: Request, grid: tuple[int, int, int] = (1, 6, 8)) -> Request:
    """`request` with its item as a media-free request brings it: the grid and nothing else."""
    field = MultiModalFieldElem(data=torch.tensor(grid), field=MultiModalBatchedField())
    request.mm_features[0].data = MultiModalKwargsItem({"image_grid_thw": field})
    return request


def run_until_finished(ec: EC, scheduler: object, rid: str, timeout_s: float = 10.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        step = ec.step(scheduler)  # type: ignore[arg-type]
        assert rid not in step.scheduled  # never run without its encoder output
        done = step.finished(rid)
        if done is not None:
            return done
        assert time.monotonic() < deadline, f"{rid} never finished"
        time.sleep(0.002)


def test_placeholder_fields_tell_metadata_from_media(ec: EC) -> None:
    consumer = ec.scheduler("ec_consumer")
    placeholders = Placeholders(consumer.vllm_config.model_config)
    assert placeholders.fields("image") == {"image_grid_thw"}
    with_media = ec.request("m", "h-media")
    assert placeholders.carries_input(with_media.mm_features[0])
    assert not placeholders.carries_input(metadata_only(ec.request("n", "h-meta")).mm_features[0])
    assert not placeholders.carries_input(ec.request("z", "h-none", media=False).mm_features[0])


def test_metadata_only_item_named_by_no_params_fails_the_request_at_once(
    ec: EC, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = ec.scheduler("ec_consumer")
    consumer.add_request(metadata_only(ec.request("c1", "h-unnamed")))

    with caplog.at_level(logging.INFO, logger="ecshare"):
        done = run_until_finished(ec, consumer, "c1")

    assert done.finish_reason == FinishReason.ERROR  # type: ignore[attr-defined]
    counts = ec.totals(consumer)
    assert counts["media_free_items"] == 1
    assert counts["requests_unavailable"] == 1
    assert counts.get("fetches_started", 0) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("h-unnamed" in m and "no ec_transfer_params name it" in m for m in errors), errors


def test_metadata_only_item_whose_fetch_fails_fails_the_request(ec: EC) -> None:
    from test_scheduler_connector import unreachable_params

    consumer = ec.scheduler("ec_consumer", **QUICK_FAILURE)
    params = unreachable_params(ec, ec.side(consumer).fingerprint, "h-dead")
    consumer.add_request(metadata_only(ec.request("c1", "h-dead", params=params)))

    done = run_until_finished(ec, consumer, "c1")

    assert done.finish_reason == FinishReason.ERROR  # type: ignore[attr-defined]
    counts = ec.totals(consumer)
    assert counts["media_free_items"] == 1
    assert counts["fetch_failed"] == 1
    assert counts["requests_unavailable"] == 1
    assert counts.get("local_encode_fallbacks", 0) == 0


def test_metadata_only_item_is_fetched_and_loaded(ec: EC) -> None:
    producer = ec.scheduler("ec_producer")
    consumer = ec.scheduler("ec_consumer")
    emb = embedding()
    params = ec.encode(producer, "p1", "h-fetch", emb)
    consumer.add_request(metadata_only(ec.request("c1", "h-fetch", params=params)))

    step, _ = ec.step_until(consumer, lambda s: "c1" in s.scheduled)

    assert [op.mm_hash for op in step.plan.loads] == ["h-fetch"]
    assert torch.equal(step.encoder_cache["h-fetch"], emb)
    counts = ec.totals(consumer)
    assert counts["media_free_items"] == 1
    assert counts["fetched_items"] == 1
    assert counts.get("local_encodes", 0) == 0
