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
machine. Several hops (``--delay-ms 2,5``) are measured one after the other in one
run, between the same two processes; each row names its hop.

The 2 ms hop is the tight case; 5 ms is closer to a real one: an HTTP hop through
the proxy on one host plus the PD's media-free preprocessing (tokenising and
placeholder expansion) takes a few milliseconds on server hardware.

A push whose item fits the PD's standing credit is written with no offer
(``CREDIT_STEPS``); one that does not (16 MiB against the default 8 MiB credit) is
offered (``PUSH_STEPS``). Both processes record per-step timestamps of every push
(`ecshare.peer.phases`) on the host's one monotonic clock, so each push row also says where a push's
time goes, from the entry turning READY to its commit at the PD: the median of
each step over all pushes, and over the late ones alone (those not yet local
when the scheduler asked), which shows the step that made them late.
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
from ecshare.peer.phases import PhaseLog

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
# The marks of one push, in the order they happen, and the step that ends at each
# (see ecshare/peer/phases.py): the producer's and the consumer's on one time line.
# The consumer's word (the write's notification or PushDone, the first) may come
# before the producer's poll sees the write DONE: that step can be negative.
PUSH_STEPS: Final = (
    ("push_call", "Producer.push call"),
    ("p_picked", "wake producer thread"),
    ("offer_sent", "pin, send offer"),
    ("c_offer_woke", "offer to consumer thread"),
    ("reserved", "reserve"),
    ("p_reply_woke", "reply to producer thread"),
    ("reply_read", "read reply"),
    ("write_posted", "WRITE call"),
    ("write_done", "WRITE to DONE"),
    ("c_word", "word to consumer"),
    ("committed", "check, commit"),
)
# A push into the consumer's standing credit: no offer, no reply; the claim goes just
# before the WRITE (docs/PUSH.md, "Standing credit").
CREDIT_STEPS: Final = (
    ("push_call", "Producer.push call"),
    ("p_picked", "wake producer thread"),
    ("credited", "pin, send claim"),
    ("write_posted", "WRITE call"),
    ("write_done", "WRITE to DONE"),
    ("c_word", "word to consumer"),
    ("committed", "check, commit"),
)


class PipelineRow(msgspec.Struct, frozen=True):
    size_bytes: int
    mode: str  # "push" or "pull"
    exposed_p50_ms: float
    exposed_p99_ms: float
    pushed_in_time: float  # share of requests whose item was local when asked (push only)
    samples: int
    delay_ms: float = DEFAULT_DELAY_MS
    # Push only: from the entry turning READY to its commit at the PD (p50, p90), and
    # the median milliseconds of each step (PUSH_STEPS), over all pushes and over the
    # late ones alone; their sum is close to, not equal to, the median total.
    landed_p50_ms: float = 0.0
    landed_p90_ms: float = 0.0
    asked_p50_ms: float = 0.0  # from READY to the scheduler's ask: the time a push has
    steps_ms: dict[str, float] = {}
    late_steps_ms: dict[str, float] = {}


class PipelineResult(msgspec.Struct, frozen=True):
    bench: str
    delay_ms: float  # the first hop measured; each row names its own
    ucx_tls: str
    rows: list[PipelineRow]
    delays_ms: list[float] = []
    # The share of the PD's region on 2 MiB pages (`region_hugepages`): the host decides,
    # and over cma it sets the WRITE call's cost.
    hugepage_share: float = 0.0


# -- the encoder process -----------------------------------------------------------------------


def _encoder_main(conn: Connection, settings: dict[str, Any]) -> None:
    """Child: a real Producer; on each command an encoder output turns READY (and is pushed)."""
    node = Node.create(Config.from_dict(settings), "producer")
    producer = start_producer(node, fingerprint=FINGERPRINT)
    phases = producer.phases = PhaseLog()
    try:
        conn.send(producer.address)
        while True:
            cmd, arg = conn.recv()
            if cmd == "encode":
                mm_hash, nbytes, push_to = arg
                node.store.put(mm_hash, np.full(nbytes, len(mm_hash) % 251, dtype=np.uint8))
                phases.mark(mm_hash, "ready")
                if push_to:
                    producer.push(mm_hash, to=push_to)
                conn.send(None)  # the encoder's answer: it does not wait for the push
            elif cmd == "counters":
                conn.send(dict(producer.counters))
            elif cmd == "marks":
                conn.send(phases.take())
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


