"""`ecshare status`: an authenticated status query of a real producer process.

The producer runs as its own process (`ecshare serve`) with synthetic entries; a
consumer in this process holds a session, and a raw session holds one grant, so
that the counts the CLI prints can be checked against what was really done. The
CLI runs as a subprocess, over CURVE on 127.0.0.1.

That busy producer is one for the module: its tests only ask it, and an answered or
refused status query changes nothing another test reads (no entry, grant or session; the
one counter a refusal moves is checked as a delta by the test that moves it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from peer_testing import (
    FINGERPRINT,
    Keyring,
    ProducerProcess,
    SpawnProducer,
    child_env,
    consumers,
    expected,
    producer_processes,
    raw_sessions,
    stored_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import ControlClient, LinkSettings, generate_keypair, load_keypair
from ecshare.peer.status import SessionView, key_fingerprint, status_reply
from ecshare.store import Region, Store

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB
SYNTHETIC = "64KiB:4,1MiB:2"
# A long lease and a patient liveness check, so that the grant and both sessions held
# for the module's queries outlive their CLI start-ups on a loaded machine; the
# consumer's deadline cap stays under the lease, as the config requires.
PATIENT = {"grant_lease_s": 600.0, "heartbeat_timeout_s": 20.0}


@dataclass(frozen=True)
class Busy:
    """A producer with entries, a consumer's session and a raw session holding one grant."""

    producer: ProducerProcess
    admin_secret: Path
    granted_hash: str
    granted_bytes: int


def _blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK)


def status_cli(
    address: str, *args: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", "status", address, "--timeout", "10", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout_s,
        check=False,
    )


