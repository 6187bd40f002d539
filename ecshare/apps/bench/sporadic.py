"""Sporadic fetches: a fresh entry, an idle gap, one fetch, as real EPD traffic comes.

An encoder writes an entry, and a few milliseconds later one prefill/decode
instance fetches it, while the threads on both sides have gone idle. Per sample:

* ``ecshare``: the producer process writes a fresh entry (new bytes into newly
  allocated blocks), the harness sleeps the gap, then one ``Consumer.fetch`` is
  timed until its result is in hand, and every byte is checked. The harness
  blocks on the result, as a caller that waits for its fetch does, and so lends
  its thread to the fetch's direct read; with ``hand_off`` it waits as an
  engine's scheduler would, never on the future, and the consumer's network
  thread makes the READ (`await_fetches`);
* ``raw NIXL``: the producer process writes fresh bytes over the same extents,
  the harness sleeps the same gap, then one ``NixlTransport.read`` of those
  extents is timed until ``poll`` says DONE, and every byte is checked;
* ``memcpy``: after the samples above, as many copies of the raw READ's bytes
  inside this process, each after the same gap. Not between a raw READ and the
  next fetch: what it leaves dirty in the caches is written back during the
  next READ's copy, which made the fetch's READ call slower than the raw one.

Both sides record per-phase timestamps (`ecshare.peer.phases`) on the host's
one monotonic clock, so the report shows where a fetch's time goes: waking
the consumer's thread, the request's way to the producer's thread, the grant,
the answer's way back, the READ, the commit and waking the caller.

The producer's network thread's CPU time is read from its thread CPU clock
over the whole run (its share of one core under this traffic), and over a
quiet second while a grant is held and nothing moves (a bare control client
takes a grant and sits on it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait

import msgspec
import numpy as np
import numpy.typing as npt

from ecshare import protocol as p
from ecshare.apps.bench.fetch_producer import FetchProducer, fill_value
from ecshare.control import ControlClient, KeyPair
from ecshare.peer import Consumer, FetchResult
from ecshare.peer.phases import PhaseLog
from ecshare.store import Store
from ecshare.transport.base import ReadState, pair_segments
from ecshare.transport.nixl import NixlTransport

__all__ = [
    "DEFAULT_GAP_S",
    "SPORADIC_SIZES",
    "SPORADIC_WARMUP",
    "ProducerCpu",
    "SporadicFigures",
    "await_fetches",
    "hold_grant_cpu",
    "measure_sporadic",
    "sporadic_samples",
]

KiB = 1 << 10
MiB = 1 << 20
# 4,505,600 bytes: one 880 x 2560 bf16 image embedding.
SPORADIC_SIZES = (64 * KiB, 1 * MiB, 4_505_600, 16 * MiB)
DEFAULT_GAP_S = 0.005
# Samples per size (full, quick), each one ecshare fetch and one raw read.
_SAMPLES = {64 * KiB: (300, 40), 1 * MiB: (200, 30), 4 * MiB: (120, 25), 16 * MiB: (80, 20)}
SPORADIC_WARMUP = 3
_FETCH_TIMEOUT_S = 30.0
_HOLD_S = 1.0

Bytes = npt.NDArray[np.uint8]
# Consumer and producer marks of one fetch, in the order they happen, and the
# name of the step that ends at each (see ecshare/peer/phases.py).
ECSHARE_STEPS = (
    ("picked", "wake consumer thread"),
    ("sent", "send request"),
    ("p_woke", "request to producer thread"),
    ("recv", "producer: read request"),
    ("replied", "grant"),
    ("c_woke", "reply to consumer thread"),
    ("granted", "consumer: read reply"),
    ("read_start", "allocate destination"),
    ("read_return", "READ call"),
    ("done", "READ to DONE"),
    ("result", "commit"),
    ("woken", "wake caller"),
)
# A direct read (the producer told where the entry lies): no request, no grant.
DIRECT_STEPS = (
    ("picked", "wake consumer thread"),
    ("granted", "look up location"),
    ("read_start", "allocate destination"),
    ("read_return", "READ call"),
    ("done", "READ to DONE"),
    ("checked", "check (digest, or tag READ)"),
    ("committed", "commit"),
    ("result", "resolve"),
    ("woken", "wake caller"),
)
RAW_STEPS = (("read_return", "READ call"), ("done", "READ to DONE"))


class SporadicFigures(msgspec.Struct, frozen=True):
    size_bytes: int
    samples: int
    gap_ms: float
    ecshare_s: list[float]
    raw_s: list[float]
    memcpy_s: list[float]
    # Median milliseconds of each step, in order; their sum is close to, not equal
    # to, the median total.
    ecshare_phases_ms: dict[str, float]
    raw_phases_ms: dict[str, float]


class ProducerCpu(msgspec.Struct, frozen=True):
    """The producer's network thread's CPU time, as a share of one core."""

    sporadic_share: float  # over the sporadic samples, gaps included
    sporadic_us_per_fetch: float
    held_grant_share: float | None  # a grant held, nothing moving; None: not measured


def sporadic_samples(size: int, quick: bool) -> int:
    listed = [s for s in sorted(_SAMPLES) if s >= size] or [max(_SAMPLES)]
    full, short = _SAMPLES[listed[0]]
    return short if quick else full


def _steps_ms(
    marks: Sequence[dict[str, float]], steps: Sequence[tuple[str, str]]
) -> dict[str, float]:
    out: dict[str, float] = {}
    for i, (mark, name) in enumerate(steps):
        before = "call" if i == 0 else steps[i - 1][0]
        spans = [m[mark] - m[before] for m in marks if mark in m and before in m]
        if spans:
            out[name] = round(float(np.median(spans)) * 1000, 4)
    return out


def _ecshare_steps_ms(marks: Sequence[dict[str, float]]) -> dict[str, float]:
    """The steps of the kind of fetch most samples took: asked for, or read directly."""
    direct = [m for m in marks if "sent" not in m]
    if len(direct) * 2 > len(marks):
        return _steps_ms(direct, DIRECT_STEPS)
    return _steps_ms([m for m in marks if "sent" in m], ECSHARE_STEPS)


def _by_key(records: Sequence[tuple[str, str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key, phase, at in records:
        out.setdefault(key, {}).setdefault(phase, at)  # the first of each: the first attempt
    return out


def await_fetches(futures: Sequence[Future[FetchResult]], hand_off: bool) -> float:
    """Wait for `futures` as the bench's caller: blocking on each result in turn, as a
    caller that waits for its fetches does (the first lends this thread to their
    direct reads: `Consumer.fetch`), or with `hand_off`, with `concurrent.futures.wait`,
    as an engine's scheduler that never blocks on a future: the network thread makes
    every READ. Returns when (`time.monotonic`) the last was done; raises a failed
    fetch's error."""
    if hand_off:
        wait(futures, timeout=_FETCH_TIMEOUT_S)
        done = time.monotonic()
        for f in futures:
            f.result(timeout=0)
        return done
    for f in futures:
        f.result(timeout=_FETCH_TIMEOUT_S)
    return time.monotonic()


