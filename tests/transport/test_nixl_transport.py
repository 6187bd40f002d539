"""NixlTransport between real processes over real NIXL (UCX on the loopback device):
what the contract suite (test_transport_contract.py) does not already hold it to.

The contract suite runs every `DataTransport` promise on NIXL over cross-memory
attach and over UCX TCP (byte-exact reads, notifications, bounds, unknown and
lying peers, one region, kills, restarts, and every lifetime rule with a stalled
target). Here: scattered reads drawn by hypothesis, more malformed segments,
reads from two threads at once, NIXL's prepared descriptor lists, and the
`PeerInfo` it publishes. `Side` is also the reader of the other NIXL-only files.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("nixl._api")

from nixl_peer_proc import LOOPBACK, Producer, address, pattern

from ecshare.transport import (
    FailureKind,
    NixlTransport,
    PeerInfo,
    ReadState,
    ReadStatus,
    Segment,
    pair_segments,
)
from ecshare.transport.nixl import may_attach

SIZE = 8 << 20
pytestmark = pytest.mark.timeout(60)


class Side:
    """The consumer: a transport over a zeroed local region, in this process."""

    def __init__(self, **kw: Any) -> None:
        self.mm = mmap.mmap(-1, SIZE)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        env = {**LOOPBACK, **kw.pop("ucx_env", {})}
        self.t = NixlTransport(f"consumer-{uuid.uuid4().hex[:8]}", ucx_env=env, **kw)
        self.t.register(address(self.mm), SIZE)

    def wait(self, handle: Any, timeout: float = 5.0) -> ReadStatus:
        deadline = time.monotonic() + timeout
        while True:
            status = self.t.poll(handle)
            if status.state is not ReadState.PENDING or time.monotonic() > deadline:
                return status

    def read(self, peer: str, segments: list[Segment], notify: bytes = b"") -> ReadStatus:
        handle = self.t.read(peer, segments, notify)
        status = self.wait(handle)
        self.t.release(handle)
        return status

    def close(self) -> None:
        self.t.close()


def _settled(t: NixlTransport) -> int:
    return t.reads_done + sum(t.reads_failed.values()) + t.reads_cancelled


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    p = Producer(f"producer-{uuid.uuid4().hex[:8]}", SIZE, seed=1)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def consumer(producer: Producer) -> Iterator[Side]:
    side = Side()
    side.t.add_peer(producer.info)
    yield side
    side.close()


@pytest.fixture
def clean(consumer: Side) -> Side:
    consumer.mem[:] = 0
    return consumer


@st.composite
def _scattered(draw: st.DrawFn) -> list[Segment]:
    """Extents of mixed sizes (1 B to 256 KiB) placed anywhere, paired across both sides."""

    def extents(lengths: list[int]) -> list[tuple[int, int]]:
        spare = (SIZE - sum(lengths)) // len(lengths)
        out, offset = [], 0
        for n in lengths:
            offset += draw(st.integers(0, spare))
            out.append((offset, n))
            offset += n
        return draw(st.permutations(out))

    sizes = st.sampled_from([1, 7, 4096, 4097, 65536, 262144])
    local_lengths = draw(st.lists(sizes, min_size=1, max_size=16))
    total = sum(local_lengths)
    cuts = sorted(draw(st.lists(st.integers(1, total - 1), max_size=8))) if total > 1 else []
    remote_lengths = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True) if b > a]
    return pair_segments(extents(local_lengths), extents(remote_lengths))


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(segments=_scattered())
def test_scattered_segments_land_byte_exact(
    producer: Producer, consumer: Side, segments: list[Segment]
) -> None:
    consumer.mem[:] = 0
    expected = pattern(producer.seed, SIZE)
    status = consumer.read(producer.info.agent_name, segments)
    assert status.state is ReadState.DONE, status
    written = np.zeros(SIZE, dtype=bool)
    for s in segments:
        got = consumer.mem[s.local_offset : s.local_offset + s.length]
        assert np.array_equal(got, expected[s.remote_offset : s.remote_offset + s.length]), s
        written[s.local_offset : s.local_offset + s.length] = True
    assert not consumer.mem[~written].any(), "bytes outside the segments were written"


@pytest.mark.parametrize(
    "segment",
    # The contract suite holds the rest (past either end, negative, empty, huge).
    [Segment(0, SIZE, 1), Segment(0, -1, 16)],
    ids=["at-peer-end", "negative-remote"],
)
def test_out_of_bounds_segment_is_rejected_before_any_read(
    producer: Producer, clean: Side, segment: Segment
) -> None:
    failed = clean.t.reads_failed[FailureKind.INVALID]
    good = Segment(0, 0, 4096)
    handle = clean.t.read(producer.info.agent_name, [good, segment])
    status = clean.t.poll(handle)
    assert (status.state, status.failure) == (ReadState.FAILED, FailureKind.INVALID)
    assert clean.t.reads_failed[FailureKind.INVALID] == failed + 1
    assert not clean.mem.any(), "a rejected read must not move any byte"
    clean.t.release(handle)
    clean.t.release(handle)


def test_concurrent_reads_from_two_threads_all_land(producer: Producer, clean: Side) -> None:
    expected = pattern(producer.seed, SIZE)
    started = clean.t.reads_started
    errors: list[str] = []

    def worker(base: int) -> None:
        for i in range(40):
            off = base + i * 16384
            status = clean.read(producer.info.agent_name, [Segment(off, off, 16384)])
            if status.state is not ReadState.DONE:
                errors.append(str(status))

    threads = [threading.Thread(target=worker, args=(b,)) for b in (0, 4 << 20)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert errors == []
    assert np.array_equal(clean.mem[: 640 << 10], expected[: 640 << 10])
    assert np.array_equal(
        clean.mem[4 << 20 : (4 << 20) + (640 << 10)], expected[4 << 20 :][: 640 << 10]
    )
    assert clean.t.reads_started == started + 80
    assert _settled(clean.t) == clean.t.reads_started


def test_prepared_lists_serve_aligned_reads_and_fall_back_for_others(producer: Producer) -> None:
    side = Side(prepared_block_size=65536)
    try:
        side.t.add_peer(producer.info)
        expected = pattern(producer.seed, SIZE)
        aligned = pair_segments([(65536, 65536), (0, 65536)], [(1 << 20, 131072)])
        unaligned = [Segment(2 << 20, 100, 5000)]
        for segs in (aligned, unaligned):
            assert side.read(producer.info.agent_name, segs).state is ReadState.DONE
            for s in segs:
                got = side.mem[s.local_offset : s.local_offset + s.length]
                assert np.array_equal(got, expected[s.remote_offset : s.remote_offset + s.length])
        assert side.t.reads_prepped == 1
    finally:
        side.close()


def test_peer_info_is_what_was_registered(producer: Producer) -> None:
    info: PeerInfo = producer.info
    assert info.kind == "nixl"
    assert info.region_size == SIZE
    assert info.agent_metadata


_BACKEND = (
    "import sys\n"
    "from ecshare.transport.nixl import _import_nixl\n"
    "api = _import_nixl()\n"
    "print(api.nixl_agent.__module__, 'torch' in sys.modules)\n"
)
_ON_ITS_OWN = "import sys, nixl._api as a; print(a.nixl_agent.__module__, 'torch' in sys.modules)"


def _python(code: str) -> str:
    root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
        check=True,
    )  # fmt: skip
    return proc.stdout.strip()


def test_nixl_loads_the_backend_it_would_pick_without_importing_torch() -> None:
    # On a CPU build of torch, `import nixl` alone imports all of torch to learn
    # that there is no CUDA (2 s of CPU in every data-plane process); ecshare
    # gives it that answer, and the backend must be the one nixl picks itself.
    module, torch_loaded = _python(_ON_ITS_OWN).split()
    if torch_loaded == "False":
        pytest.skip("this nixl loads without torch by itself: nothing to spare")
    assert _python(_BACKEND) == f"{module} False"


@pytest.mark.parametrize(
    ("ucx_tls", "attaches"),
    [
        ("", True),  # UCX's default: every transport, cross-memory attach among them
        ("all", True),
        ("tcp", False),
        ("tcp,cma", True),
        ("rc,sm", True),
        ("rc_x,ud_x", False),
        ("^cma", False),
        ("^sm", False),
        ("^tcp", True),
    ],
)
def test_may_attach_reads_ucx_tls(ucx_tls: str, attaches: bool) -> None:
    assert may_attach(ucx_tls) is attaches


def test_a_transport_knows_whether_a_read_may_copy_inside_the_call() -> None:
    """From the UCX_TLS it was created with: over TCP alone a READ is never a copy made
    inside the read call, so no waiting caller's thread is worth lending to one."""
    tcp = NixlTransport(f"tls-tcp-{uuid.uuid4().hex[:8]}", ucx_env={"UCX_TLS": "tcp"})
    default = NixlTransport(f"tls-all-{uuid.uuid4().hex[:8]}")
    try:
        assert not tcp.may_copy_in_call
        assert default.may_copy_in_call is may_attach(os.environ.get("UCX_TLS", ""))
    finally:
        tcp.close()
        default.close()
