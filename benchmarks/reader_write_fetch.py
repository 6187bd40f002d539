"""What a fetch pays for making a reader's write harmless: `checksum: xxh3_64` against `none`.

A reader can write a producer's region through NIXL; with `checksum: xxh3_64` on both
sides no path serves what it wrote (tests/security/test_reader_write.py), for one pass
over the bytes on the consumer per fetch (and one on the producer per commit, not timed
here). Two producer processes on this host, one per setting, and a consumer of each in
this process; sporadic fetches (a fresh entry, an idle gap, one fetch), the two settings
taking turns sample by sample, so that both see the same load. Direct reads are on
(the default), so entries up to 1 MiB are checked by digest either way, and larger
ones by tag alone under `none`, by tag and digest under `xxh3_64`.

Run: ``PYTHONPATH=$PWD python benchmarks/reader_write_fetch.py [--samples 40] [--tls tcp]``
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from ecshare.config import Config
from ecshare.control import generate_keypair
from ecshare.peer import Consumer, Node, start_consumer, start_producer

MiB = 1 << 20
SIZES = (64 * 1024, MiB, 4 * MiB, 16 * MiB)
FINGERPRINT = "ecshare-reader-write-bench"
SETTINGS = ("none", "xxh3_64")


def _producer(conn: Connection, settings: dict[str, Any], checked: bool) -> None:
    node = Node.create(Config.from_dict(settings), "producer")
    producer = start_producer(node, fingerprint=FINGERPRINT)
    conn.send(producer.address)
    try:
        while True:
            cmd = conn.recv()
            if cmd is None:
                return
            h, n = cmd
            node.store.evict_bytes(node.store.stats().bytes_used)  # room, and no stale hits
            node.store.put(h, np.full(n, len(h) % 251, dtype=np.uint8), checksum=checked)
            conn.send(h)
    finally:
        producer.stop()
        node.close()


class _Pair:
    """A producer process with one setting, and a consumer of it in this process."""

    def __init__(self, setting: str, keys: dict[str, Any], data_plane: dict[str, str]) -> None:
        common = {"region_bytes": 64 * MiB, "checksum": setting, **data_plane}
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        producer_settings = {
            **common,
            "server_secret_key_file": str(keys["producer"].secret_path),
            "authorized_keys_file": str(keys["consumer"].public_path),
        }
        self.proc = ctx.Process(
            target=_producer, args=(child, producer_settings, setting != "none"), daemon=True
        )
        self.proc.start()
        self.address: str = self.conn.recv()
        config = Config.from_dict(
            {
                **common,
                "client_secret_key_file": str(keys["consumer"].secret_path),
                "server_public_key_file": str(keys["producer"].public_path),
            }
        )
        self.node = Node.create(config, "consumer")
        self.consumer: Consumer = start_consumer(self.node, fingerprint=FINGERPRINT)
        self.consumer.connect([self.address])
        deadline = time.monotonic() + 30
        while not any(p.up for p in self.consumer.peer_liveness()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no session with the {setting} producer")
            time.sleep(0.01)
        self.setting = setting
        self.count = 0

    def sample(self, n: int, gap_s: float) -> float:
        """One sporadic fetch of a fresh entry of `n` bytes; its latency in ms."""
        self.count += 1
        h = f"{self.setting}-{n}-{self.count}"
        self.node.store.evict_bytes(self.node.store.stats().bytes_used)
        self.conn.send((h, n))
        self.conn.recv()
        time.sleep(gap_s)
        t0 = time.perf_counter()
        result = self.consumer.fetch([h], [self.address])[0].result(timeout=30)
        elapsed = (time.perf_counter() - t0) * 1e3
        assert result.nbytes == n
        return elapsed

    def close(self) -> None:
        self.consumer.stop()
        self.node.close()
        self.conn.send(None)
        self.proc.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--tls", default="", help="ucx_tls for every peer (e.g. tcp)")
    args = parser.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    plane = {"ucx_tls": args.tls, "ucx_net_devices": "lo"} if args.tls else {}
    with tempfile.TemporaryDirectory() as workdir:
        keys = {r: generate_keypair(workdir, r) for r in ("producer", "consumer")}
        pairs = [_Pair(s, keys, plane) for s in SETTINGS]
        try:
            print(f"UCX_TLS={args.tls or 'default'}; sporadic fetches, p50 over {args.samples}")
            print(f"{'bytes':>9} {'none ms':>9} {'xxh3 ms':>9} {'xxh3-none':>10} {'ratio':>6}")
            for n in SIZES:
                got: dict[str, list[float]] = {s: [] for s in SETTINGS}
                for _ in range(3):  # warm-up
                    for pair in pairs:
                        pair.sample(n, args.gap_ms / 1e3)
                for i in range(args.samples):
                    for pair in pairs if i % 2 else pairs[::-1]:
                        got[pair.setting].append(pair.sample(n, args.gap_ms / 1e3))
                a, b = (statistics.median(got[s]) for s in SETTINGS)
                print(f"{n:>9} {a:>9.3f} {b:>9.3f} {b - a:>10.3f} {b / a:>6.2f}")
        finally:
            for pair in pairs:
                pair.close()


if __name__ == "__main__":
    main()
