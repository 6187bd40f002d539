"""`ecshare bench fetch --quick --json` runs end to end and prints one well-formed object.

Only the shape is checked, never the speed: timings on a shared machine say
nothing about correctness. What is checked is that the figures are of real
transfers: every sporadic fetch was granted and read, its steps lie in the order
they happened, and the producer's CPU clock moved. So the run, over every default
size and mode, takes a few samples of each loop (--samples) after the usual warm-ups.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from ecshare.apps.bench.fetch import FetchBenchResult
from ecshare.apps.bench.report import decode_report
from ecshare.apps.bench.schema import SCHEMA_VERSION
from ecshare.apps.bench.sporadic import DIRECT_STEPS, ECSHARE_STEPS, RAW_STEPS, SPORADIC_WARMUP

pytest.importorskip("nixl._api")

pytestmark = pytest.mark.cpu_bound

SIZES = {64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20}
MODES = {"single", "batch"}
SPORADIC_SIZES = {64 << 10, 1 << 20, 4_505_600, 16 << 20}
# Each sample's entry is committed after the session opened, so the producer has
# said where it lies and the fetch reads it directly (direct_reads, the default).
SPORADIC_STEPS = [name for _, name in DIRECT_STEPS]
ROW_NUMBERS = ("ecshare_gbps", "raw_nixl_gbps", "memcpy_gbps", "ratio_vs_raw_nixl")
SAMPLES = 3


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _bench(*extra: str) -> dict[str, Any]:
    """`ecshare bench fetch --quick --json --samples SAMPLES EXTRA...`, its one object."""
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    args = ["bench", "fetch", "--quick", "--json", "--samples", str(SAMPLES), *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "ecshare", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON line, got: {proc.stdout[-4000:]}"
    data = json.loads(lines[0])
    assert isinstance(data, dict)
    return data


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return _bench()


def test_rows_cover_every_size_and_mode(report: dict[str, Any]) -> None:
    rows = report["rows"]
    assert isinstance(rows, list)
    seen = {(row["size_bytes"], row["mode"]) for row in rows}
    assert seen == {(size, mode) for size in SIZES for mode in MODES} | {
        (size, "sporadic") for size in SPORADIC_SIZES
    }
    assert len(rows) == len(seen)
    assert all(row["samples"] == SAMPLES for row in rows)
    parameters = report["parameters"]
    for counts in ("single_samples", "batch_samples"):
        assert parameters[counts] == [SAMPLES] * len(SIZES), counts
    assert parameters["sporadic_samples"] == [SAMPLES] * len(SPORADIC_SIZES)


def test_row_fields_are_positive_numbers(report: dict[str, Any]) -> None:
    for row in report["rows"]:
        assert isinstance(row["size_bytes"], int) and not isinstance(row["size_bytes"], bool)
        assert isinstance(row["mode"], str)
        for key in ROW_NUMBERS:
            assert _positive(row[key]), (key, row)
        ratio = row["ecshare_gbps"] / row["raw_nixl_gbps"]
        assert math.isclose(row["ratio_vs_raw_nixl"], ratio, rel_tol=1e-6)


def test_latency_figures(report: dict[str, Any]) -> None:
    assert report["latency_64k_samples"] == SAMPLES
    p50, p99 = report["latency_64k_p50_ms"], report["latency_64k_p99_ms"]
    assert _positive(p50) and _positive(p99)
    assert p99 >= p50


def test_result_is_a_versioned_fetch_result(report: dict[str, Any]) -> None:
    assert report["bench"] == "fetch"
    assert report["schema_version"] == SCHEMA_VERSION
    assert isinstance(decode_report(json.dumps(report).encode()), FetchBenchResult)


def test_extras(report: dict[str, Any]) -> None:
    assert isinstance(report["environment"], dict)
    assert isinstance(report["targets"], dict)
    assert isinstance(report["meets_targets"], bool)
    assert report["quick"] is True


def _sporadic(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in report["rows"] if row["mode"] == "sporadic"]


def test_sporadic_rows_give_percentiles_against_raw_nixl(report: dict[str, Any]) -> None:
    assert report["parameters"]["mode"] == "all"
    assert report["parameters"]["gap_ms"] == 5.0
    for row in _sporadic(report):
        assert row["gap_ms"] == 5.0 and row["items"] == 1 and row["samples"] > 0
        for key in ("ecshare_p50_ms", "ecshare_p99_ms", "raw_nixl_p50_ms", "raw_nixl_p99_ms"):
            assert _positive(row[key]), (key, row)
        assert row["ecshare_p99_ms"] >= row["ecshare_p50_ms"]
        assert row["raw_nixl_p99_ms"] >= row["raw_nixl_p50_ms"]
        ratio = row["raw_nixl_p50_ms"] / row["ecshare_p50_ms"]
        assert math.isclose(row["ratio_vs_raw_nixl"], ratio, rel_tol=1e-6)
        assert math.isclose(row["ecshare_ms"], row["ecshare_p50_ms"], rel_tol=1e-6)


def test_sporadic_steps_are_all_there_and_in_the_order_they_happened(
    report: dict[str, Any],
) -> None:
    # Every step is a difference of two marks on the host's one monotonic clock, and
    # each side marks before it sends: a negative step would be a mark out of place.
    for row in _sporadic(report):
        assert list(row["ecshare_phases_ms"]) == SPORADIC_STEPS, row["ecshare_phases_ms"]
        assert list(row["raw_nixl_phases_ms"]) == [name for _, name in RAW_STEPS]
        for steps in (row["ecshare_phases_ms"], row["raw_nixl_phases_ms"]):
            for name, ms in steps.items():
                assert isinstance(ms, float) and math.isfinite(ms) and ms >= 0, (name, row)


def test_sporadic_fetches_were_real_transfers(report: dict[str, Any]) -> None:
    """Each sample was located by the producer and read into the consumer's region."""
    rows = _sporadic(report)
    fetches = sum(row["samples"] + SPORADIC_WARMUP for row in rows)
    moved = sum((row["samples"] + SPORADIC_WARMUP) * row["size_bytes"] for row in rows)
    consumer = report["environment"]["consumer_counters"]
    producer = report["environment"]["producer_counters"]
    # The back-to-back modes fetch too, so these are lower bounds.
    assert consumer["fetched"] >= fetches
    assert consumer["fetched_bytes"] >= moved
    assert producer["located"] >= fetches
    assert consumer["direct_reads"] >= fetches
    assert consumer.get("direct_reads_stale", 0) == 0
    assert consumer.get("local_hits", 0) == 0  # each sample's entry was fresh
    # The bench blocks on its results, which lends its thread to their direct reads;
    # the network thread, woken by fetch() too, gets to some first.
    assert report["parameters"]["hand_off"] is False
    assert 0 < consumer["read_lent"] <= consumer["direct_reads"], consumer