@pytest.fixture(scope="module")
def admin_secret(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return generate_keypair(tmp_path_factory.mktemp("admin"), "admin").secret_path


@pytest.fixture(scope="module")
def busy(keyring: Keyring, admin_secret: Path) -> Iterator[Busy]:
    with (
        producer_processes() as spawn_producer,
        consumers() as make_consumer,
        raw_sessions(keyring) as raw_session,
    ):
        admin_public = admin_secret.with_suffix(".key")
        producer = spawn_producer(
            synthetic=SYNTHETIC,
            config={**keyring.producer_config(), **PATIENT, "admin_keys_file": str(admin_public)},
            hooks=True,
        )
        sizes = producer.sizes
        small = next(h for h, n in sizes.items() if n == 64 * KiB)
        big = next(h for h, n in sizes.items() if n == MiB)
        # A real consumer fetches one item over NIXL and keeps its session (heartbeats).
        node, consumer = make_consumer(keyring.consumer_config(), PATIENT)
        consumer.fetch([small], [producer.address])[0].result(timeout=30)
        assert np.array_equal(stored_bytes(node, small), expected(small, sizes[small]))
        # A raw session takes a grant and never releases it while the module's tests run.
        raw = raw_session(producer.address)
        assert isinstance(raw.hello(), p.Welcome)
        reply = raw.fetch("r-hold", big)
        assert isinstance(reply, p.FetchReply) and reply.items[0].status is p.ItemStatus.GRANTED
        done = threading.Event()
        keeper = threading.Thread(
            target=raw.keep_alive_until, args=(done.is_set, 600.0), daemon=True
        )
        keeper.start()
        # The consumer's Release of its own grant may ride with its next message a
        # moment later: the raw session's grant is then the only one.
        wait_until(lambda: producer.stats()["active_grants"] == 1, timeout_s=5.0)
        try:
            yield Busy(producer, admin_secret, big, sizes[big])
        finally:
            done.set()
            keeper.join(timeout=10)


def test_status_with_admin_key_shows_the_real_counts(busy: Busy, keyring: Keyring) -> None:
    result = status_cli(
        busy.producer.address,
        "--key",
        str(busy.admin_secret),
        "--server-key",
        str(keyring.producer_public),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    reply: dict[str, Any] = json.loads(result.stdout)
    sizes = busy.producer.sizes
    # Every documented field is there.
    documented = set(p.StatusReply.__struct_fields__) - {"sessions", "counters"}
    assert documented <= set(reply), documented - set(reply)
    assert reply["t"] == "status_reply"
    assert reply["fingerprint"] == FINGERPRINT
    assert reply["entries"] == len(sizes) == 6
    assert reply["entries_by_state"] == {
        "allocated": 0,
        "ready": 6,
        "evicting": 0,
        "quarantined": 0,
    }
    assert (reply["quarantined_bytes"], reply["canary_violations"]) == (0, 0)
    assert reply["payload_bytes"] == sum(sizes.values())
    used_blocks = sum(_blocks(n) for n in sizes.values())
    assert reply["blocks_used"] == used_blocks
    assert reply["used_bytes"] == used_blocks * BLOCK
    assert reply["free_bytes"] == reply["region_bytes"] - used_blocks * BLOCK
    assert reply["blocks_free"] + reply["blocks_used"] == reply["blocks_total"]
    # Two sessions of one consumer key: the fetching consumer and the raw session.
    assert reply["sessions_total"] == 2 and len(reply["sessions"]) == 2
    assert reply["peers"] == 1
    assert reply["grants_active"] == 1
    assert reply["pinned_entries"] == 1
    assert reply["pinned_bytes"] == busy.granted_bytes
    fingerprint = key_fingerprint(keyring.consumer.public_text)
    assert {s["key_fingerprint"] for s in reply["sessions"]} == {fingerprint}
    holder = max(reply["sessions"], key=lambda s: s["pinned_bytes"])
    assert (holder["grants"], holder["pinned_bytes"]) == (1, busy.granted_bytes)
    assert holder["client_name"] == "raw-test-client"
    # A digest of the key, never the key.
    assert keyring.consumer.public_text not in result.stdout
    assert reply["counters"]["granted"] == 2
    assert reply["uptime_ms"] > 0


def test_status_table_shows_entries_region_grants_and_sessions(
    busy: Busy, keyring: Keyring
) -> None:
    result = status_cli(
        busy.producer.address,
        "--key",
        str(busy.admin_secret),
        "--server-key",
        str(keyring.producer_public),
    )
    assert result.returncode == 0, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert "6 (0 allocated, 0 evicting, 0 quarantined, 6 ready)" in lines["entries"]
    assert "1 active on 1 entries, 1 MiB pinned" in lines["grants"]
    assert "2 from 1 peer key(s)" in lines["sessions"]
    assert key_fingerprint(keyring.consumer.public_text) in result.stdout
    assert "raw-test-client" in result.stdout


def test_producer_own_key_may_query_status(busy: Busy, keyring: Keyring) -> None:
    result = status_cli(
        busy.producer.address,
        "--key",
        str(keyring.producer_secret),
        "--server-key",
        str(keyring.producer_public),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["sessions_total"] == 2


def test_status_without_a_key_is_refused_before_connecting(busy: Busy, keyring: Keyring) -> None:
    result = status_cli(busy.producer.address, "--server-key", str(keyring.producer_public))
    assert result.returncode != 0
    assert "no client key" in result.stderr and "--key FILE" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_status_with_an_unknown_key_is_refused_by_curve(busy: Busy, keyring: Keyring) -> None:
    result = status_cli(
        busy.producer.address,
        "--key",
        str(keyring.stranger_secret),
        "--server-key",
        str(keyring.producer_public),
    )
    assert result.returncode != 0
    assert "refused the connection" in result.stderr
    assert "not on the producer's allow-list" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_status_with_a_consumer_key_is_refused_as_not_admin(busy: Busy, keyring: Keyring) -> None:
    before = busy.producer.stats()
    result = status_cli(
        busy.producer.address,
        "--key",
        str(keyring.consumer_secret),
        "--server-key",
        str(keyring.producer_public),
    )
    assert result.returncode != 0
    assert "only answered to admin keys" in result.stderr
    assert keyring.consumer.public_text in result.stderr  # the key to add, named
    assert result.stdout == ""
    after = busy.producer.stats()
    assert (
        after["counters"].get("refused_status", 0)
        == before["counters"].get("refused_status", 0) + 1
    )
    assert after["active_grants"] == before["active_grants"] == 1


def test_admin_key_cannot_open_a_fetch_session(
    keyring: Keyring, admin_secret: Path, spawn_producer: SpawnProducer
) -> None:
    producer = spawn_producer(
        synthetic="64KiB:1",
        config={
            **keyring.producer_config(),
            "admin_keys_file": str(admin_secret.with_suffix(".key")),
        },
        hooks=True,
    )
    client = ControlClient(
        producer.address,
        server_public_key=keyring.producer.public,
        keys=load_keypair(admin_secret),
        settings=LinkSettings(handshake_timeout_s=2.0),
    )
    try:
        assert client.wait_ready(10_000)
        client.send(
            p.Hello(
                versions=[2], session_id="admin-s", client_name="admin", fingerprint=FINGERPRINT
            )
        )
        reply = client.recv(timeout_ms=10_000)
    finally:
        client.close()
    assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.FORBIDDEN, reply
    stats = producer.stats()
    assert stats["sessions"] == 0
    assert stats["counters"]["refused_not_authorized"] == 1


def test_status_reply_lists_what_fits_the_frame_and_counts_every_session() -> None:
    region = Region.create(4 * MiB, name="ecshare-status-test", prefault=False)
    try:
        store = Store(region, BLOCK)
        store.put("h", np.zeros(3 * BLOCK, dtype=np.uint8))
        sessions = [
            SessionView(
                user=load_free_key(i),
                client_name=f"consumer-{i}",
                version=1,
                grants=1,
                pinned_bytes=BLOCK,
                idle_s=0.5,
            )
            for i in range(300)
        ]
        reply = status_reply(
            request_id="r",
            server_name="producer",
            fingerprint="f",
            uptime_s=1.0,
            store=store,
            sessions=sessions,
            counters={"granted": 300},
            max_frame_bytes=8192,
        )
    finally:
        region.close()
    frame = p.Codec(8192).encode(reply)  # fits the producer's own frame limit
    assert p.decode(frame) == reply
    assert 0 < len(reply.sessions) < 300
    assert reply.sessions_total == 300 and reply.peers == 300
    assert reply.grants_active == 300 and reply.pinned_bytes == 300 * BLOCK
    assert reply.entries == 1 and reply.blocks_used == 3


def load_free_key(index: int) -> str:
    from zmq.utils import z85

    return z85.encode(index.to_bytes(32, "little")).decode("ascii")
