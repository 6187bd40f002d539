"""``ecshare bench pipeline``: the exposed latency of push against pull, request by request.

One EPD request is played out between a real producer process (the encoder) and a
real consumer (the prefill/decode instance, in this process):

1. the encoder's output becomes a READY entry in the producer's region, and with
   push on, ``Producer.push`` is called for it (its answer returns at once: the
   push runs on the producer's network thread);
2. the encoder's answer reaches the proxy, which forwards the request; the proxy
   hop and the PD's preprocessing are simulated by a sleep (``--delay-ms``,
   default 2 ms);
3. the request reaches the PD's scheduler, which asks the consumer for the item
   (``Consumer.fetch``, told the item was pushed when it was): the *exposed*
   latency runs from this call until the item is local.

Pull is the same request without step 1's push. ``pushed_in_time`` is the share of
push requests whose item was already local when the scheduler asked. Each size is
measured push and pull interleaved, request by request, so both see the same
machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Final

import msgspec
import numpy as np

from ecshare.config import Config
from ecshare.control import generate_keypair
from ecshare.peer import FetchItem, Node, start_consumer, start_producer

__all__ = ["PipelineRow", "measure_pipeline", "run_pipeline_bench"]

MiB: Final = 1 << 20
# 64 KiB, 1 MiB, one 880 x 2560 bf16 image embedding (4.3 MiB), 16 MiB.
SIZES: Final = (64 << 10, MiB, 4_505_600, 16 * MiB)
DEFAULT_DELAY_MS: Final = 2.0
# Push's targets, judged by benchmarks/ab.py: at a 2 ms hop the one-image
# item is local when asked in TARGET_IN_TIME_2MS of requests, with an exposed p50 of at
# most TARGET_EXPOSED_P50_MS; at a 5 ms hop every size up to it is, in TARGET_IN_TIME_5MS.
TARGET_ITEM_BYTES: Final = 4_505_600
TARGET_IN_TIME_2MS: Final = 0.90
TARGET_EXPOSED_P50_MS: Final = 0.3
TARGET_IN_TIME_5MS: Final = 0.98
PUSH_NAME: Final = "pd-bench"
FINGERPRINT: Final = "ecshare-bench-pipeline"
_WARMUP: Final = 3


class PipelineRow(msgspec.Struct, frozen=True):
    size_bytes: int
    mode: str  # "push" or "pull"
    exposed_p50_ms: float
    exposed_p99_ms: float
    pushed_in_time: float  # share of requests whose item was local when asked (push only)
    samples: int


class PipelineResult(msgspec.Struct, frozen=True):
    bench: str
    delay_ms: float
    ucx_tls: str
    rows: list[PipelineRow]


# -- the encoder process -----------------------------------------------------------------------


def _encoder_main(conn: Connection, settings: dict[str, Any]) -> None:
    """Child: a real Producer; on each command an encoder output turns READY (and is pushed)."""
    node = Node.create(Config.from_dict(settings), "producer")
    producer = start_producer(node, fingerprint=FINGERPRINT)
    try:
        conn.send(producer.address)
        while True:
            cmd, arg = conn.recv()
            if cmd == "encode":
                mm_hash, nbytes, push_to = arg
                node.store.put(mm_hash, np.full(nbytes, len(mm_hash) % 251, dtype=np.uint8))
                if push_to:
                    producer.push(mm_hash, to=push_to)
                conn.send(None)  # the encoder's answer: it does not wait for the push
            elif cmd == "counters":
                conn.send(dict(producer.counters))
            elif cmd == "stop":
                break
    finally:
        producer.stop()
        node.close()
        conn.send("stopped")


class _Encoder:
    def __init__(self, settings: dict[str, Any]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_encoder_main, args=(child, settings), daemon=True)
        self.proc.start()
        child.close()
        self.address: str = self.call(None, timeout=60)

    def call(self, msg: Any, timeout: float = 60) -> Any:
        if msg is not None:
            self.conn.send(msg)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"the encoder process did not answer {msg!r}")
        return self.conn.recv()

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call(("stop", None), timeout=30)
        except (OSError, EOFError, TimeoutError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


# -- the measurement ---------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def measure_pipeline(
    sizes: Sequence[int] = SIZES,
    samples: int = 40,
    delay_s: float = DEFAULT_DELAY_MS / 1000,
    ucx_tls: str = "",
) -> list[PipelineRow]:
    """Push and pull rows for each size, `samples` requests each (after a warm-up)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if not 0 <= delay_s <= 10:
        raise ValueError(f"the delay must be between 0 and 10 s, not {delay_s}")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    region = max(256 * MiB, 8 * max(sizes))
    region += -region % MiB
    data_plane = {"ucx_tls": ucx_tls} if ucx_tls else {}
    rows: list[PipelineRow] = []
    with tempfile.TemporaryDirectory(prefix="ecshare-bench-pipeline-") as tmp:
        keys = {r: generate_keypair(Path(tmp), r) for r in ("producer", "consumer")}
        encoder = _Encoder(
            {
                "region_bytes": region,
                "server_secret_key_file": str(keys["producer"].secret_path),
                "authorized_keys_file": str(keys["consumer"].public_path),
                **data_plane,
            }
        )
        node = None
        consumer = None
        try:
            config = Config.from_dict(
                {
                    "region_bytes": region,
                    "client_secret_key_file": str(keys["consumer"].secret_path),
                    "server_public_key_file": str(keys["producer"].public_path),
                    "push_name": PUSH_NAME,
                    **data_plane,
                }
            )
            node = Node.create(config, "consumer")
            consumer = start_consumer(node, fingerprint=FINGERPRINT)
            consumer.connect([encoder.address])
            seq = 0
            for size in sizes:
                exposed: dict[str, list[float]] = {"push": [], "pull": []}
                in_time = 0
                for i in range(_WARMUP + samples):
                    for mode in ("push", "pull"):
                        seq += 1
                        h = f"pipe-{size}-{seq}"
                        encoder.call(("encode", (h, size, PUSH_NAME if mode == "push" else "")))
                        time.sleep(delay_s)  # the proxy hop and the PD's preprocessing
                        asked = time.perf_counter()
                        future = consumer.fetch(
                            [FetchItem(h, nbytes=size, pushed=mode == "push")], [encoder.address]
                        )[0]
                        result = future.result(timeout=30)
                        took = time.perf_counter() - asked
                        if i < _WARMUP:
                            continue
                        exposed[mode].append(took)
                        if mode == "push" and result.pushed and result.peer == "local":
                            in_time += 1
                for mode in ("push", "pull"):
                    values = exposed[mode]
                    rows.append(
                        PipelineRow(
                            size_bytes=size,
                            mode=mode,
                            exposed_p50_ms=round(statistics.median(values) * 1000, 4),
                            exposed_p99_ms=round(_percentile(values, 0.99) * 1000, 4),
                            pushed_in_time=round(in_time / samples, 4) if mode == "push" else 0.0,
                            samples=len(values),
                        )
                    )
        finally:
            if consumer is not None:
                consumer.stop()
            if node is not None:
                node.close()
            encoder.stop()
    return rows


