"""Readers may write: what a consumer holding a producer's NIXL metadata can do to its region.

NIXL registers memory with every access (its UCX backend calls `ucp_mem_map` with no
`prot`), and over cross-memory attach (`process_vm_writev`) or UCX's TCP transport (the
target `recv`s a PUT straight into the address its header names) nothing on the
producer's side checks a remote write at all. So a consumer, which must hold the
producer's metadata to READ, can WRITE the producer's region too: the first tests show
it, between real processes, over both (and, with its copy of the metadata edited, any
memory of the producer's process). What ecshare promises instead is that a write into
the region is harmless once checksums are on (`checksum: xxh3_64` on both sides): the digest
a consumer checks is taken at commit and held outside the region (in the entry's meta,
told on the authenticated control plane), so no path serves the foreign bytes:

- a granted read and a direct read (by digest or by tag) fail their check, counted, and
  are never committed on the consumer;
- a push carries the commit digest, and the consumer's inbox refuses the written bytes;
- the producer's own load of the entry (`Store.verify`) finds it changed, counts it and
  drops the entry, so that it is encoded again.

Not promised: anything with `checksum: none` (tags prove only that the blocks were the
entry's); a write crafted to keep the xxh3-64 digest (it is no cryptographic hash); a
write that lands before the digest is taken.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transport"))

from nixl_peer_proc import Producer as RawProducer
from nixl_peer_proc import Writer, pattern
from peer_testing import Keyring, MakeConsumer, MakeProducer, expected
from waiting import wait_until

from ecshare.peer import FailureReason, FetchFailed, FetchItem, Node
from ecshare.peer.locator import DIGEST_MAX
from ecshare.store import EntryState

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20
TCP = {"UCX_TLS": "tcp"}
PLANES: dict[str, dict[str, Any]] = {
    "cma": {},
    "tcp": {"ucx_tls": "tcp", "ucx_net_devices": "lo"},
}
CHECKED = {"checksum": "xxh3_64", "store_canary": True}
# What each serving path reads: a direct read of a small entry is checked by its digest,
# one over DIGEST_MAX by its tag (which says nothing of the bytes); a push is written.
PATHS = {
    "granted": ({"direct_reads": False}, 3 * MiB + 5),
    "direct-by-digest": ({}, 64 * 1024),
    "direct-by-tag": ({}, 3 * MiB + 5),
    "direct-by-nixl-tag": ({"tag_peek": False}, 3 * MiB + 5),
    "pushed": ({"push_name": "pd-0", "direct_reads": False}, 3 * MiB + 5),
}


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_a_reader_that_edits_the_metadata_writes_memory_nixl_never_registered(
    data_plane: str,
) -> None:
    """Worse, and beyond ecshare's reach: the bounds of a peer's region are checked only
    by the initiator's own NIXL, against what the metadata says, and the target checks
    nothing. Sixteen bytes of the metadata changed, and a stock NIXL writes any memory of
    the producer's process. A consumer is trusted with the producer's process on these
    transports; the digests below protect the entries from writes, not the process."""
    env = TCP if data_plane == "tcp" else {}
    producer = RawProducer(f"rw-forged-{uuid.uuid4().hex[:8]}", MiB, seed=12, env=env)
    writer = None
    try:
        info = producer.info
        private, size, before = producer.call("private", 4096)
        told = struct.pack("<QQ", info.region_address, info.region_size)
        at = info.agent_metadata.find(told)
        assert at > 0 and info.agent_metadata.count(told) == 1
        forged = bytearray(info.agent_metadata)
        forged[at : at + 16] = struct.pack("<QQ", private, size)
        writer = Writer(
            dataclasses.replace(
                info, agent_metadata=bytes(forged), region_address=private, region_size=size
            ),
            MiB,
            env=env,
        )
        assert writer.write(0, 4096, 0x77) == ("done", None)
        _, _, after = producer.call("private", 4096)
        assert set(before) == {0} and set(after) == {0x77}
    finally:
        if writer is not None:
            writer.stop()
        producer.stop()


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_a_reader_holding_the_producers_metadata_can_write_its_region(data_plane: str) -> None:
    """The fact every other promise here is built around: NIXL lets a reader write."""
    env = TCP if data_plane == "tcp" else {}
    size = 4 * MiB
    producer = RawProducer(f"rw-target-{uuid.uuid4().hex[:8]}", size, seed=11, env=env)
    writer = None
    try:
        writer = Writer(producer.info, size, env=env)
        state, failure = writer.write(MiB, 64 * 1024, 0x5A)
        assert (state, failure) == ("done", None)
        landed = np.frombuffer(producer.call("slice", (MiB, MiB + 64 * 1024)), dtype=np.uint8)
        assert (landed == 0x5A).all()
        before = np.frombuffer(producer.call("slice", (0, MiB)), dtype=np.uint8)
        assert np.array_equal(before, pattern(11, size)[:MiB])  # nothing else touched
    finally:
        if writer is not None:
            writer.stop()
        producer.stop()


def _write_over(pnode: Node, h: str, data_plane: str) -> None:
    """Another process, holding `pnode`'s NIXL metadata as each of its consumers does,
    writes 4 KiB of foreign bytes over the start of committed entry `h`."""
    entry = pnode.store.get(h)
    assert entry is not None and entry.state is EntryState.READY
    offset, _ = entry.extents[0]
    writer = Writer(pnode.transport.local_info(), MiB, env=TCP if data_plane == "tcp" else {})
    try:
        assert writer.write(offset, 4096, 0x5A) == ("done", None)
    finally:
        writer.stop()
    assert (pnode.store.read(h)[:4096].view(np.uint8) == 0x5A).all()  # it did land


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("data_plane", list(PLANES))
def test_a_readers_write_into_the_producers_region_is_never_served(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    data_plane: str,
    path: str,
) -> None:
    plane = PLANES[data_plane]
    extra, n = PATHS[path]
    h = f"rw-{path}"
    pnode, producer = make_producer(keyring.producer_config(), plane, CHECKED)
    cnode, consumer = make_consumer(keyring.consumer_config(), plane, CHECKED, extra)
    consumer.connect([producer.address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    pnode.store.put(h, expected(h, n), checksum=True)  # its digest recorded at commit
    if path.startswith("direct"):
        heard = lambda: consumer.counter_snapshot().get("locations_heard", 0) >= 1  # noqa: E731
        wait_until(heard, timeout_s=5.0)

    _write_over(pnode, h, data_plane)
    if path == "pushed":
        producer.push(h, to="pd-0").result(timeout=30)
        refused = lambda: consumer.counter_snapshot().get("push_checksum_failures", 0) == 1  # noqa: E731
        wait_until(refused, timeout_s=10.0)
        assert cnode.store.get(h) is None
    failed = consumer.fetch([FetchItem(h)], [producer.address])[0].exception(timeout=30)

    assert isinstance(failed, FetchFailed), failed
    assert failed.reason is FailureReason.CHECKSUM_MISMATCH
    assert cnode.store.get(h) is None  # never committed: the engine encodes it instead
    counters = consumer.counter_snapshot()
    assert counters["checksum_failures"] == 1
    if path.startswith("direct"):
        assert counters["direct_reads"] == 1 and counters["direct_reads_stale"] == 1
        if path != "direct-by-digest":
            assert n > DIGEST_MAX  # the tag alone would have passed it
    assert consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0


def test_the_producers_own_load_finds_a_foreign_write_and_drops_the_entry(
    make_producer: MakeProducer, keyring: Keyring
) -> None:
    h, n = "rw-local", 3 * MiB + 5
    pnode, _ = make_producer(keyring.producer_config(), CHECKED)
    pnode.store.put(h, expected(h, n), checksum=True)
    kept = "rw-kept"
    pnode.store.put(kept, expected(kept, n), checksum=True)
    entry = pnode.store.get(h)
    assert entry is not None

    _write_over(pnode, h, "cma")

    assert pnode.store.verify(entry) is False
    assert pnode.store.get(h) is None  # dropped: encoded again, never loaded
    assert pnode.store.stats().foreign_writes == 1
    other = pnode.store.get(kept)
    assert other is not None and pnode.store.verify(other)
    assert pnode.store.stats().foreign_writes == 1
