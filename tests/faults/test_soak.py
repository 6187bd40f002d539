"""A bounded soak: sustained fetches between real processes, memory and region usage sampled.

Bounds are generous and relative to a warm-up baseline measured in the same run:
they catch a leak (memory that grows with every fetch), not a slow machine.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl._api")

SOAK_S = 30
CONSUMERS = 2
# The leak the limits must see: 1 KiB per fetch, in each consumer (of its own fetches).
# Each limit is half of what such a leak adds over the run's own post-warm-up fetches,
# so it scales with the fetch rate a loaded machine reaches.
LEAK_KIB_PER_FETCH = 1.0
SEEN_AT = 0.5
# Fewer fetches than this per consumer and the leak would hide in allocator noise
# (a step of a few MiB): the run could not back its claim.
MIN_LEAK_MIB = 6.0
# The soak runs on past SOAK_S until its consumers made this many fetches after the
# warm-up (a quarter over the floor): a slower host takes longer, not fewer fetches.
SOAK_FETCHES = int(CONSUMERS * MIN_LEAK_MIB * 1024 / LEAK_KIB_PER_FETCH * 1.25)


@pytest.mark.timeout(300)
@pytest.mark.cpu_bound
def test_soak_memory_and_region_usage_stay_bounded() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ecshare", "chaos", "--soak", str(SOAK_S), "--producers", "1",
         "--consumers", str(CONSUMERS), "--soak-fetches", str(SOAK_FETCHES), "--json"],
        capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    soak = report["soak"]

    assert report["ok"], report["violations"]
    assert report["corrupted"] == 0 and report["leaked_blocks"] == 0
    assert report["leaked_pins"] == 0 and report["hangs"] == 0
    assert report["delivered"] > 0 and soak["delivered_mib"] > 0
    assert sum(report["faults"].get(k, 0) for k in ("kill_producer", "kill_consumer")) == 0

    names = {m["process"] for m in soak["memory"]}
    assert {"harness", "producer-0", "consumer-1", "consumer-2"} <= names, names
    # What the leak would add to one consumer after the warm-up (the producer, serving
    # every consumer, and the harness, counting every fetch, would gain more).
    per_consumer_per_s = soak["fetch_rate_per_s"] / CONSUMERS
    leak_mib = soak["fetches_after_warmup"] / CONSUMERS * LEAK_KIB_PER_FETCH / 1024
    leak_mib_per_min = per_consumer_per_s * 60 * LEAK_KIB_PER_FETCH / 1024
    assert leak_mib >= MIN_LEAK_MIB, f"too few fetches to see a leak: {soak}"
    max_growth, max_slope = SEEN_AT * leak_mib, SEEN_AT * leak_mib_per_min
    for m in soak["memory"]:
        assert m["samples"] >= soak["seconds"] // 2, m
        assert m["end_mib"] - m["warm_mib"] < max_growth, (max_growth, m)
        assert m["anon_end_mib"] - m["anon_warm_mib"] < max_growth, (max_growth, m)
        assert m["slope_mib_per_min"] < max_slope, (max_slope, m)
        assert m["anon_slope_mib_per_min"] < max_slope, (max_slope, m)

    usage = {u["node"]: u for u in soak["regions"]}
    # The producer's region is smaller than its working set: it runs full, never over.
    assert 0.5 < usage["producer-0"]["mean_used_fraction"] <= 1.0, usage
    for region in report["regions"]:
        assert region["pins"] == 0 and region["allocated"] == 0, region
        assert region["free_blocks"] + region["used_blocks"] == region["total_blocks"]
        if region["node"].startswith("consumer"):
            assert region["used_blocks"] == 0, region  # every fetched copy was checked and dropped
