"""Per-read cost of NIXL descriptor handling: initialize_xfer vs prepared lists.

Two processes on this host: a producer registers a region and polls its
notifications; the consumer READs 1..4 descriptors from it, each read built
either with ``initialize_xfer`` (descriptor lists built per read) or with
``make_prepped_xfer`` over lists prepared once per peer (one descriptor per
fixed-size block of each region). Timing covers build + post + completion +
release of one read, i.e. what ``NixlTransport.read`` + ``poll`` + ``release``
pay per call, excluding Python-side bookkeeping.

Run: ``UCX_NET_DEVICES=lo python benchmarks/nixl_descriptors.py [--tls tcp]``
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

REGION = 64 << 20


def _address(mm: mmap.mmap) -> int:
    return int(np.frombuffer(mm, dtype=np.uint8).ctypes.data)


def _agent(name: str) -> Any:
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def _producer(conn: Connection, env: dict[str, str]) -> None:
    os.environ.update(env)
    mm = mmap.mmap(-1, REGION)
    mm[:] = bytes(range(256)) * (REGION // 256)
    agent = _agent("bench-producer")
    addr = _address(mm)
    agent.register_memory([(addr, REGION, 0, "")], "DRAM")
    conn.send((agent.get_agent_metadata(), addr))
    while not conn.poll(0):
        agent.get_new_notifs()
    conn.recv()


def _time(fn: Any, reps: int) -> float:
    fn()  # warm-up (connection set-up, page faults)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _transport_table(peer: str, meta: bytes, raddr: int, args: Any, env: dict[str, str]) -> None:
    """The same reads through NixlTransport: read + poll + release, both modes."""
    from ecshare.transport import NixlTransport, PeerInfo, ReadState, Segment

    info = PeerInfo("nixl", peer, meta, raddr, REGION)
    block = args.block
    transports = {}
    for label, prepared in (("init_xfer", 0), ("prepped", block)):
        mm = mmap.mmap(-1, REGION)
        t = NixlTransport(f"bench-{label}", ucx_env=env, prepared_block_size=prepared)
        t.register(_address(mm), REGION)
        t.add_peer(info)
        transports[label] = (t, mm)

    print(f"# NixlTransport read+poll+release (prepared_block_size={block})")
    print(f"{'desc':>4} {'bytes/desc':>10} {'init_xfer us':>13} {'prepped us':>11}")
    for size in (int(s) for s in args.sizes.split(",")):
        stride = max(size, block) * 2
        for n in range(1, 5):
            segs = [Segment(i * stride, i * stride, size) for i in range(n)]
            row = []
            for t, _ in transports.values():

                def one(t: Any = t, segs: list[Segment] = segs) -> None:
                    h = t.read(peer, segs)
                    while t.poll(h).state is ReadState.PENDING:
                        pass
                    assert t.poll(h).state is ReadState.DONE, t.poll(h)
                    t.release(h)

                row.append(_time(one, args.reps))
            print(f"{n:>4} {size:>10} {row[0]:>13.1f} {row[1]:>11.1f}")
    t = transports["init_xfer"][0]
    t0 = time.perf_counter()
    for _ in range(10000):
        t.progress()
    print(f"# progress() with nothing to do: {(time.perf_counter() - t0) * 1e2:.2f} us per call")
    for t, _ in transports.values():
        t.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tls", default="", help="force UCX_TLS (e.g. tcp)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--block", type=int, default=64 << 10, help="prepared block size")
    ap.add_argument("--sizes", default="4096,65536,1048576", help="bytes per descriptor")
    args = ap.parse_args()

    env = {"UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    if args.tls:
        env["UCX_TLS"] = args.tls
    os.environ.update(env)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_producer, args=(child, env), daemon=True)
    proc.start()
    try:
        meta, raddr = parent.recv()
        mm = mmap.mmap(-1, REGION)
        laddr = _address(mm)
        agent = _agent("bench-consumer")
        agent.register_memory([(laddr, REGION, 0, "")], "DRAM")
        peer = agent.add_remote_agent(meta)
        peer = peer.decode() if isinstance(peer, bytes) else peer

        block = args.block
        nblocks = REGION // block
        t0 = time.perf_counter()
        starts = np.arange(nblocks, dtype=np.uint64) * np.uint64(block)
        rows = np.zeros((nblocks, 3), dtype=np.uint64)
        rows[:, 1] = block
        rows[:, 0] = starts + np.uint64(laddr)
        local_prep = agent.prep_xfer_dlist("NIXL_INIT_AGENT", rows, "DRAM")
        rows[:, 0] = starts + np.uint64(raddr)
        remote_prep = agent.prep_xfer_dlist(peer, rows, "DRAM")
        prep_ms = (time.perf_counter() - t0) * 1e3
        print(
            f"# UCX_TLS={args.tls or 'default'}; prep_xfer_dlist of both regions "
            f"({nblocks} x {block >> 10} KiB blocks): {prep_ms:.1f} ms once per peer"
        )

        def run(h: Any) -> None:
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            assert state == "DONE", state
            agent.release_xfer_handle(h)

        print(f"{'desc':>4} {'bytes/desc':>10} {'init_xfer us':>13} {'prepped us':>11}")
        for size in (int(s) for s in args.sizes.split(",")):
            per_block = max(1, size // block)
            for n in range(1, 5):
                # Descriptors 2 blocks apart so that NIXL cannot merge them.
                offs = [i * 2 * per_block * block for i in range(n)]
                ldesc = [(laddr + o, size, 0) for o in offs]
                rdesc = [(raddr + o, size, 0) for o in offs]

                def init_read(ldesc: Any = ldesc, rdesc: Any = rdesc) -> None:
                    local = agent.get_xfer_descs(ldesc, "DRAM")
                    remote = agent.get_xfer_descs(rdesc, "DRAM")
                    run(agent.initialize_xfer("READ", local, remote, peer, b""))

                idx: list[int] = []
                for o in offs:
                    idx.extend(range(o // block, o // block + per_block))
                if size < block:
                    prepped_us = float("nan")  # sub-block reads need initialize_xfer
                else:

                    def prepped_read(idx: list[int] = idx) -> None:
                        run(agent.make_prepped_xfer("READ", local_prep, idx, remote_prep, idx, b""))

                    prepped_us = _time(prepped_read, args.reps)
                init_us = _time(init_read, args.reps)
                print(f"{n:>4} {size:>10} {init_us:>13.1f} {prepped_us:>11.1f}")
        agent.release_dlist_handle(local_prep)
        agent.release_dlist_handle(remote_prep)
        _transport_table(peer, meta, raddr, args, env)
    finally:
        parent.send("stop")
        proc.join(5)


if __name__ == "__main__":
    main()
