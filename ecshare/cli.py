"""The `ecshare` command."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ecshare", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="measure ecshare against baselines")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    store = bench_sub.add_parser("store", help="region put/get and allocator cost")
    store.add_argument("--json", action="store_true", help="print one JSON object")
    store.add_argument("--quick", action="store_true", help="fewer repetitions")

    sub.add_parser("demo", help="run the demo")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench_command == "store":
        from ecshare.bench.store import run_store_bench

        return run_store_bench(json_output=args.json, quick=args.quick)
    if args.command == "demo":
        from ecshare.demo import run_demo

        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