def _size_name(size: int) -> str:
    if size % MiB == 0:
        return f"{size // MiB} MiB"
    if size >= MiB:
        return f"{size / MiB:.1f} MiB"
    return f"{size >> 10} KiB"


def format_table(rows: Sequence[PipelineRow], delay_ms: float) -> str:
    lines = [
        f"exposed latency at the PD, push against pull ({delay_ms:g} ms proxy hop + preprocessing)",
        f"{'size':>9} {'pull p50':>9} {'pull p99':>9} {'push p50':>9} {'push p99':>9} "
        f"{'in time':>8} {'pull/push p50':>14}",
    ]
    by = {(r.size_bytes, r.mode): r for r in rows}
    for size in dict.fromkeys(r.size_bytes for r in rows):
        pull, push = by[(size, "pull")], by[(size, "push")]
        ratio = pull.exposed_p50_ms / push.exposed_p50_ms if push.exposed_p50_ms else float("inf")
        lines.append(
            f"{_size_name(size):>9} {pull.exposed_p50_ms:>7.3f}ms {pull.exposed_p99_ms:>7.3f}ms "
            f"{push.exposed_p50_ms:>7.3f}ms {push.exposed_p99_ms:>7.3f}ms "
            f"{push.pushed_in_time:>7.0%} {ratio:>13.1f}x"
        )
    return "\n".join(lines)


def run_pipeline_bench(
    json_output: bool = False,
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    delay_ms: float = DEFAULT_DELAY_MS,
    ucx_tls: str = "",
    samples: int | None = None,
) -> int:
    rows = measure_pipeline(
        sizes=list(sizes or SIZES),
        samples=samples or (10 if quick else 40),
        delay_s=delay_ms / 1000,
        ucx_tls=ucx_tls,
    )
    if json_output:
        result = PipelineResult(bench="pipeline", delay_ms=delay_ms, ucx_tls=ucx_tls, rows=rows)
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        sys.stdout.write(format_table(rows, delay_ms) + "\n")
    return 0
