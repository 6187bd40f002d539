"""What a chaos or soak run found: the figures, the invariants, and how to print them."""

from __future__ import annotations

import sys
from typing import TextIO

import msgspec


class RegionCheck(msgspec.Struct, frozen=True):
    """One surviving region once the run is quiet."""

    node: str
    total_blocks: int
    free_blocks: int
    used_blocks: int
    ready_blocks: int  # held by READY entries
    pins: int
    allocated: int  # entries still being written
    evicting: int
    verified_entries: int  # READY entries whose bytes were checked
    leaked_blocks: int  # used, yet held by no READY entry, or unaccounted for
    invariant_error: str
    # Held because a read into them may still be in flight (the consumer's fence);
    # counted in leaked_blocks unless a producer was still frozen at the end.
    quarantined: int = 0
    quarantined_blocks: int = 0
    canary_violations: int = 0  # freed blocks found written when handed out again


class ProcessMemory(msgspec.Struct, frozen=True):
    """RSS over a soak, in MiB; the slope is fitted after the warm-up."""

    process: str
    samples: int
    start_mib: float
    warm_mib: float  # at the end of the warm-up: the baseline drift is measured from
    end_mib: float
    max_mib: float
    slope_mib_per_min: float
    anon_warm_mib: float  # RSS less shared pages (the region is shared memory)
    anon_end_mib: float
    anon_slope_mib_per_min: float


class RegionUsage(msgspec.Struct, frozen=True):
    node: str
    samples: int
    mean_used_fraction: float
    max_used_fraction: float
    end_used_fraction: float
    end_pins: int


class Soak(msgspec.Struct, frozen=True):
    seconds: float
    warmup_s: float
    sample_interval_s: float
    fetch_rate_per_s: float
    delivered_mib: float
    memory: list[ProcessMemory]
    regions: list[RegionUsage]
    fetches_after_warmup: int = 0  # attempted, every consumer's together


class ChaosReport(msgspec.Struct, frozen=True):
    seed: int
    duration_s: float
    producers: int
    consumers: int
    fetches_attempted: int
    delivered: int
    failed: dict[str, int]  # by FailureReason value
    lost_with_consumer: int  # in flight in a consumer that was SIGKILLed: no outcome owed
    faults: dict[str, int]  # injected, by kind
    corrupted: int  # READY with wrong bytes (delivered or found in the final sweep)
    untyped_failures: int  # a future that ended with anything but FetchFailed
    vanished: int  # delivered, then gone before the check
    late: int  # settled after deadline + grace
    max_overrun_s: float  # worst settle time past deadline (negative: all in time)
    hung_fetches: int  # never settled in a live consumer
    hangs: int  # processes that did not answer or exit within their bound
    recovered_pairs: int  # (consumer, producer) pairs that fetched again after the faults
    unrecovered_pairs: int
    leaked_blocks: int
    leaked_pins: int
    # Freed blocks found written when handed out again (the store's canary, on in
    # every node), summed over every node that ever ran, killed ones included.
    writes_after_free: int
    settle_p50_ms: float
    settle_p99_ms: float
    settle_max_ms: float
    regions: list[RegionCheck]
    violations: list[str]
    ok: bool
    netem: str = ""
    soak: Soak | None = None
    # The UCX transport NIXL was forced onto (options.UCX_TRANSPORTS): cma reads
    # finish inside the read call, tcp reads move as the producer progresses.
    transport: str = "cma"
    # Where the nodes ran: "loopback" (one namespace, 127.0.0.1) or "netns" (one
    # namespace each, joined by veth; `veth_bytes` crossed from producers' hosts).
    network: str = "loopback"
    veth_bytes: int = 0
    delivered_bytes: int = 0  # of verified deliveries
    frozen_at_end: int = 0  # producers still stopped when the run ended
    crashes: int = 0  # children that exited by themselves (neither killed nor told to stop)
    # Producers that died of UCX 1.23's abort over TCP after a stop during which a
    # consumer was SIGKILLed (docs/RELIABILITY.md, "Crashes seen"): not crashes, but
    # restarted under the same key and port (counted in restarts_same_key_and_port).
    # One line each: when, which producer, and the evidence (`crashes.ucx_abort_evidence`).
    known_ucx_aborts: list[str] = msgspec.field(default_factory=list)
    fault_log: list[str] = msgspec.field(default_factory=list)  # seconds into the load, what
    # Push traffic (`--push SHARE`): pushes asked of producers, how each ended
    # ("pushed", or its state and reason), the ones lost with a SIGKILLed producer, and
    # the ones a live producer never ended (must be 0).
    push: float = 0.0
    pushes_attempted: int = 0
    push_outcomes: dict[str, int] = msgspec.field(default_factory=dict)
    pushes_lost_with_producer: int = 0
    hung_pushes: int = 0
    delivered_pushed: int = 0  # verified fetches whose entry a producer wrote here
    push_settle_max_ms: float = 0.0
    # The push counters of every node (last seen, killed ones included), summed per side
    # ("consumer.push_fenced", "producer.push_writes"): fences, what ended them (notice,
    # PushDone, failed probe), refusals by reason, deadlines.
    push_counters: dict[str, int] = msgspec.field(default_factory=dict)
    # Direct reads (a producer said where the entry lies; read with no grant, kept only
    # if checked), the consumers' counters summed (last seen, killed ones included):
    # direct_reads, direct_reads_stale, direct_reads_failed, tag_reads, tag_peeks,
    # tag_peeks_failed.
    direct_counters: dict[str, int] = msgspec.field(default_factory=dict)