def measure_sporadic(
    *,
    size: int,
    samples: int,
    gap_s: float,
    consumer: Consumer,
    store: Store,
    peers: list[str],
    producer: FetchProducer,
    raw: NixlTransport,
    raw_peer: str,
    raw_buf: Bytes,
    memcpy_dst: Bytes,
    advance: Callable[[], None],
    read_here: bool = False,
    hand_off: bool = False,
) -> SporadicFigures:
    """`samples` sporadic fetches of `size` bytes and as many raw reads, after a warm-up."""
    consumer.phases = PhaseLog()
    eco: list[float] = []
    raws: list[float] = []
    mems: list[float] = []
    eco_marks: dict[str, dict[str, float]] = {}
    produced: list[tuple[str, str, float]] = []  # the producer's marks, as they come back
    raw_marks: list[dict[str, float]] = []
    try:
        for i in range(SPORADIC_WARMUP + samples):
            seq = i + 1
            # ecshare: fresh entry, gap, fetch.
            fresh = producer.fresh(size, seq)
            h, extents = fresh.mm_hash, fresh.extents
            produced += fresh.marks
            time.sleep(gap_s)
            t0 = time.monotonic()
            futures = consumer.fetch([h], peers, read_here=read_here)
            t1 = await_fetches(futures, hand_off)
            _check(store.read(h).reshape(-1).view(np.uint8), fill_value(seq), h)
            store.remove(h)
            marks = _by_key(consumer.phases.take()).get(h, {})
            marks["woken"] = t1
            # raw NIXL: fresh bytes over the same extents, gap, one READ.
            producer.refill(h, fill_value(seq + 1))
            time.sleep(gap_s)
            segments = pair_segments([(0, size)], extents)
            r0 = time.monotonic()
            handle = raw.read(raw_peer, segments)
            r1 = time.monotonic()
            status = raw.poll(handle)
            while status.state is ReadState.PENDING:
                status = raw.poll(handle)
            r2 = time.monotonic()
            raw.release(handle)
            if status.state is not ReadState.DONE:
                raise RuntimeError(f"raw NIXL read failed: {status}")
            _check(raw_buf[:size], fill_value(seq + 1), "the raw read")
            advance()
            if i < SPORADIC_WARMUP:
                continue
            eco_marks[h] = marks
            eco.append(t1 - t0)
            raws.append(r2 - r0)
            raw_marks.append({"call": r0, "read_return": r1, "done": r2})
        produced += producer.marks()
        # The memcpy reference on its own, after the same gap: made between the raw
        # READ and the next fetch, the 2 x `size` bytes it leaves dirty in the caches
        # were written back during the next fetch's copy (and never during a raw
        # READ's): 0.04 to 0.2 ms more in that READ call at 16 MiB here.
        for _ in range(samples):
            time.sleep(gap_s)
            m0 = time.monotonic()
            np.copyto(memcpy_dst[:size], raw_buf[:size])
            mems.append(time.monotonic() - m0)
    finally:
        consumer.phases = None
    for key, marks in _by_key(produced).items():
        if key in eco_marks:
            eco_marks[key].update(marks)
    return SporadicFigures(
        size_bytes=size,
        samples=samples,
        gap_ms=gap_s * 1000,
        ecshare_s=eco,
        raw_s=raws,
        memcpy_s=mems,
        ecshare_phases_ms=_ecshare_steps_ms(list(eco_marks.values())),
        raw_phases_ms=_steps_ms(raw_marks, RAW_STEPS),
    )


