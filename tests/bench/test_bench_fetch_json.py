"""`ecshare bench fetch --quick --json` runs end to end and prints one well-formed object.

Only the shape is checked, never the speed: timings on a shared machine say
nothing about correctness.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

import pytest

from ecshare.bench.fetch import FetchBenchResult
from ecshare.bench.report import decode_report
from ecshare.bench.schema import SCHEMA_VERSION

pytest.importorskip("nixl._api")

SIZES = {64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20}
MODES = {"single", "batch"}
ROW_NUMBERS = ("ecshare_gbps", "raw_nixl_gbps", "memcpy_gbps", "ratio_vs_raw_nixl")


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    proc = subprocess.run(
        [sys.executable, "-m", "ecshare", "bench", "fetch", "--quick", "--json"],
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


def test_rows_cover_every_size_and_mode(report: dict[str, Any]) -> None:
    rows = report["rows"]
    assert isinstance(rows, list)
    seen = {(row["size_bytes"], row["mode"]) for row in rows}
    assert seen == {(size, mode) for size in SIZES for mode in MODES}
    assert len(rows) == len(seen)


def test_row_fields_are_positive_numbers(report: dict[str, Any]) -> None:
    for row in report["rows"]:
        assert isinstance(row["size_bytes"], int) and not isinstance(row["size_bytes"], bool)
        assert isinstance(row["mode"], str)
        for key in ROW_NUMBERS:
            assert _positive(row[key]), (key, row)
        ratio = row["ecshare_gbps"] / row["raw_nixl_gbps"]
        assert math.isclose(row["ratio_vs_raw_nixl"], ratio, rel_tol=1e-6)


def test_latency_figures(report: dict[str, Any]) -> None:
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
