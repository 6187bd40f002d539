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

SOAK_S = 25
# Over the post-warm-up part of a 25 s soak of some hundred fetches a second, a leak
# of even 1 KiB per fetch shows as several MiB; allocator noise stays far below these.
MAX_GROWTH_MIB = 48.0
MAX_SLOPE_MIB_PER_MIN = 60.0


@pytest.mark.timeout(180)
def test_soak_memory_and_region_usage_stay_bounded() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ecshare", "chaos", "--soak", str(SOAK_S), "--producers", "1",
         "--consumers", "2", "--json"],
        capture_output=True, text=True, timeout=170,
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
    for m in soak["memory"]:
        assert m["samples"] >= SOAK_S // 2, m
        assert m["end_mib"] - m["warm_mib"] < MAX_GROWTH_MIB, m
        assert m["anon_end_mib"] - m["anon_warm_mib"] < MAX_GROWTH_MIB, m
        assert m["slope_mib_per_min"] < MAX_SLOPE_MIB_PER_MIN, m
        assert m["anon_slope_mib_per_min"] < MAX_SLOPE_MIB_PER_MIN, m

    usage = {u["node"]: u for u in soak["regions"]}
    # The producer's region is smaller than its working set: it runs full, never over.
    assert 0.5 < usage["producer-0"]["mean_used_fraction"] <= 1.0, usage
    for region in report["regions"]:
        assert region["pins"] == 0 and region["allocated"] == 0, region
        assert region["free_blocks"] + region["used_blocks"] == region["total_blocks"]
        if region["node"].startswith("consumer"):
            assert region["used_blocks"] == 0, region  # every fetched copy was checked and dropped