def _by_key(records: Sequence[tuple[str, str, float]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key, phase, at in records:
        out.setdefault(key, {}).setdefault(phase, at)  # the first of each
    return out


def _steps_ms(marks: Sequence[dict[str, float]]) -> dict[str, float]:
    """The median milliseconds of each step, from "ready" on: of CREDIT_STEPS for a push
    written into a credit, of PUSH_STEPS for an offered one (each step over the pushes
    that took it, in the order of the offered path with the claim after the wake)."""
    spans: dict[str, list[float]] = {}
    for m in marks:
        before = "ready"
        for mark, name in CREDIT_STEPS if "credited" in m else PUSH_STEPS:
            if mark in m and before in m:
                spans.setdefault(name, []).append(m[mark] - m[before])
            before = mark
    order = [name for _, name in PUSH_STEPS]
    order.insert(order.index("wake producer thread") + 1, "pin, send claim")
    return {
        name: round(statistics.median(spans[name]) * 1000, 4) for name in order if name in spans
    }


def _push_marks(
    producer: Sequence[tuple[str, str, float]], consumer: Sequence[tuple[str, str, float]]
) -> dict[str, dict[str, float]]:
    """Each push's marks of both processes on one time line, by mm_hash."""
    marks = _by_key(producer)
    for key, own in _by_key(consumer).items():
        marks.setdefault(key, {}).update(own)
    for m in marks.values():
        # A thread whose poll had already returned when the message was sent read it
        # without waking for it: its wake took no time, not a negative one.
        for woke, sent in (("c_offer_woke", "offer_sent"), ("p_reply_woke", "reserved")):
            if woke in m and sent in m:
                m[woke] = max(m[woke], m[sent])
        words = [m[w] for w in ("c_notice", "c_done") if w in m]
        if words:
            m["c_word"] = min(words)  # the write's notification or PushDone, the first
    return marks


def _rows_of(
    size: int,
    delay_ms: float,
    exposed: dict[str, list[float]],
    in_time: dict[str, bool],
    marks: dict[str, dict[str, float]],
) -> list[PipelineRow]:
    rows = []
    pushes = [marks.get(h, {}) for h in in_time]
    late = [marks.get(h, {}) for h, ok in in_time.items() if not ok]
    landed = [m["committed"] - m["ready"] for m in pushes if "committed" in m and "ready" in m]
    landed_p50 = round(statistics.median(landed) * 1000, 4) if landed else 0.0
    landed_p90 = round(_percentile(landed, 0.9) * 1000, 4) if landed else 0.0
    asked = [m["asked"] - m["ready"] for m in pushes if "asked" in m and "ready" in m]
    asked_p50 = round(statistics.median(asked) * 1000, 4) if asked else 0.0
    for mode in ("push", "pull"):
        values = exposed[mode]
        push = mode == "push"
        rows.append(
            PipelineRow(
                size_bytes=size,
                mode=mode,
                exposed_p50_ms=round(statistics.median(values) * 1000, 4),
                exposed_p99_ms=round(_percentile(values, 0.99) * 1000, 4),
                pushed_in_time=round(sum(in_time.values()) / len(values), 4) if push else 0.0,
                samples=len(values),
                delay_ms=delay_ms,
                landed_p50_ms=landed_p50 if push else 0.0,
                landed_p90_ms=landed_p90 if push else 0.0,
                asked_p50_ms=asked_p50 if push else 0.0,
                steps_ms=_steps_ms(pushes) if push else {},
                late_steps_ms=_steps_ms(late) if push else {},
            )
        )
    return rows


def measure_pipeline(
    sizes: Sequence[int] = SIZES,
    samples: int = 40,
    delay_s: float | Sequence[float] = DEFAULT_DELAY_MS / 1000,
    ucx_tls: str = "",
    facts: dict[str, float] | None = None,
) -> list[PipelineRow]:
    """Push and pull rows for each hop and size, `samples` requests each (after a warm-up).
    `facts`, if given, gets the PD region's share on 2 MiB pages (``hugepage_share``)."""
    delays = [delay_s] if isinstance(delay_s, int | float) else list(delay_s)
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if not delays or not all(0 <= d <= 10 for d in delays):
        raise ValueError(f"each delay must be between 0 and 10 s, not {delays}")
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
            if facts is not None:
                facts["hugepage_share"] = round(node.region.hugepage_bytes() / node.region.size, 4)
            consumer = start_consumer(node, fingerprint=FINGERPRINT)
            phases = consumer.phases = PhaseLog()
            consumer.connect([encoder.address])
            seq = 0
            for delay in delays:
                for size in sizes:
                    exposed: dict[str, list[float]] = {"push": [], "pull": []}
                    in_time: dict[str, bool] = {}  # each measured push: local when asked
                    for i in range(_WARMUP + samples):
                        for mode in ("push", "pull"):
                            seq += 1
                            h = f"pipe-{size}-{seq}"
                            push_to = PUSH_NAME if mode == "push" else ""
                            encoder.call(("encode", (h, size, push_to)))
                            time.sleep(delay)  # the proxy hop and the PD's preprocessing
                            asked = time.perf_counter()
                            phases.mark(h, "asked")
                            future = consumer.fetch(
                                [FetchItem(h, nbytes=size, pushed=mode == "push")],
                                [encoder.address],
                            )[0]
                            result = future.result(timeout=30)
                            took = time.perf_counter() - asked
                            if i < _WARMUP:
                                continue
                            exposed[mode].append(took)
                            if mode == "push":
                                in_time[h] = result.pushed and result.peer == "local"
                    marks = _push_marks(encoder.call(("marks", None)), phases.take())
                    rows += _rows_of(size, delay * 1000, exposed, in_time, marks)
        finally:
            if consumer is not None:
                consumer.phases = None
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


def format_table(rows: Sequence[PipelineRow]) -> str:
    lines: list[str] = []
    for delay in dict.fromkeys(r.delay_ms for r in rows):
        if lines:
            lines.append("")
        lines += [
            f"exposed latency at the PD, push against pull "
            f"({delay:g} ms proxy hop + preprocessing)",
            f"{'size':>9} {'pull p50':>9} {'pull p99':>9} {'push p50':>9} {'push p99':>9} "
            f"{'in time':>8} {'pull/push p50':>14} {'landed p50':>11} {'p90':>8}",
        ]
        by = {(r.size_bytes, r.mode): r for r in rows if r.delay_ms == delay}
        for size in dict.fromkeys(s for s, _ in by):
            pull, push = by[(size, "pull")], by[(size, "push")]
            ratio = (
                pull.exposed_p50_ms / push.exposed_p50_ms if push.exposed_p50_ms else float("inf")
            )
            lines.append(
                f"{_size_name(size):>9} {pull.exposed_p50_ms:>7.3f}ms "
                f"{pull.exposed_p99_ms:>7.3f}ms {push.exposed_p50_ms:>7.3f}ms "
                f"{push.exposed_p99_ms:>7.3f}ms "
                f"{push.pushed_in_time:>7.0%} {ratio:>13.1f}x "
                f"{push.landed_p50_ms:>9.3f}ms {push.landed_p90_ms:>6.3f}ms"
            )
        lines.append("  where a push's time goes, READY to committed (ms, p50 of all; of the late)")
        for size in dict.fromkeys(s for s, _ in by):
            push = by[(size, "push")]
            lines.append(f"  {_size_name(size):>9}: READY to asked {push.asked_p50_ms:.3f}")
            steps = ", ".join(
                f"{name} {ms:.3f}"
                + (f" ({push.late_steps_ms[name]:.3f})" if name in push.late_steps_ms else "")
                for name, ms in push.steps_ms.items()
            )
            lines.append(f"  {'':>9}  {steps}")
    return "\n".join(lines)


def run_pipeline_bench(
    json_output: bool = False,
    quick: bool = False,
    sizes: Sequence[int] | None = None,
    delay_ms: float | Sequence[float] = DEFAULT_DELAY_MS,
    ucx_tls: str = "",
    samples: int | None = None,
) -> int:
    delays = [delay_ms] if isinstance(delay_ms, int | float) else list(delay_ms)
    facts: dict[str, float] = {}
    rows = measure_pipeline(
        sizes=list(sizes or SIZES),
        samples=samples or (10 if quick else 40),
        delay_s=[d / 1000 for d in delays],
        ucx_tls=ucx_tls,
        facts=facts,
    )
    share = facts.get("hugepage_share", 0.0)
    if json_output:
        result = PipelineResult(
            bench="pipeline",
            delay_ms=delays[0],
            ucx_tls=ucx_tls,
            rows=rows,
            delays_ms=delays,
            hugepage_share=share,
        )
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        sys.stdout.write(format_table(rows) + "\n")
        sys.stdout.write(
            f"the PD's region on 2 MiB pages: {share:.0%} (region_hugepages; the host grants "
            "them where transparent_hugepage/shmem_enabled is not never)\n"
        )
    return 0
