"""The fault-injection harness, bounded for CI: real producer and consumer processes
(CURVE control plane, NIXL data plane) on 127.0.0.1 under every fault kind.

Each run draws a fresh seed, printed on failure; `ecshare chaos --seed N` replays
its fault schedule.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from ecshare.apps.bench.synthetic import synthetic_bytes
from ecshare.apps.chaos import FAULT_KINDS, ChaosOptions, ChaosReport, run_chaos
from ecshare.apps.chaos.faultproxy import FaultProxy, Faults
from ecshare.apps.chaos.harness import _region_check
from ecshare.apps.chaos.hosts import hosts_unavailable
from ecshare.apps.chaos.messages import NodeStats
from ecshare.apps.chaos.netns import netem_unavailable
from ecshare.apps.chaos.nodes import _Checker, _fill
from ecshare.apps.chaos.options import MID_READ_KINDS, PUSH_KINDS
from ecshare.peer import FailureReason
from ecshare.store import Region, Store

MiB = 1 << 20
TYPED = {r.value for r in FailureReason}


@pytest.mark.timeout(240)
def test_every_fault_kind_leaves_no_corruption_leak_hang_or_untyped_end() -> None:
    # At least 100 served, so that the paths that serve (direct reads among them) ran
    # under the faults, however many fetches failed fast while links were down.
    options = ChaosOptions(
        fetches=300,
        producers=2,
        consumers=2,
        fault_interval_s=0.8,
        min_delivered=100,
        every_fault_within_s=150,
    )
    report = run_chaos(options)
    where = f"seed {report.seed}: {report.violations}"

    assert report.ok, where
    # (a) content, (b) regions, (c) typed ends within the deadline, (d) no hangs
    assert report.corrupted == 0 and report.vanished == 0, where
    assert report.writes_after_free == 0, where
    assert report.leaked_blocks == 0 and report.leaked_pins == 0, where
    assert report.untyped_failures == 0 and report.late == 0, where
    assert report.hung_fetches == 0 and report.hangs == 0, where
    assert set(report.failed) <= TYPED, report.failed
    assert report.fetches_attempted >= options.fetches
    accounted = report.delivered + sum(report.failed.values()) + report.lost_with_consumer
    assert accounted == report.fetches_attempted, report
    assert report.delivered >= options.min_delivered, report

    # Every fault kind ran, and left its mark.
    for kind in FAULT_KINDS:
        assert report.faults[kind] >= 1, (kind, report.faults, where)
    assert report.lost_with_consumer >= 1  # only busy consumers are killed
    # A producer dead of the known UCX abort is restarted too (never over cma: 0 here).
    assert report.faults["restarts_same_key_and_port"] == (
        report.faults["kill_producer"]
        + report.faults["restart_producer"]
        + report.faults["shrink_lease"]
        + len(report.known_ucx_aborts)
    ), (report.faults, report.known_ucx_aborts)
    assert report.faults["control_delayed_chunks"] >= 1, report.faults
    # Eviction pressure: producers evicted under load, and consumers asked for
    # entries that had been evicted.
    assert report.faults["evictions_under_load"] >= 1, report.faults
    assert report.faults["missing_refusals"] >= 1, report.faults
    # Entries the producers churned in were read directly, with no grant, under all
    # of this; none corrupted (above) whatever was evicted meanwhile.
    assert report.direct_counters.get("direct_reads", 0) >= 1, report.direct_counters

    # After the faults, every consumer fetches from every (restarted) producer again.
    assert report.unrecovered_pairs == 0, where
    assert report.recovered_pairs == options.consumers * options.producers
    nodes = sorted(r.node.split("-")[0] for r in report.regions)
    assert nodes == ["consumer"] * options.consumers + ["producer"] * options.producers
    for region in report.regions:
        assert region.free_blocks + region.used_blocks == region.total_blocks, region
        assert region.used_blocks == region.ready_blocks and region.pins == 0, region
        if region.node.startswith("producer"):
            assert region.verified_entries > 0, region  # producer bytes checked too


def _assert_clean(report: ChaosReport) -> None:
    """Nothing wrong, leaked, hung or untyped; every failure a FailureReason."""
    where = f"seed {report.seed}: {report.violations}\n" + "\n".join(report.fault_log)
    assert report.corrupted == 0 and report.vanished == 0, where
    assert report.writes_after_free == 0, where
    assert report.leaked_blocks == 0 and report.leaked_pins == 0, where
    assert report.untyped_failures == 0 and report.late == 0, where
    assert report.hung_fetches == 0 and report.hangs == 0 and report.crashes == 0, where
    assert set(report.failed) <= TYPED, report.failed
    accounted = report.delivered + sum(report.failed.values()) + report.lost_with_consumer
    assert accounted == report.fetches_attempted, report
    assert report.delivered > 0, report
    assert report.ok, where


# The faults aimed at reads in flight, and the kinds that cut control and shrink leases.
NETWORK_FAULTS = ("cut_control", *MID_READ_KINDS, "shrink_lease")


@pytest.mark.timeout(240)
def test_reads_in_flight_over_tcp_survive_freezes_partitions_readds_and_short_leases() -> None:
    # Over UCX TCP a read moves only as the producer progresses: each of these faults
    # strikes while a 4 MiB read is in flight at its target.
    options = ChaosOptions(
        fetches=150,
        producers=2,
        consumers=2,
        fault_interval_s=0.6,
        ucx_tls="tcp",
        faults=NETWORK_FAULTS,
    )
    report = run_chaos(options)

    _assert_clean(report)
    assert report.transport == "tcp" and report.network == "loopback"
    assert report.direct_counters.get("direct_reads", 0) >= 1, report.direct_counters
    for kind in NETWORK_FAULTS:
        assert report.faults[kind] >= 1, (kind, report.faults, report.fault_log)
    assert report.faults["control_held_chunks"] >= 1, report.faults  # the partition held
    assert report.unrecovered_pairs == 0, report.violations


@pytest.mark.timeout(240)
def test_pushes_mixed_with_pulls_survive_deaths_freezes_cuts_late_deadlines_and_full_regions() -> (
    None
):
    # Over UCX TCP a write moves only as both ends progress: each armed kind strikes
    # while a 4 MiB push is offered or being written (at a producer) or has blocks
    # reserved (at a consumer).
    options = ChaosOptions(
        fetches=120,
        producers=2,
        consumers=2,
        fault_interval_s=0.6,
        ucx_tls="tcp",
        push=0.5,
        faults=PUSH_KINDS,
        every_fault_within_s=150.0,
    )
    report = run_chaos(options)

    _assert_clean(report)
    where = f"seed {report.seed}: {report.push_outcomes} {report.push_counters}"
    assert report.hung_pushes == 0, where
    for kind in PUSH_KINDS:
        assert report.faults[kind] >= 1, (kind, report.faults, report.fault_log)
    assert report.pushes_attempted > 0 and report.push_outcomes.get("pushed", 0) >= 1, where
    ended = sum(report.push_outcomes.values()) + report.pushes_lost_with_producer
    assert ended == report.pushes_attempted, where  # every push ended, or died with its producer
    assert report.delivered_pushed >= 1, where  # some fetches were served by a push
    # Producers restart after kill_producer_mid_push, and after the known UCX abort (a
    # producer frozen mid-push while a consumer is killed mid-push may die of it over
    # TCP: docs/RELIABILITY.md); each of those is a restart under the same key and port.
    assert report.faults["restarts_same_key_and_port"] == (
        report.faults["kill_producer_mid_push"] + len(report.known_ucx_aborts)
    ), (report.faults, report.known_ucx_aborts)
    # Every push a consumer fenced came to its end before the run was quiet (0 leaked
    # blocks says so); the counters (last seen per node) show which word ended each.
    counters = report.push_counters
    ended_fences = counters.get("consumer.push_fenced_ended", 0)
    assert ended_fences <= counters.get("consumer.push_fenced", 0), where


@pytest.mark.timeout(240)
def test_reads_cross_veth_between_network_namespaces() -> None:
    why = hosts_unavailable()
    if why is not None:
        pytest.skip(f"network namespaces joined by veth cannot be made here: {why}")
    options = ChaosOptions(
        fetches=80,
        producers=1,
        consumers=2,
        fault_interval_s=0.8,
        ucx_tls="tcp",
        netns=True,
        faults=("partition_control", "freeze_producer_mid_read"),
    )
    report = run_chaos(options)

    _assert_clean(report)
    assert report.network == "netns" and report.transport == "tcp"
    # Every delivered byte left the producer's host through its veth device.
    assert report.veth_bytes >= report.delivered_bytes > 0, report
    for kind in options.faults:
        assert report.faults[kind] >= 1, (kind, report.faults, report.fault_log)


def test_content_check_catches_wrong_bytes_and_missing_entries() -> None:
    with Region.create(4 * MiB, name="ecshare-chaos-test", prefault=False) as region:
        store = Store(region, 64 * 1024)
        good, bad, size = "syn-100000-0", "syn-100000-1", 100000
        store.put(good, synthetic_bytes(good, size))
        wrong = synthetic_bytes(bad, size).copy()
        wrong[size // 2] ^= 0xFF  # one flipped byte
        store.put(bad, wrong)
        checker = _Checker()

        assert checker.check(store, good, size, "t1") is True
        assert checker.check(store, bad, size, "t2") is False
        assert checker.check(store, good, size - 1, "t3") is False  # wrong size
        assert checker.check(store, "syn-100000-9", size, "t4") is None
        assert store.stats().pins == 0  # the check's own pins are gone


def test_region_check_counts_blocks_no_ready_entry_holds() -> None:
    with Region.create(4 * MiB, name="ecshare-chaos-test", prefault=False) as region:
        store = Store(region, 64 * 1024)
        store.put("syn-65536-0", np.zeros(65536, dtype=np.uint8))
        store.allocate("half-written", 3 * 65536)  # never committed: a leak once quiet
        stats = NodeStats(
            pid=0, store=store.stats(), counters={}, invariant_error="", used_by_ready=1
        )
        check = _region_check("consumer-1", stats)
        assert check.leaked_blocks == 3 and check.allocated == 1, check


def test_region_check_counts_quarantined_blocks_as_leaked_unless_a_producer_stays_frozen() -> None:
    with Region.create(4 * MiB, name="ecshare-chaos-test", prefault=False) as region:
        store = Store(region, 64 * 1024)
        dest = store.allocate("read-given-up", 2 * 65536)
        store.quarantine(dest)  # a read may still write it
        stats = NodeStats(
            pid=0, store=store.stats(), counters={}, invariant_error="", used_by_ready=0
        )
        check = _region_check("consumer-1", stats)
        assert check.quarantined == 1 and check.quarantined_blocks == 2, check
        assert check.leaked_blocks == 2, check  # the run is over: that read had to end
        # With a producer frozen for good its read may never end: holding the
        # destination is the promise kept, not a leak.
        excused = _region_check("consumer-1", stats, excuse_quarantine=True)
        assert excused.leaked_blocks == 0 and excused.quarantined_blocks == 2, excused


def test_region_check_reports_a_write_after_free_the_canary_caught() -> None:
    with Region.create(4 * MiB, name="ecshare-chaos-test", prefault=False) as region:
        store = Store(region, 64 * 1024, canary=True)
        store.put("first", np.zeros(65536, dtype=np.uint8))
        first = store.get("first")
        assert first is not None
        offset = first.extents[0][0]
        store.remove("first")  # its block is freed and filled with the pattern
        region.array[offset + 100] ^= 0xFF  # a late write lands in the freed block
        store.put("second", np.ones(65536, dtype=np.uint8))  # the block is handed out again
        stats = NodeStats(
            pid=0, store=store.stats(), counters={}, invariant_error="", used_by_ready=1
        )
        check = _region_check("consumer-1", stats)
        assert check.canary_violations == 1, check


def test_a_fill_while_an_earlier_one_holds_the_region_takes_nothing_and_gives_back() -> None:
    # Fills come every fault interval and last 0.5-1.5 s: a second one at the same
    # consumer once named its first entry as the first fill had, and the consumer died.
    with Region.create(MiB, name="ecshare-chaos-test", prefault=False) as region:
        store = Store(region, 64 * 1024)
        _fill(store, 0.2)
        assert store.stats().free_blocks == 0
        _fill(store, 0.2)
        deadline = time.monotonic() + 5.0
        while store.stats().free_blocks < 16 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert store.stats().free_blocks == 16, store.stats()


@pytest.fixture
def echo_server() -> Iterator[int]:
    server = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not done.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    done.set()
    thread.join(timeout=5)
    server.close()


def test_fault_proxy_delays_in_order_and_cuts_connections(echo_server: int) -> None:
    proxy = FaultProxy("127.0.0.1", echo_server, faults=Faults(), seed=1)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            proxy.delay_burst(30.0, 0.05)
            got = b""
            for i in range(5):
                client.sendall(f"<{i}>".encode())
                while not got.endswith(f"<{i}>".encode()):
                    got += client.recv(65536)
            assert got == b"<0><1><2><3><4>"  # delayed, never reordered
            assert proxy.counters["delayed_chunks"] >= 5

            proxy.cut_all()
            with pytest.raises((ConnectionError, OSError)):
                client.sendall(b"x")
                if not client.recv(65536):
                    raise ConnectionResetError("closed by the proxy")

        proxy.calm()
        proxy.faults = Faults(cut_prob=1.0)  # every chunk ends its connection
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(b"lost")
            with pytest.raises((ConnectionError, OSError)):
                if not client.recv(65536):
                    raise ConnectionResetError("closed by the proxy")
        assert proxy.counters["random_cuts"] >= 1
    finally:
        proxy.close()


def test_fault_proxy_holds_one_direction_then_delivers_the_backlog_in_order(
    echo_server: int,
) -> None:
    proxy = FaultProxy("127.0.0.1", echo_server, faults=Faults(), seed=2)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as client:
            client.sendall(b"<open>")
            assert client.recv(65536) == b"<open>"
            with pytest.raises(ValueError, match="unknown direction"):
                proxy.hold(1.0, ("sideways",))
            proxy.hold(1.0, ("to_consumer",))  # the echo comes back held
            client.sendall(b"<a>")
            client.sendall(b"<b>")
            client.settimeout(0.3)
            with pytest.raises(TimeoutError):
                client.recv(65536)  # held: the connection stays open, nothing moves
            client.settimeout(10)
            got = b""
            while not got.endswith(b"<b>"):
                got += client.recv(65536)
            assert got == b"<a><b>"  # the backlog, in order, once the hold ends
            assert proxy.counters["held_chunks"] >= 1
    finally:
        proxy.close()


@pytest.mark.timeout(240)
def test_fetches_survive_netem_loss_and_delay_in_a_namespace() -> None:
    why = netem_unavailable("delay 5ms 2ms loss 2%")
    if why is not None:
        pytest.skip(f"tc netem cannot run here: {why}")
    done = subprocess.run(
        [sys.executable, "-m", "ecshare", "chaos", "--fetches", "150", "--consumers", "2",
         "--netem", "delay 5ms 2ms loss 2%", "--json"],
        capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["netem"] == "delay 5ms 2ms loss 2%"
    assert report["ok"] and report["corrupted"] == 0 and report["leaked_pins"] == 0, report