def print_report(report: ChaosReport, out: TextIO = sys.stdout) -> None:
    w = out.write
    kind = "soak" if report.soak else "chaos"
    w(
        f"ecshare {kind}: seed {report.seed}, {report.producers} producers, "
        f"{report.consumers} consumers, {report.duration_s:.1f} s, UCX {report.transport} "
        f"over {report.network}"
        + (f" ({report.veth_bytes / (1 << 20):.0f} MiB through veth)" if report.veth_bytes else "")
        + (f", netem '{report.netem}'" if report.netem else "")
        + "\n"
    )
    w(f"  fetches attempted     {report.fetches_attempted}\n")
    w(f"  delivered (verified)  {report.delivered}\n")
    failed = sum(report.failed.values())
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(report.failed.items())) or "-"
    w(f"  failed (typed)        {failed}: {reasons}\n")
    w(f"  lost with a consumer  {report.lost_with_consumer}\n")
    w(
        f"  settle time           p50 {report.settle_p50_ms:.1f} ms, "
        f"p99 {report.settle_p99_ms:.1f} ms, max {report.settle_max_ms:.1f} ms\n"
    )
    if report.push:
        ends = ", ".join(f"{k} {v}" for k, v in sorted(report.push_outcomes.items())) or "-"
        w(f"  pushes attempted      {report.pushes_attempted}: {ends}\n")
        w(f"  lost with a producer  {report.pushes_lost_with_producer}\n")
        w(f"  delivered by push     {report.delivered_pushed} (verified fetches)\n")
        w(f"  push settle max       {report.push_settle_max_ms:.1f} ms\n")
        keys = (
            "push_fenced", "push_deadlines", "push_sessions_lost", "push_fenced_ended",
            "push_fences_ended_by_notice", "push_fences_ended_by_done", "push_probes_failed",
            "push_checksum_failures",
        )  # fmt: skip
        shown = ", ".join(f"{k} {report.push_counters.get(f'consumer.{k}', 0)}" for k in keys)
        w(f"  push fences           {shown}\n")
    direct = report.direct_counters
    w(
        f"  direct reads          {direct.get('direct_reads', 0)} (stale "
        f"{direct.get('direct_reads_stale', 0)}, failed {direct.get('direct_reads_failed', 0)}, "
        f"READs of tags {direct.get('tag_reads', 0)}, tags read from producers' memory "
        f"{direct.get('tag_peeks', 0)}, failed {direct.get('tag_peeks_failed', 0)})\n"
    )
    faults = ", ".join(f"{k} {v}" for k, v in sorted(report.faults.items()) if v) or "none"
    w(f"  faults injected       {faults}\n")
    for label, value in (
        ("corrupted entries", report.corrupted),
        ("writes after free", report.writes_after_free),
        ("untyped failures", report.untyped_failures),
        ("vanished entries", report.vanished),
        ("late settles", report.late),
        ("hung fetches", report.hung_fetches),
        ("hung pushes", report.hung_pushes),
        ("leaked blocks", report.leaked_blocks),
        ("leaked pins", report.leaked_pins),
        ("hangs", report.hangs),
        ("crashes", report.crashes),
        ("unrecovered pairs", report.unrecovered_pairs),
    ):
        w(f"  {label:<21} {value}{'' if value == 0 else '   <-- must be 0'}\n")
    aborts = len(report.known_ucx_aborts)
    w(
        f"  known UCX aborts      {aborts}"
        + ("   (producers restarted: UCX 1.23 bug, docs/RELIABILITY.md)" if aborts else "")
        + "\n"
    )
    for line in report.known_ucx_aborts:
        w(f"    {line}\n")
    w(f"  recovered pairs       {report.recovered_pairs} (consumer, producer) fetch again\n")
    w(f"  worst overrun         {report.max_overrun_s:+.3f} s past the deadline\n")
    for r in report.regions:
        w(
            f"  region {r.node:<14} {r.used_blocks}/{r.total_blocks} blocks used, "
            f"{r.ready_blocks} READY, {r.free_blocks} free, {r.pins} pins, "
            f"{r.quarantined_blocks} quarantined, {r.verified_entries} entries verified\n"
        )
    if report.soak is not None:
        s = report.soak
        w(
            f"  soak                  {s.seconds:.0f} s, {s.fetch_rate_per_s:.0f} fetches/s, "
            f"{s.delivered_mib:.0f} MiB delivered, warm-up {s.warmup_s:.0f} s, "
            f"{s.fetches_after_warmup} fetches after it\n"
        )
        for m in s.memory:
            w(
                f"  rss {m.process:<16} start {m.start_mib:.0f} warm {m.warm_mib:.0f} "
                f"end {m.end_mib:.0f} max {m.max_mib:.0f} MiB, drift "
                f"{m.slope_mib_per_min:+.2f} MiB/min (anon {m.anon_slope_mib_per_min:+.2f})\n"
            )
        for u in s.regions:
            w(
                f"  usage {u.node:<14} mean {u.mean_used_fraction:.0%} max "
                f"{u.max_used_fraction:.0%} end {u.end_used_fraction:.0%}, "
                f"{u.end_pins} pins at the end\n"
            )
    for v in report.violations:
        w(f"  VIOLATION: {v}\n")
    w(f"  result                {'OK' if report.ok else 'FAILED'}\n")
