"""Fixtures for the end-to-end EPD tests: real `vllm serve` processes over the tiny model.

Once per module, in this order, never more than two instances at a time:

1. `reference_tokens`: one plain instance (no connector) answers every case
   of `epd_cases` at temperature 0, and is stopped;
2. `epd`: an encoder (ec_producer, CPU core 0) and a prefill/decode instance
   (ec_consumer, core 1) with the ECShare connector, CURVE keys generated
   into a tmp dir, are started together; one warm-up request through both
   sets up their session, so that the tests see steady-state fetches.

Each case has images of its own, drawn fresh for every run: an instance that
had seen an image would answer from its in-memory encoder cache first.
The instances' logs are in the module's tmp dir, and a failed start shows
their tail.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ecshare.vllm.launch import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
    start_all,
)
from ecshare.vllm.router import Route, route_chat_sync

REGION_BYTES = 64 << 20
# Generous on a loaded 2-core machine; the dead-producer test waits this long.
CONSUMER_TUNING = {"fetch_deadline_base_s": 5.0}


@dataclass
class EPD:
    encoder: VllmServer
    prefill_decode: VllmServer
    route: Route


def token_ids(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert isinstance(ids, list) and ids, answer
    return ids


def wait_metric(
    server: VllmServer, key: str, at_least: float, timeout_s: float = 15.0
) -> dict[str, float]:
    """The server's ecshare metrics once `key` reaches `at_least`, or as they are at the timeout.

    vLLM's frontend records a step's stats while it streams the step's
    outputs, so a response can arrive a moment before its counters move.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if metrics.get(key, 0.0) >= at_least or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.fixture(scope="module")
def epd_cases() -> dict[str, dict[str, Any]]:
    seed = random.SystemRandom().randrange(1 << 40)
    image = [random_image_url(seed + i) for i in range(5)]
    return {
        "single": chat_request([image[0]]),
        "two_images": chat_request([image[1], image[2]], text="Compare the two images."),
        "text_only": chat_request([], text="Tell me a story."),
        "dead_producer": chat_request([image[3]]),
        "warm_up": chat_request([image[4]], max_tokens=1),
    }


@pytest.fixture(scope="module")
def reference_tokens(
    tiny_model: Path, epd_cases: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[int]]:
    logs = tmp_path_factory.mktemp("reference")
    server = VllmServer(ServerSpec(tiny_model, free_port(), core=0), logs / "single.log")
    start_all([server])
    try:
        return {name: token_ids(post_chat(server.url, body)) for name, body in epd_cases.items()}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def epd(
    tiny_model: Path,
    epd_cases: dict[str, dict[str, Any]],
    reference_tokens: dict[str, list[int]],  # the plain instance is stopped before these start
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[EPD]:
    tmp = tmp_path_factory.mktemp("epd")
    keys = Keys.generate(tmp)
    region = {"region_bytes": REGION_BYTES}
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), **region},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    prefill_decode = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=1, ec_role="ec_consumer",
            extra_config={**keys.consumer_config(), **region, **CONSUMER_TUNING},
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    start_all([encoder, prefill_decode])
    try:
        route = Route(encoders=[encoder.url], prefill_decode=prefill_decode.url, timeout_s=120)
        route_chat_sync(epd_cases["warm_up"], route)
        yield EPD(encoder, prefill_decode, route)
    finally:
        prefill_decode.stop()
        encoder.stop()
