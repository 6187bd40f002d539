"""A fetch between two "hosts": network namespaces joined by a veth pair, UCX over TCP.

Needs root-like privilege (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2's `ip`; the
test is skipped, with the reason, where either is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("nixl._api")

from peer_testing import FAST, Keyring, SpawnProducer, child_env, fetch_command

from ecshare.vllm.servers import popen_session

pytestmark = pytest.mark.timeout(90)

PRODUCER_IP = "10.77.0.1"
CONSUMER_IP = "10.77.0.2"


@dataclass(frozen=True)
class VethPair:
    producer_ns: str
    consumer_ns: str
    producer_dev: str
    consumer_dev: str


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _rx_bytes(ns: str, dev: str) -> int:
    shown = _ip("-n", ns, "-j", "-s", "link", "show", "dev", dev)
    assert shown.returncode == 0, shown.stderr
    return int(json.loads(shown.stdout)[0]["stats64"]["rx"]["bytes"])


@pytest.fixture
def veth_pair() -> Iterator[VethPair]:
    if shutil.which("ip") is None:
        pytest.skip("network namespaces need iproute2's `ip` command, which is not installed")
    tag = f"ecs{os.getpid() % 100000}"
    pair = VethPair(f"{tag}-prod", f"{tag}-cons", f"{tag}p", f"{tag}c")  # devices: <= 15 chars
    created: list[str] = []
    try:
        for ns in (pair.producer_ns, pair.consumer_ns):
            made = _ip("netns", "add", ns)
            if made.returncode != 0:
                pytest.skip(f"cannot create network namespace {ns}: {made.stderr.strip()}")
            created.append(ns)
        steps = [
            ("link", "add", pair.producer_dev, "netns", pair.producer_ns, "type", "veth",
             "peer", "name", pair.consumer_dev, "netns", pair.consumer_ns),
            ("-n", pair.producer_ns, "addr", "add", f"{PRODUCER_IP}/24", "dev", pair.producer_dev),
            ("-n", pair.consumer_ns, "addr", "add", f"{CONSUMER_IP}/24", "dev", pair.consumer_dev),
            ("-n", pair.producer_ns, "link", "set", pair.producer_dev, "up"),
            ("-n", pair.consumer_ns, "link", "set", pair.consumer_dev, "up"),
            ("-n", pair.producer_ns, "link", "set", "lo", "up"),
            ("-n", pair.consumer_ns, "link", "set", "lo", "up"),
        ]  # fmt: skip
        for step in steps:
            done = _ip(*step)
            if done.returncode != 0:
                pytest.skip(f"cannot set up the veth pair (ip {' '.join(step)}): {done.stderr}")
        yield pair
    finally:
        for ns in created:  # deleting a namespace deletes its end of the veth pair
            _ip("netns", "del", ns)


def test_cross_host_fetch_over_tcp_in_network_namespaces(
    veth_pair: VethPair,
    spawn_producer: SpawnProducer,
    children: list[subprocess.Popen[str]],
    keyring: Keyring,
) -> None:
    tcp_over = {"ucx_tls": "tcp", "listen_host": PRODUCER_IP}
    producer = spawn_producer(
        synthetic="1MiB:1,100003:1,5000000:1",
        config={**keyring.producer_config(), **tcp_over, "ucx_net_devices": veth_pair.producer_dev},
        prefix=["ip", "netns", "exec", veth_pair.producer_ns],
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": veth_pair.producer_dev},
    )
    assert producer.address.startswith(f"tcp://{PRODUCER_IP}:")
    rx_before = _rx_bytes(veth_pair.consumer_ns, veth_pair.consumer_dev)

    consumer_config = {
        **FAST,
        **keyring.consumer_config(),
        "ucx_tls": "tcp",
        "ucx_net_devices": veth_pair.consumer_dev,
    }
    cmd = fetch_command(
        producer.address,
        list(producer.sizes),
        consumer_config,
        timeout_s=30.0,
        prefix=["ip", "netns", "exec", veth_pair.consumer_ns],
    )
    consumer = popen_session(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env({"UCX_TLS": "tcp", "UCX_NET_DEVICES": veth_pair.consumer_dev}),
    )
    children.append(consumer)
    out, err = consumer.communicate(timeout=60)

    assert consumer.returncode == 0, f"fetch failed ({consumer.returncode}): {out}\n{err}"
    rows = json.loads(out.strip().splitlines()[-1])["results"]
    assert [r["mm_hash"] for r in rows] == list(producer.sizes)
    for row in rows:
        assert row["ok"] and row["verified"], row
        assert row["nbytes"] == producer.sizes[row["mm_hash"]]
    # The bytes really crossed the veth pair.
    received = _rx_bytes(veth_pair.consumer_ns, veth_pair.consumer_dev) - rx_before
    assert received >= sum(producer.sizes.values()), received
