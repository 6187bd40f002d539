"""`ecshare bench proxy --quick --json` runs end to end and prints one well-formed object.

Only the shape is checked, never the speed: timings on a shared machine say nothing
about correctness. It takes 64 requests a round (`--samples`, one per client at 64) in
place of --quick's 100 and 640: the shape and every field are the same.
"""

from __future__ import annotations

import math
import subprocess
import sys
from typing import Any

import msgspec

REQUESTS = 64


def _positive(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


def test_bench_proxy_json_reports_overhead_for_each_scenario_and_concurrency() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ecshare", "bench", "proxy", "--quick", "--json", "--workers", "2",
         "--samples", str(REQUESTS)],
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = msgspec.json.decode(proc.stdout)
    assert report["target_p50_overhead_ms"] == 2.0 and report["target_concurrency"] == 64
    assert isinstance(report["meets_target"], bool)
    assert report["parameters"]["workers"] == 2 and report["parameters"]["quick"] is True
    assert report["parameters"]["requests_per_round"] == [REQUESTS, REQUESTS]
    rows = {(r["scenario"], r["concurrency"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {
        (scenario, clients, mode)
        for scenario in ("text", "image")
        for clients, mode in ((1, "closed"), (64, "closed"), (64, "paced"))
    }
    for scenario in ("text", "image"):
        paced, closed = rows[(scenario, 64, "paced")], rows[(scenario, 64, "closed")]
        # Paced at half of what the proxy carried closed-loop in the same run.
        assert math.isclose(paced["offered_rps"], 0.5 * closed["proxy"]["rps"], rel_tol=0.01)
        assert closed["offered_rps"] is None
    for row in rows.values():
        assert row["requests"] == REQUESTS * report["rounds"], row
        for side in ("direct", "proxy"):
            assert all(_positive(row[side][k]) for k in ("p50_ms", "p99_ms", "rps"))
        assert math.isclose(
            row["overhead_p50_ms"], row["proxy"]["p50_ms"] - row["direct"]["p50_ms"], abs_tol=0.01
        )