def _check(got: Bytes, value: int, what: str) -> None:
    if not (got[0] == value and got[-1] == value and np.all(got == value)):
        raise RuntimeError(f"bytes of {what} differ from what the producer wrote")


def hold_grant_cpu(
    *,
    address: str,
    keys: KeyPair,
    server_key: bytes,
    fingerprint: str,
    producer: FetchProducer,
    size: int,
) -> float:
    """The producer thread's CPU share over a quiet second while a grant is held."""
    h = producer.fresh(size, 1).mm_hash
    client = ControlClient(address, server_public_key=server_key, keys=keys)
    try:
        session = uuid.uuid4().hex
        client.send(
            p.Hello(
                versions=list(p.SUPPORTED_VERSIONS),
                session_id=session,
                client_name="ecshare-bench-hold",
                fingerprint=fingerprint,
            )
        )
        if not isinstance(client.recv(timeout_ms=10_000), p.Welcome):
            raise RuntimeError("the producer did not welcome the bench's holding session")
        client.send(p.FetchRequest(session_id=session, request_id="hold", items=[p.ItemRequest(h)]))
        reply = client.recv(timeout_ms=10_000)
        if not isinstance(reply, p.FetchReply) or not reply.items[0].grant_id:
            raise RuntimeError(f"the producer did not grant the bench's held item: {reply}")
        cpu0, wall0 = producer.cpu()
        time.sleep(_HOLD_S)
        cpu1, wall1 = producer.cpu()
        client.send(p.Release(session_id=session, grant_ids=[reply.items[0].grant_id]))
        client.recv(timeout_ms=10_000)
        client.send(p.Bye(session_id=session))
    finally:
        client.close()
    return float((cpu1 - cpu0) / (wall1 - wall0))
