"""`ecshare bench pipeline`: real encoder and PD processes, push against pull, as JSON rows."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl._api")

from ecshare.apps.bench.pipeline import CREDIT_STEPS
from ecshare.apps.cli import build_parser

pytestmark = pytest.mark.timeout(240)

SAMPLES = 4  # requests per size and mode, after the warm-up: each push must be in time


def test_pipeline_bench_prints_push_and_pull_rows_and_pushes_in_time() -> None:
    # A long simulated hop (200 ms), so that every 64 KiB push has long landed when the
    # scheduler asks: pushed_in_time is then a functional outcome, not a timing one. So a
    # few requests (--samples) tell as much as many.
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ecshare",
            "bench",
            "pipeline",
            "--json",
            "--quick",
            "--sizes",
            "64KiB,100003",
            "--delay-ms",
            "200",
            "--samples",
            str(SAMPLES),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["bench"] == "pipeline" and result["delay_ms"] == 200
    # The PD region's 2 MiB pages, as the host's setting grants them (region_hugepages).
    with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
        setting = f.read().split("[")[1].split("]")[0]
    if setting in ("never", "deny"):
        assert result["hugepage_share"] == 0.0
    else:
        assert result["hugepage_share"] > 0.9
    rows = {(r["size_bytes"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in (65536, 100003) for m in ("push", "pull")}
    for row in rows.values():
        assert set(row) == {
            "size_bytes",
            "mode",
            "exposed_p50_ms",
            "exposed_p99_ms",
            "pushed_in_time",
            "samples",
            "delay_ms",
            "landed_p50_ms",
            "landed_p90_ms",
            "asked_p50_ms",
            "steps_ms",
            "late_steps_ms",
        }
        assert row["samples"] == SAMPLES
        assert row["delay_ms"] == 200
        assert 0 < row["exposed_p50_ms"] <= row["exposed_p99_ms"]
    for size in (65536, 100003):
        push, pull = rows[(size, "push")], rows[(size, "pull")]
        assert push["pushed_in_time"] == 1.0
        assert pull["pushed_in_time"] == 0.0
        # Every step of every push was marked, on both sides, and none went back in time
        # but the consumer's word, whose notification may beat the producer's poll of DONE.
        # Both sizes fit the standing credit: written with no offer, after the warm-up.
        assert list(push["steps_ms"]) == [name for _, name in CREDIT_STEPS]
        assert all(ms >= 0 for k, ms in push["steps_ms"].items() if k != "word to consumer")
        assert push["late_steps_ms"] == {}  # every push was in time: no late one to show
        assert 0 < push["landed_p50_ms"] <= push["landed_p90_ms"] < push["asked_p50_ms"]
        assert pull["steps_ms"] == {} and pull["landed_p50_ms"] == 0


def test_pipeline_bench_measures_each_hop_of_a_list_in_one_run() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ecshare",
            "bench",
            "pipeline",
            "--json",
            "--sizes",
            "64KiB",
            "--delay-ms",
            "150,200",
            "--samples",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["delays_ms"] == [150, 200] and result["delay_ms"] == 150
    assert sorted((r["delay_ms"], r["mode"]) for r in result["rows"]) == [
        (150, "pull"),
        (150, "push"),
        (200, "pull"),
        (200, "push"),
    ]
    assert all(r["pushed_in_time"] == 1.0 for r in result["rows"] if r["mode"] == "push")


@pytest.mark.parametrize("flag", [["--out", "results"], ["--quiet"]])
def test_pipeline_refuses_the_file_and_progress_flags_it_has_no_use_for(
    flag: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    # It writes no files and draws no bar: taking these flags would ignore them silently.
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "pipeline", *flag])
    assert exit_info.value.code == 2
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err
