"""What checking a read against its commit digest costs, against the READ itself.

A reader can write a producer's region through NIXL (tests/security/test_reader_write.py),
so the bytes a consumer commits are shown to be the entry's only by a digest taken at
commit and held outside the region (`checksum: xxh3_64`): one pass over the bytes on
the consumer per read (and one on the producer per commit). This measures that pass,
with xxh3-64 (what `Store.checksum` takes) and with BLAKE3 (a digest a writer cannot
match on purpose), against a raw NIXL READ of the same bytes from a producer process on
this host, through ecshare's own transport, in the same run, interleaved.

Run: ``PYTHONPATH=$PWD python benchmarks/reader_write_check.py [--tls tcp] [--reps 30]``
"""

from __future__ import annotations

import argparse
import functools
import mmap
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import blake3
import numpy as np
import xxhash

from ecshare.transport import NixlTransport, PeerInfo, ReadState, Segment

MiB = 1 << 20
SIZES = (64 * 1024, MiB, 4 * MiB, 16 * MiB)
REGION = 32 * MiB


def _address(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)


def _producer(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    mm = mmap.mmap(-1, REGION)
    np.frombuffer(mm, dtype=np.uint8)[:] = np.random.default_rng(1).integers(
        0, 256, REGION, dtype=np.uint8
    )
    t = NixlTransport("rw-bench-producer", progress_thread=True)
    t.register(_address(mm), REGION)
    conn.send(t.local_info())
    conn.recv()
    t.close()


def _median_us(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up: connection wire-up, page faults
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tls", default="", help="UCX_TLS for both sides (e.g. tcp)")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    env = {"UCX_NET_DEVICES": "lo", **({"UCX_TLS": args.tls} if args.tls else {})}
    os.environ.update(env)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, env), daemon=True)
    proc.start()
    info: PeerInfo = conn.recv()
    mm = mmap.mmap(-1, REGION)
    local = np.frombuffer(mm, dtype=np.uint8)
    t = NixlTransport("rw-bench-consumer")
    t.register(_address(mm), REGION)
    t.add_peer(info)

    def read(n: int) -> None:
        handle = t.read(info.agent_name, [Segment(0, 0, n)])
        while t.poll(handle).state is ReadState.PENDING:
            pass
        assert t.poll(handle).state is ReadState.DONE
        t.release(handle)

    print(f"UCX_TLS={args.tls or 'default (cma on one host)'}, median of {args.reps}, us")
    print(f"{'bytes':>9} {'READ':>8} {'xxh3':>8} {'xxh3/READ':>9} {'blake3':>8} {'b3/READ':>8}")
    per_mib: dict[str, list[float]] = {"READ": [], "xxh3": [], "blake3": []}
    try:
        for n in SIZES:
            view = local[:n].data
            r = _median_us(functools.partial(read, n), args.reps)
            x = _median_us(functools.partial(xxhash.xxh3_64_intdigest, view), args.reps)
            b = _median_us(lambda: blake3.blake3(view).digest(8), args.reps)  # noqa: B023
            for k, v in (("READ", r), ("xxh3", x), ("blake3", b)):
                per_mib[k].append(v * MiB / n)
            print(f"{n:>9} {r:>8.1f} {x:>8.1f} {x / r:>9.2f} {b:>8.1f} {b / r:>8.2f}")
        print(
            "per MiB (us), at 1 MiB and up: "
            + ", ".join(f"{k} {min(v[1:]):.0f}-{max(v[1:]):.0f}" for k, v in per_mib.items())
        )
    finally:
        conn.send("stop")
        proc.join(10)
        t.close()


if __name__ == "__main__":
    main()
