"""`ecshare demo`: a producer process and a consumer move entries through the whole stack.

It generates CURVE keys, starts `ecshare serve` as a separate process on
127.0.0.1, fetches every entry (batched, authenticated, over NIXL), checks
each byte, shows one refusal and one failover, and shuts everything down.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ecshare.apps.bench.synthetic import synthetic_bytes
from ecshare.apps.ready import ProducerReady, ServedEntry, parse_ready
from ecshare.config import Config
from ecshare.control import generate_keypair
from ecshare.peer import Consumer, FetchFailed, Node, start_consumer

SPEC = "64KiB:8,1MiB:4,4MiB:4,16MiB:2"
FINGERPRINT = "ecshare-demo"


def _start_producer(
    workdir: Path, keys: dict[str, Path]
) -> tuple[subprocess.Popen[str], ProducerReady]:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    cmd = [
        sys.executable, "-m", "ecshare", "serve",
        "--synthetic", SPEC,
        "--fingerprint", FINGERPRINT,
        "--entry-checksums",
        "--checksum", "xxh3_64",
        "--region-bytes", str(256 << 20),
        "--server-secret-key-file", str(keys["producer"]),
        "--authorized-keys-file", str(workdir / "consumer.key"),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        ready = parse_ready(line, ProducerReady)
        if ready is not None:
            return proc, ready
    proc.wait(timeout=10)
    raise RuntimeError(f"producer exited with {proc.returncode} before it was ready")


def run_demo() -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    with tempfile.TemporaryDirectory(prefix="ecshare-demo-") as tmp:
        workdir = Path(tmp)
        keys = {
            role: generate_keypair(workdir, role).secret_path for role in ("producer", "consumer")
        }
        print(f"1. generated CURVE key pairs for producer and consumer in {workdir}")
        t0 = time.monotonic()
        proc, ready = _start_producer(workdir, keys)
        entries = ready.entries
        total = sum(e.nbytes for e in entries)
        print(
            f"2. producer pid {proc.pid} serving {len(entries)} entries "
            f"({total / 2**20:.1f} MiB) on {ready.address} "
            f"(ready in {time.monotonic() - t0:.2f} s)"
        )
        config = Config.from_dict(
            {
                "region_bytes": 256 << 20,
                "client_secret_key_file": str(keys["consumer"]),
                "server_public_key_file": str(workdir / "producer.key"),
                "checksum": "xxh3_64",
                # Short, so that the failover step does not wait long on a dead peer.
                "handshake_timeout_s": 1.0,
            }
        )
        node = Node.create(config, "consumer")
        consumer = start_consumer(node, fingerprint=FINGERPRINT)
        try:
            _fetch_all(consumer, node, ready.address, entries)
            _show_refusal(consumer, ready.address)
            _show_failover(consumer, node, ready.address, entries)
        finally:
            consumer.stop()
            node.close()
            proc.terminate()
            proc.wait(timeout=10)
        print(f"6. producer exited with {proc.returncode}; consumer region closed; done")
        return 0


def _fetch_all(
    consumer: Consumer, node: Node, address: str, entries: tuple[ServedEntry, ...]
) -> None:
    t0 = time.perf_counter()
    futures = consumer.fetch([e.mm_hash for e in entries], [address])
    results = [f.result(timeout=30) for f in futures]
    elapsed = time.perf_counter() - t0
    bad = 0
    for e in entries:
        got = node.store.read(e.mm_hash).reshape(-1).view(np.uint8)
        bad += not np.array_equal(got, synthetic_bytes(e.mm_hash, e.nbytes))
    total = sum(r.nbytes for r in results)
    print(
        f"3. fetched {len(results)} entries, {total / 2**20:.1f} MiB, in {elapsed * 1000:.1f} ms "
        f"({total / elapsed / 1e9:.2f} GB/s incl. handshake); checksums verified; "
        f"byte mismatches: {bad}"
    )
    latencies = []
    for i in range(20):
        h = f"demo-missing-{i}"
        start = time.perf_counter()
        try:
            consumer.fetch([h], [address])[0].result(timeout=5)
        except FetchFailed:
            latencies.append((time.perf_counter() - start) * 1000)
    print(f"   a round trip that ends in a refusal takes {np.median(latencies):.2f} ms (median)")
    if bad:
        raise SystemExit("demo failed: fetched bytes differ")


def _show_refusal(consumer: Consumer, address: str) -> None:
    try:
        consumer.fetch(["never-encoded-anywhere"], [address])[0].result(timeout=10)
    except FetchFailed as exc:
        print(f"4. an item no producer holds fails with a typed reason: {exc.reason.value}")


def _show_failover(
    consumer: Consumer, node: Node, address: str, entries: tuple[ServedEntry, ...]
) -> None:
    dead = "tcp://127.0.0.1:1"  # nothing listens here
    h = entries[-1].mm_hash
    node.store.remove(h)
    result = consumer.fetch([h], [dead, address])[0].result(timeout=30)
    print(
        f"5. with a dead first peer, {h} still arrived from {result.peer} "
        f"after {result.latency_s * 1000:.0f} ms"
    )
