"""The ``ecshare bench`` subcommands: store, fetch, pipeline, proxy, report, compare, schema,
abuse.

Every measuring subcommand prints its table (or, with ``--json``, one JSON object) on
stdout, shows a progress bar on stderr when that is a terminal and ``--quiet`` is not
given, and with ``--out DIR`` also writes ``DIR/<bench>.json``, ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ecshare.apps.bench.synthetic import parse_size

__all__ = ["add_bench_arguments", "run_bench"]

_MAX_SIZE = 1 << 30


def _sizes(text: str) -> list[int]:
    try:
        sizes = [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes:
        raise argparse.ArgumentTypeError("expected at least one size, e.g. 64KiB,4MiB")
    for size in sizes:
        if not 1 <= size <= _MAX_SIZE:
            raise argparse.ArgumentTypeError(f"size {size} is not between 1 byte and 1 GiB")
    return sizes


def _float_in(expected: str, low: float, high: float, refused: str) -> Callable[[str], float]:
    """An argparse type: a number from `low` to `high`; `expected` names it when the text
    is no number, and `refused` (with `{text}`) says why a number out of range is."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, not {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(refused.format(text=text))
        return value

    return parse


def _samples(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, not {text!r}") from None
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"{text} is not between 1 and 1000000")
    return value


_percent = _float_in("a percentage", 0, 1e6, "{text} is not a percentage from 0 to 1000000")
_gap_ms = _float_in("milliseconds", 0, 10_000, "{text} ms is not between 0 and 10000")


def _delays_ms(text: str) -> list[float]:
    return [_gap_ms(part.strip()) for part in text.split(",")]


def _common(
    parser: argparse.ArgumentParser, sizes: bool, samples: str, *, files: bool = True
) -> None:
    """The options benches share; `files`: it writes --out files and has a progress bar."""
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument(
        "--samples",
        type=_samples,
        metavar="N",
        help=f"{samples} instead of the default (fewer with --quick), after the usual "
        "warm-up. A few make a run that checks the bench end to end, not one to read "
        "figures from",
    )
    if files:
        parser.add_argument(
            "--out",
            type=Path,
            metavar="DIR",
            help="also write DIR/<bench>.json, DIR/<bench>.md and DIR/<bench>.png",
        )
        parser.add_argument(
            "-q", "--quiet", action="store_true", help="no progress bar and no 'wrote' lines"
        )
    if sizes:
        parser.add_argument(
            "--sizes",
            type=_sizes,
            metavar="LIST",
            help="entry sizes to measure, comma-separated, e.g. 64KiB,1MiB,16MiB",
        )


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    sub = bench.add_subparsers(dest="bench_command", required=True)
    store = sub.add_parser("store", help="region put/get against memcpy, allocator cost")
    _common(store, True, "timed samples per size and of each entry-table figure")
    fetch = sub.add_parser("fetch", help="fetch throughput against raw NIXL and memcpy")
    _common(
        fetch,
        True,
        "timed samples per size of each loop (single, batch, sporadic, 64 KiB latency)",
    )
    fetch.add_argument(
        "--mode",
        choices=("all", "back-to-back", "sporadic"),
        default="all",
        help="back-to-back (single, batch, 64 KiB latency), sporadic (a fresh entry and an "
        "idle gap before each fetch), or all (default)",
    )
    fetch.add_argument(
        "--gap-ms",
        type=_gap_ms,
        default=5.0,
        metavar="MS",
        help="sporadic mode: idle milliseconds between writing an entry and fetching it "
        "(default 5)",
    )
    fetch.add_argument(
        "--read-here",
        action="store_true",
        help="fetch with read_here=True: the direct READs made on the calling thread while "
        "the consumer's network thread is idle (see Consumer.fetch)",
    )
    fetch.add_argument(
        "--hand-off",
        action="store_true",
        help="wait for each fetch as an engine's scheduler does, never blocking on its "
        "future, so that the consumer's network thread makes every READ; by default the "
        "bench blocks on the results, which lends its thread to their direct reads",
    )
    fetch.add_argument(
        "--granted",
        action="store_true",
        help="direct reads off on both sides: every fetch asks for a grant, over the fetch "
        "lane (its round trip measured)",
    )
    pipeline = sub.add_parser("pipeline", help="exposed latency at the PD of push against pull")
    # It prints its table or JSON only: no files, no progress bar to quieten.
    _common(pipeline, True, "requests per size and mode", files=False)
    pipeline.add_argument(
        "--delay-ms",
        type=_delays_ms,
        default=[2.0],
        metavar="MS[,MS...]",
        help="the proxy hop plus the PD's preprocessing, simulated; several, comma-separated, "
        "are measured one after the other in one run (default 2)",
    )
    pipeline.add_argument(
        "--ucx-tls", default="", metavar="TLS", help="UCX transports (e.g. tcp; default: UCX's)"
    )
    proxy = sub.add_parser("proxy", help="the proxy's added latency over stub backends")
    _common(proxy, False, "requests per round at each concurrency (at least one per client)")
    proxy.add_argument(
        "--workers", type=int, default=1, help="proxy processes (`ecshare proxy --workers`)"
    )

    report = sub.add_parser(
        "report", help="Markdown and plot from saved result files, merged onto one plot"
    )
    report.add_argument("files", nargs="+", metavar="RESULT.json")
    report.add_argument("--out", type=Path, required=True, metavar="DIR")
    report.add_argument("--name", default="report", help="file name stem (default: report)")

    compare = sub.add_parser("compare", help="per-row change between two result files")
    compare.add_argument("before", metavar="BEFORE.json")
    compare.add_argument("after", metavar="AFTER.json")
    compare.add_argument(
        "--by",
        choices=("ecshare", "ratio"),
        default="ecshare",
        help="compare ecshare's figures, or ecshare against the baseline of the same run",
    )
    compare.add_argument(
        "--threshold",
        type=_percent,
        default=5.0,
        metavar="PCT",
        help="mark figures worse by more than PCT percent as regressions (default 5)",
    )
    compare.add_argument(
        "--fail-on-regression",
        type=_percent,
        metavar="PCT",
        help="exit 1 when a figure is worse by more than PCT percent",
    )

    sub.add_parser("schema", help="print the JSON Schema of bench result files")
    from ecshare.apps.bench.abuse import add_abuse_parser

    add_abuse_parser(sub)