def test_hand_off_leaves_every_read_to_the_network_thread() -> None:
    """`--hand-off`: fetches are waited for as an engine's scheduler waits, never on a
    future, so no caller's thread is lent to them; they are read as ever."""
    data = _bench("--hand-off", "--sizes", "64KiB")
    assert data["parameters"]["hand_off"] is True
    assert {(row["size_bytes"], row["mode"]) for row in data["rows"]} == {
        (64 << 10, mode) for mode in ("single", "batch", "sporadic")
    }
    consumer = data["environment"]["consumer_counters"]
    fetches = sum(row["samples"] + SPORADIC_WARMUP for row in _sporadic(data))
    assert consumer["direct_reads"] >= fetches, consumer
    assert "read_lent" not in consumer and "read_here" not in consumer, consumer


def test_producer_thread_cpu_is_measured(report: dict[str, Any]) -> None:
    cpu = report["producer_cpu"]
    assert isinstance(cpu, dict)
    for key in ("sporadic_share", "held_grant_share"):
        # A share of one core: the thread's CPU clock over wall time.
        assert isinstance(cpu[key], float) and 0 <= cpu[key] <= 1.5, (key, cpu)
    assert _positive(cpu["sporadic_us_per_fetch"])


def test_read_here_makes_the_sporadic_reads_on_the_calling_thread() -> None:
    """`--read-here`: each sporadic fetch is `fetch(read_here=True)`; on one host its
    READ is made and committed on the bench's own thread (counted `read_here`)."""
    data = _bench("--mode", "sporadic", "--read-here", "--sizes", "64KiB,4505600")
    assert data["parameters"]["read_here"] is True
    rows = _sporadic(data)
    assert [row["size_bytes"] for row in rows] == [64 << 10, 4_505_600]
    fetches = sum(row["samples"] + SPORADIC_WARMUP for row in rows)
    consumer = data["environment"]["consumer_counters"]
    assert consumer["fetched"] == fetches, consumer
    # The network thread sleeps nearly all the time, but a fetch that comes during
    # one of its passes (a heartbeat) is its own, and under load a place may come
    # after its fetch (which is then granted).
    assert 0 < consumer["read_here"] <= consumer["direct_reads"] <= fetches, consumer
    for row in rows:
        assert list(row["ecshare_phases_ms"]) == SPORADIC_STEPS, row["ecshare_phases_ms"]


def test_granted_makes_every_sporadic_fetch_ask_for_a_grant() -> None:
    """`--granted`: direct reads off on both sides, so each fetch is a grant's round trip
    (over the fetch lane, the path whose cost it measures)."""
    data = _bench("--mode", "sporadic", "--granted", "--sizes", "64KiB")
    assert data["parameters"]["granted"] is True
    (row,) = _sporadic(data)
    consumer = data["environment"]["consumer_counters"]
    assert consumer["fetched"] == row["samples"] + SPORADIC_WARMUP, consumer
    assert consumer.get("direct_reads", 0) == 0, consumer
    assert list(row["ecshare_phases_ms"]) == [name for _, name in ECSHARE_STEPS]
