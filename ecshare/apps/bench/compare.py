"""``ecshare bench compare BEFORE.json AFTER.json``: what changed between two runs.

Both files must come from the same bench. Each row of a result yields a few figures
(`Figure`): ecshare's own (GB/s, ms) and the baseline measured beside it in the same run.
``--by ecshare`` compares ecshare's figure; ``--by ratio`` compares ecshare against its
baseline, which shrugs off a machine that is slower or busier as a whole. A figure that got
worse by more than ``--threshold`` percent is marked a regression; ``--fail-on-regression
PCT`` makes the command exit 1 when one got worse by more than PCT percent.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ecshare.apps.bench.fetch import FetchBenchResult
from ecshare.apps.bench.report import BenchResult, ReportError, bench_name
from ecshare.apps.bench.store import StoreBenchResult
from ecshare.apps.bench.synthetic import format_size

__all__ = [
    "Change",
    "Comparison",
    "Figure",
    "compare",
    "figures",
    "regressions",
    "render_comparison",
    "run_compare",
]


class Figure(NamedTuple):
    row: str  # e.g. "4 MiB single"
    metric: str  # e.g. "fetch GB/s"
    value: float
    baseline: float | None  # measured beside it in the same run
    baseline_name: str
    higher_is_better: bool


class Change(NamedTuple):
    row: str
    metric: str
    before: float
    after: float
    worse_pct: float  # how much worse, in percent; negative when better

    @property
    def ratio(self) -> float:
        return self.after / self.before if self.before else math.inf


class Comparison(NamedTuple):
    bench: str
    by: str
    changes: list[Change]
    only_before: list[str]
    only_after: list[str]
    notes: list[str]


def figures(result: BenchResult) -> list[Figure]:
    """The comparable figures of one result, in the order of its rows."""
    out: list[Figure] = []
    if isinstance(result, FetchBenchResult):
        for r in result.rows:
            row = f"{format_size(r.size_bytes)} {r.mode}"
            out.append(Figure(row, "fetch GB/s", r.ecshare_gbps, r.raw_nixl_gbps, "raw NIXL", True))
            if r.ecshare_p99_ms is not None:
                out.append(Figure(row, "p99 ms", r.ecshare_p99_ms, None, "", False))
        if result.latency_64k_p50_ms is not None and result.raw_nixl_64k_p50_ms is not None:
            out.append(
                Figure(
                    "64 KiB latency",
                    "p50 ms",
                    result.latency_64k_p50_ms,
                    result.raw_nixl_64k_p50_ms,
                    "raw NIXL",
                    False,
                )
            )
    elif isinstance(result, StoreBenchResult):
        for c in result.copies:
            row = format_size(c.size_bytes)
            out.append(Figure(row, "put GB/s", c.put_gbps, c.memcpy_gbps, "memcpy", True))
            out.append(Figure(row, "get GB/s", c.get_gbps, c.memcpy_gbps, "memcpy", True))
        t = result.table
        table = f"table, {t.live_entries} live"
        out.append(Figure(table, "alloc+free us", t.alloc_commit_free_us, None, "", False))
        out.append(Figure(table, "pin+unpin us", t.pin_unpin_us, None, "", False))
    else:
        for p in result.rows:
            row = f"{p.scenario}, {p.concurrency} clients, {p.mode}"
            for q in ("p50", "p99"):
                value = getattr(p.proxy, f"{q}_ms")
                direct = getattr(p.direct, f"{q}_ms")
                out.append(Figure(row, f"proxy {q} ms", value, direct, "direct", False))
            out.append(Figure(row, "proxy rps", p.proxy.rps, p.direct.rps, "direct", True))
    return out


def _value(f: Figure, by: str) -> float | None:
    if by == "ecshare":
        return f.value
    return f.value / f.baseline if f.baseline else None


def compare(before: BenchResult, after: BenchResult, by: str = "ecshare") -> Comparison:
    if by not in ("ecshare", "ratio"):
        raise ValueError(f"--by must be 'ecshare' or 'ratio', not {by!r}")
    name = bench_name(before)
    if bench_name(after) != name:
        raise ReportError(
            f"cannot compare a {name} bench result with a {bench_name(after)} bench result"
        )
    old = {(f.row, f.metric): f for f in figures(before)}
    new = {(f.row, f.metric): f for f in figures(after)}
    changes = []
    for key, f in new.items():
        if key not in old:
            continue
        b, a = _value(old[key], by), _value(f, by)
        if b is None or a is None or b <= 0:
            continue
        change = (a - b) / b * 100
        changes.append(Change(f.row, f.metric, b, a, -change if f.higher_is_better else change))
    notes = []
    mb, ma = before.machine, after.machine
    if (mb.hostname, mb.cpu_model, mb.cpus) != (ma.hostname, ma.cpu_model, ma.cpus):
        notes.append(
            f"the runs are from different machines ({mb.hostname}, {mb.cpus} CPUs; "
            f"{ma.hostname}, {ma.cpus} CPUs): compare with --by ratio"
        )
    if before.parameters != after.parameters:
        notes.append("the runs used different parameters (sizes, samples or --quick)")
    for label, m in (("before", mb), ("after", ma)):
        if m.load_average_1m[1] > 0.5 * max(m.cpus, 1):
            notes.append(f"the machine was busy during the {label} run (load {m.load_average_1m})")
    return Comparison(
        bench=name,
        by=by,
        changes=changes,
        only_before=[f"{r} {m}" for r, m in old if (r, m) not in new],
        only_after=[f"{r} {m}" for r, m in new if (r, m) not in old],
        notes=notes,
    )


def regressions(comparison: Comparison, pct: float) -> list[Change]:
    return [c for c in comparison.changes if c.worse_pct > pct]


def render_comparison(comparison: Comparison, threshold_pct: float) -> str:
    what = "ecshare's figures" if comparison.by == "ecshare" else "ecshare / baseline"
    lines = [
        f"## ecshare bench compare: {comparison.bench} ({what})",
        "",
        "| row | metric | before | after | after / before | change | |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in comparison.changes:
        better = "better" if c.worse_pct < 0 else "worse"
        flag = "**REGRESSION**" if c.worse_pct > threshold_pct else ""
        pct = f"{(c.after - c.before) / c.before * 100:+.1f}% ({better})"
        if abs(c.worse_pct) < 0.05:
            pct = "+0.0%"
        lines.append(
            f"| {c.row} | {c.metric} | {c.before:.4g} | {c.after:.4g} | "
            f"{c.ratio:.3f}x | {pct} | {flag} |"
        )
    found = regressions(comparison, threshold_pct)
    lines += [
        "",
        f"{len(found)} regression(s) beyond {threshold_pct:g}% in {len(comparison.changes)} "
        "compared figures.",
    ]
    lines += [f"- only in BEFORE: {x}" for x in comparison.only_before]
    lines += [f"- only in AFTER: {x}" for x in comparison.only_after]
    lines += [f"- note: {n}" for n in comparison.notes]
    return "\n".join(lines) + "\n"


def run_compare(
    before_path: str,
    after_path: str,
    *,
    by: str = "ecshare",
    threshold_pct: float = 5.0,
    fail_on_regression_pct: float | None = None,
) -> int:
    """Print the comparison; 1 on a regression beyond the fail threshold, 2 on bad input."""
    import sys
    from pathlib import Path

    from ecshare.apps.bench.report import read_report

    try:
        comparison = compare(read_report(Path(before_path)), read_report(Path(after_path)), by)
    except ReportError as exc:
        print(f"ecshare bench compare: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_comparison(comparison, threshold_pct))
    if fail_on_regression_pct is not None:
        failed = regressions(comparison, fail_on_regression_pct)
        if failed:
            print(
                f"ecshare bench compare: {len(failed)} figure(s) worse by more than "
                f"{fail_on_regression_pct:g}%: "
                + "; ".join(f"{c.row} {c.metric} {c.worse_pct:.1f}% worse" for c in failed),
                file=sys.stderr,
            )
            return 1
    return 0
