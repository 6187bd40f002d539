"""Before and after, every performance target in one run: the guard a change runs before it lands.

A target can only be trusted against a baseline measured in the same minutes (on a shared
2-core machine the load of the moment moves figures more than most changes do), so this
runs every bench that carries a target on two trees, interleaved round by round, and
judges both trees by the same definitions (the after tree's constants, applied to the raw
rows of each tree's JSON, so an older tree is judged as the newer one would be):

- ``ecshare bench fetch --mode sporadic``: added cost over a raw NIXL READ from 1 MiB,
  and the 64 KiB p50;
- ``ecshare bench fetch --mode back-to-back``: single fetches from 4 MiB and batches from
  1 MiB against raw NIXL, and the 64 KiB p50;
- ``ecshare bench pipeline``, at a 2 ms and a 5 ms proxy hop: push in time and exposed
  p50 (the targets of push, docs/PUSH.md);
- ``ecshare bench proxy``: the proxy's added p50 at 64 clients.

Each target's figure is printed per tree as the median over rounds and its range, with the
verdict on the median and the number of rounds that met it. The exit status is 1 when a
target met before is missed after, so a script can stop on it; a target missed on both
trees is reported, not failed.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/ab.py main --rounds 3
    .venv/bin/python benchmarks/ab.py 419d36a --after HEAD --only fetch-sporadic,pipeline

The "before" ref's tree is exported with ``git archive`` (no checkout is touched); the
"after" tree is the working tree unless ``--after`` names a ref. UCX_* variables reach both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab_sporadic import _export  # noqa: E402  (a ref's tree, exported with git archive)

from ecshare.apps.bench import fetch as _fetch  # noqa: E402  (the after tree's definitions)
from ecshare.apps.bench import pipeline as _pipeline  # noqa: E402
from ecshare.apps.bench import proxy as _proxy  # noqa: E402

Result = dict[str, Any]
MiB = 1 << 20


@dataclass(frozen=True)
class Bench:
    """One bench command; `args` follow ``python -m ecshare bench``."""

    name: str
    args: tuple[str, ...]
    quick_args: tuple[str, ...]


BENCHES: tuple[Bench, ...] = (
    Bench("fetch-sporadic", ("fetch", "--mode", "sporadic"), ("--quick",)),
    Bench("fetch-batch", ("fetch", "--mode", "back-to-back"), ("--quick",)),
    Bench("pipeline-2ms", ("pipeline", "--delay-ms", "2"), ("--quick",)),
    Bench("pipeline-5ms", ("pipeline", "--delay-ms", "5"), ("--quick",)),
    Bench("proxy", ("proxy",), ("--quick",)),
)
GROUPS = {"fetch-sporadic", "fetch-batch", "pipeline", "proxy"}


@dataclass(frozen=True)
class Target:
    """A figure read from one bench's result, and whether it meets its target.

    `figure` returns None when the result has no row to judge (a size not measured)."""

    bench: str
    name: str
    unit: str
    figure: Callable[[Result], float | None]
    met: Callable[[float], bool]
    limit: str


def _rows(result: Result, mode: str | None = None) -> list[dict[str, Any]]:
    return [r for r in result["rows"] if mode is None or r.get("mode") == mode]


def _max_or_none(values: Sequence[float]) -> float | None:
    return max(values) if values else None


def _min_or_none(values: Sequence[float]) -> float | None:
    return min(values) if values else None


def _sporadic_excess(result: Result) -> float | None:
    return _max_or_none(
        [
            r["ecshare_p50_ms"] - r["raw_nixl_p50_ms"]
            for r in _rows(result, "sporadic")
            if r["size_bytes"] >= _fetch.TARGET_SPORADIC_MIN_BYTES
        ]
    )


def _sporadic_small(result: Result) -> float | None:
    return _max_or_none(
        [
            r["ecshare_p50_ms"]
            for r in _rows(result, "sporadic")
            if r["size_bytes"] <= _fetch.TARGET_SPORADIC_SMALL
        ]
    )


def _ratio(mode: str, min_bytes: int) -> Callable[[Result], float | None]:
    def figure(result: Result) -> float | None:
        return _min_or_none(
            [r["ratio_vs_raw_nixl"] for r in _rows(result, mode) if r["size_bytes"] >= min_bytes]
        )

    return figure


def _latency_64k(result: Result) -> float | None:
    value = result.get("latency_64k_p50_ms")
    return float(value) if value is not None else None


def _push_figure(
    field: str, sizes: Callable[[int], bool], worst: str, delay_ms: float
) -> Callable[[Result], float | None]:
    """The worst push row's `field` at hop `delay_ms` (a result of one hop names it at
    the top; one of several hops, on each row)."""

    def figure(result: Result) -> float | None:
        values = [
            r[field]
            for r in _rows(result, "push")
            if sizes(r["size_bytes"]) and r.get("delay_ms", result["delay_ms"]) == delay_ms
        ]
        return (_min_or_none if worst == "min" else _max_or_none)(values)

    return figure


def _proxy_overhead(result: Result) -> float | None:
    for r in result["rows"]:
        if (r["scenario"], r["concurrency"], r["mode"]) == (
            "text",
            _proxy.TARGET_CONCURRENCY,
            "paced",
        ):
            return float(r["overhead_p50_ms"])
    return None


_ITEM = _pipeline.TARGET_ITEM_BYTES
TARGETS: tuple[Target, ...] = (
    Target(
        "fetch-sporadic",
        "sporadic added cost >= 1 MiB",
        "ms",
        _sporadic_excess,
        lambda v: v <= _fetch.TARGET_SPORADIC_EXCESS_MS,
        f"<= {_fetch.TARGET_SPORADIC_EXCESS_MS}",
    ),
    Target(
        "fetch-sporadic",
        "sporadic 64 KiB p50",
        "ms",
        _sporadic_small,
        lambda v: v <= _fetch.TARGET_SPORADIC_SMALL_P50_MS,
        f"<= {_fetch.TARGET_SPORADIC_SMALL_P50_MS}",
    ),
    Target(
        "fetch-batch",
        "single >= 4 MiB / raw NIXL",
        "x",
        _ratio("single", _fetch.TARGET_SINGLE_MIN_BYTES),
        lambda v: v >= _fetch.TARGET_SINGLE_RATIO,
        f">= {_fetch.TARGET_SINGLE_RATIO}",
    ),
    Target(
        "fetch-batch",
        "batch >= 1 MiB / raw NIXL",
        "x",
        _ratio("batch", _fetch.TARGET_BATCH_MIN_BYTES),
        lambda v: v >= _fetch.TARGET_BATCH_RATIO,
        f">= {_fetch.TARGET_BATCH_RATIO}",
    ),
    Target(
        "fetch-batch",
        "back-to-back 64 KiB p50",
        "ms",
        _latency_64k,
        lambda v: v <= _fetch.TARGET_P50_MS,
        f"<= {_fetch.TARGET_P50_MS}",
    ),
    Target(
        "pipeline-2ms",
        "push in time, 4.3 MiB, 2 ms hop",
        "share",
        _push_figure("pushed_in_time", lambda n: n == _ITEM, "min", 2.0),
        lambda v: v >= _pipeline.TARGET_IN_TIME_2MS,
        f">= {_pipeline.TARGET_IN_TIME_2MS}",
    ),
    Target(
        "pipeline-2ms",
        "push exposed p50, 4.3 MiB, 2 ms hop",
        "ms",
        _push_figure("exposed_p50_ms", lambda n: n == _ITEM, "max", 2.0),
        lambda v: v <= _pipeline.TARGET_EXPOSED_P50_MS,
        f"<= {_pipeline.TARGET_EXPOSED_P50_MS}",
    ),
    Target(
        "pipeline-5ms",
        "push in time, <= 4.3 MiB, 5 ms hop",
        "share",
        _push_figure("pushed_in_time", lambda n: n <= _ITEM, "min", 5.0),
        lambda v: v >= _pipeline.TARGET_IN_TIME_5MS,
        f">= {_pipeline.TARGET_IN_TIME_5MS}",
    ),
    Target(
        "proxy",
        "proxy added p50, 64 clients",
        "ms",
        _proxy_overhead,
        lambda v: v <= _proxy.TARGET_P50_OVERHEAD_MS,
        f"<= {_proxy.TARGET_P50_OVERHEAD_MS}",
    ),
)


def run_one(
    tree: Path, bench: Bench, quick: bool, timeout_s: float, sizes: str | None = None
) -> Result:
    """One bench of `tree`, its parsed JSON result; a failed run stops the comparison."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    env.setdefault("UCX_NET_DEVICES", "lo")
    extra = list(bench.quick_args if quick else ())
    if sizes and bench.args[0] != "proxy":
        extra += ["--sizes", sizes]
    command = [sys.executable, "-m", "ecshare", "bench", *bench.args, *extra, "--json"]
    if bench.args[0] != "pipeline":
        command.append("--quiet")
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=tree, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise SystemExit(f"{bench.name} failed in {tree}:\n{proc.stderr[-3000:]}")
    result: Result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _selected(only: str | None) -> list[Bench]:
    if not only:
        return list(BENCHES)
    wanted = {w.strip() for w in only.split(",") if w.strip()}
    unknown = wanted - GROUPS
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {sorted(GROUPS)}")
    return [b for b in BENCHES if b.name in wanted or b.name.split("-")[0] in wanted]


