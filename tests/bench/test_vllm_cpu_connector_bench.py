"""`benchmarks/vllm_cpu_connector.py` moves real bytes through vLLM's CPU EC connector.

The bench runs end to end with a few samples per size: two real processes, the
connector's real ZMQ sessions and NIXL agents, ecshare's raw READ and ecshare's
own sporadic fetch. Checked: every size has its row in the table and in the
JSON line, and the bytes the last fetch and the last raw READ landed hash to
what the producer wrote, recomputed here. Never the speed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")
pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.cpu.session")

pytestmark = [pytest.mark.timeout(900), pytest.mark.cpu_bound]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_cpu_connector.py"
SIZES = (64 << 10, 1 << 20, 4_505_600, 16 << 20)
LABELS = ("64 KiB", "1 MiB", "4.3 MiB (880x2560 bf16)", "16 MiB")
ROW_BYTES = 5120  # one 2560-wide bf16 row: the connector's block
SAMPLES = 2
WARMUP = 3  # the bench's warm-up fetches per size, also checked


def _expected_sha256(moved: int, seq: int) -> str:
    """The bytes the producer writes for sample `seq`, computed independently."""
    base = np.random.default_rng(moved).integers(0, 256, moved, dtype=np.uint8)
    return hashlib.sha256((base ^ np.uint8(seq % 251 + 1)).tobytes()).hexdigest()


@pytest.fixture(scope="module")
def run() -> tuple[str, dict[str, Any]]:
    env = {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}
    args = ["--samples", str(SAMPLES), "--region-mib", "48", "--json"]
    proc = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=840,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    lines = proc.stdout.splitlines()
    data = json.loads(lines[-1])
    assert isinstance(data, dict)
    return "\n".join(lines[:-1]), data


def test_every_size_has_a_table_row_with_all_three_columns(run: tuple[str, dict[str, Any]]) -> None:
    table, _ = run
    rows = [line for line in table.splitlines() if line.startswith(LABELS)]
    assert [next(lb for lb in LABELS if r.startswith(lb)) for r in rows] == list(LABELS)
    for row in rows:
        # connector, raw READ, ecshare, ecshare's raw READ: four p50/p99 pairs
        assert row.count("/") == 4, row


def test_connector_fetch_and_raw_read_land_the_producers_bytes(
    run: tuple[str, dict[str, Any]],
) -> None:
    _, data = run
    assert [r["size_bytes"] for r in data["rows"]] == list(SIZES)
    last = 2 * (WARMUP + SAMPLES - 1)  # the seq of the last sample's fetch
    for row in data["rows"]:
        moved = -(-row["size_bytes"] // ROW_BYTES) * ROW_BYTES
        assert row["moved_bytes"] == moved
        assert row["samples"] == SAMPLES
        # every fetch and every raw READ, warm-up included, was compared byte for byte
        assert row["bytes_checked"] == 2 * moved * (WARMUP + SAMPLES)
        assert row["connector_sha256"] == _expected_sha256(moved, last)
        assert row["raw_sha256"] == _expected_sha256(moved, last + 1)


def test_figures_are_finite_for_every_column(run: tuple[str, dict[str, Any]]) -> None:
    _, data = run
    for row in data["rows"]:
        figures = [row[k] for k in ("connector_p50_ms", "connector_p99_ms", "raw_p50_ms")]
        figures += [row["ecshare"][k] for k in ("p50_ms", "p99_ms", "raw_p50_ms")]
        assert all(math.isfinite(x) and x > 0 for x in figures), row
