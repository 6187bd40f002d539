"""benchmarks/ab.py, the before/after guard: it reads every target off real bench output of
two trees, and it calls a regression only a target met before and missed after."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
AB = ROOT / "benchmarks" / "ab.py"


def _load_ab() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ab_under_test", AB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _pipeline_result(in_time: float, p50_ms: float) -> dict[str, Any]:
    row = {"size_bytes": 4_505_600, "mode": "push", "pushed_in_time": in_time}
    return {"delay_ms": 2.0, "rows": [{**row, "exposed_p50_ms": p50_ms}]}


def test_a_run_of_several_hops_is_judged_by_the_rows_of_each_hop() -> None:
    ab = _load_ab()
    row = {"size_bytes": 4_505_600, "mode": "push"}
    both = {
        "delay_ms": 2.0,
        "rows": [
            {**row, "delay_ms": 2.0, "pushed_in_time": 0.5, "exposed_p50_ms": 0.9},
            {**row, "delay_ms": 5.0, "pushed_in_time": 1.0, "exposed_p50_ms": 0.1},
        ],
    }
    figures = {t.name: t.figure(both) for t in ab.TARGETS if t.bench.startswith("pipeline")}
    assert figures == {
        "push in time, 4.3 MiB, 2 ms hop": 0.5,
        "push exposed p50, 4.3 MiB, 2 ms hop": 0.9,
        "push in time, <= 4.3 MiB, 5 ms hop": 1.0,
    }


def test_only_a_target_met_before_and_missed_after_is_a_regression() -> None:
    ab = _load_ab()
    ok, slow = _pipeline_result(1.0, 0.1), _pipeline_result(0.5, 0.9)
    runs = {
        "before": {"pipeline-2ms": [ok, ok, slow]},
        "after": {"pipeline-2ms": [slow, slow, ok]},
    }
    lines, regressed = ab.judge(runs)
    assert regressed
    flagged = [line for line in lines if "regression" in line]
    assert len(flagged) == 2, lines  # in time and exposed p50, both lost on the median
    assert all("2/3" in line and "1/3" in line for line in flagged), flagged
    # Missed on both trees: reported, not a regression; better after: not one either.
    lines, regressed = ab.judge({"before": runs["after"], "after": runs["before"]})
    assert not regressed
    lines, regressed = ab.judge(
        {"before": {"pipeline-2ms": [slow]}, "after": {"pipeline-2ms": [slow]}}
    )
    assert not regressed and sum("MISSED" in line for line in lines) == 2


def test_unknown_bench_names_are_refused() -> None:
    proc = subprocess.run(
        [sys.executable, str(AB), "HEAD", "--only", "fetch,typo"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "unknown ['fetch', 'typo']" in proc.stderr


@pytest.mark.timeout(600)
@pytest.mark.cpu_bound
def test_every_target_of_the_fetch_and_pipeline_benches_is_read_off_both_trees(
    tmp_path: Path,
) -> None:
    pytest.importorskip("nixl._api")
    if subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True
    ).returncode:
        pytest.fail("benchmarks/ab.py exports its 'before' tree with git: run from a checkout")
    out = tmp_path / "runs.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(AB),
            "HEAD",
            "--quick",
            "--rounds",
            "1",
            "--only",
            "fetch-sporadic,pipeline",
            "--sizes",
            "64KiB,1MiB,4505600",  # the sizes the targets judge
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=580,
    )
    # Exit 1 is a verdict (one noisy round may miss a target), not a failure to measure.
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert "not measured" not in proc.stdout, proc.stdout
    runs = json.loads(out.read_text())
    ab = _load_ab()
    judged = [t for t in ab.TARGETS if t.bench in runs["before"]]
    assert {t.bench for t in judged} == {"fetch-sporadic", "pipeline-2ms", "pipeline-5ms"}
    for target in judged:
        for tree in ("before", "after"):
            (result,) = runs[tree][target.bench]
            assert target.figure(result) is not None, (target.name, tree)
        assert target.name in proc.stdout