def _summary(values: list[float], unit: str) -> str:
    if not values:
        return "not measured"
    fmt = "{:.0%}" if unit == "share" else "{:.3f}"
    mid = fmt.format(statistics.median(values))
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def judge(runs: dict[str, dict[str, list[Result]]]) -> tuple[list[str], bool]:
    """The table's lines, and whether a target met before is missed after."""
    lines = [
        f"{'target':<38} {'limit':>9} {'before: median (range)':>26} {'':>6} rounds "
        f"{'after: median (range)':>26} {'':>6} rounds"
    ]
    regressed = False
    for target in TARGETS:
        if target.bench not in runs["before"]:
            continue
        cells = []
        verdicts = []
        for tree in ("before", "after"):
            values = [v for r in runs[tree][target.bench] if (v := target.figure(r)) is not None]
            verdict = None if not values else target.met(statistics.median(values))
            verdicts.append(verdict)
            rounds_met = sum(target.met(v) for v in values)
            cells.append(
                f"{_summary(values, target.unit):>26} "
                f"{'-' if verdict is None else 'met' if verdict else 'MISSED':>6} "
                f"{rounds_met}/{len(values)}"
            )
        lost = verdicts[0] is True and verdicts[1] is False
        regressed |= lost
        flag = "  <- regression" if lost else ""
        lines.append(f"{target.name:<38} {target.limit:>9} {cells[0]} {cells[1]}{flag}")
    return lines, regressed


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("before", help="git ref of the tree to compare against")
    parser.add_argument("--after", help="git ref (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--quick", action="store_true", help="each bench's --quick")
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(sorted(GROUPS))}")
    parser.add_argument(
        "--sizes", help="item sizes of the fetch and pipeline benches (default: theirs)"
    )
    parser.add_argument("--json", type=Path, help="also write every run's result here")
    parser.add_argument(
        "--timeout-s", type=float, default=1800.0, help="per bench run (default 1800)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    benches = _selected(args.only)
    runs: dict[str, dict[str, list[Result]]] = {
        "before": {b.name: [] for b in benches},
        "after": {b.name: [] for b in benches},
    }
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ecshare-ab-") as tmp:
        trees = {
            "before": _export(args.before, Path(tmp) / "before"),
            "after": _export(args.after, Path(tmp) / "after") if args.after else ROOT,
        }
        for i in range(args.rounds):
            for bench in benches:
                # Alternate which tree goes first, per round, so drift hits both alike.
                order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
                for tree in order:
                    runs[tree][bench.name].append(
                        run_one(trees[tree], bench, args.quick, args.timeout_s, args.sizes)
                    )
                    print(f"round {i + 1}/{args.rounds}: {bench.name} {tree} done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(runs))
    lines, regressed = judge(runs)
    print(
        f"{args.rounds} interleaved rounds; before = {args.before}, after = "
        f"{args.after or 'working tree'}; 1-min load {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("\n".join(lines))
    return 1 if regressed else 0


if __name__ == "__main__":
    raise SystemExit(main())