def _emit(args: argparse.Namespace, result: Any, text: Callable[[Any], None]) -> int:
    """Print a bench's result and write its files (`report`, which imports every bench's
    result type: the benches themselves never import it)."""
    from ecshare.apps.bench.report import emit

    return emit(result, json_output=args.json, out_dir=args.out, quiet=args.quiet, text=text)


def run_bench(args: argparse.Namespace) -> int:
    command = args.bench_command
    if command == "store":
        from ecshare.apps.bench import store

        measured = store.measure_store(args.quick, args.sizes, args.quiet, samples=args.samples)
        return _emit(args, measured, store.print_table)
    if command == "fetch":
        from ecshare.apps.bench import fetch

        fetched = fetch.measure_fetch(
            args.quick,
            args.sizes,
            args.quiet,
            mode=args.mode,
            gap_s=args.gap_ms / 1000,
            samples=args.samples,
            read_here=args.read_here,
            hand_off=args.hand_off,
            granted=args.granted,
        )
        return _emit(args, fetched, fetch.print_table)
    if command == "pipeline":
        from ecshare.apps.bench.pipeline import run_pipeline_bench

        return run_pipeline_bench(
            args.json,
            args.quick,
            args.sizes,
            delay_ms=args.delay_ms,
            ucx_tls=args.ucx_tls,
            samples=args.samples,
        )
    if command == "proxy":
        from ecshare.apps.bench import proxy

        proxied = proxy.measure_proxy(args.quick, args.quiet, args.workers, samples=args.samples)
        return _emit(args, proxied, proxy.print_table)
    if command == "report":
        from ecshare.apps.bench.report import run_report

        return run_report(args.files, args.out, args.name)
    if command == "compare":
        from ecshare.apps.bench.compare import run_compare

        return run_compare(
            args.before,
            args.after,
            by=args.by,
            threshold_pct=args.threshold,
            fail_on_regression_pct=args.fail_on_regression,
        )
    if command == "abuse":
        from ecshare.apps.bench.abuse import run_abuse_bench

        return run_abuse_bench(args)
    if command == "schema":
        import msgspec

        from ecshare.apps.bench.report import json_schema

        sys.stdout.write(msgspec.json.format(msgspec.json.encode(json_schema())).decode() + "\n")
        return 0
    return 2
