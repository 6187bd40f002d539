"""Before and after in one run: sporadic fetches of two ecshare trees, interleaved.

On a shared 2-core machine the load of the moment moves every figure by more
than most changes do, so a change is judged against its parent in the same
minutes. Each round runs ``ecshare bench fetch --mode sporadic --json`` once for
each tree, in alternating order, each against its own raw NIXL READ baseline.
The report gives, per size and tree, the median over rounds of ecshare's p50,
the raw READ's p50, their difference (the fixed cost ecshare adds) and the
producer thread's CPU, and then the after-minus-before difference, median over
the rounds, of that added cost.

Run from a checkout, with a git ref as "before" (its tree is exported to a
temporary directory) and the working tree as "after":

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/ab_sporadic.py HEAD~1 --rounds 6

``--after REF`` compares two refs. Extra ``ecshare bench fetch`` arguments go
after ``--``, e.g. ``-- --gap-ms 20 --sizes 64KiB,4MiB``. Environment variables
(UCX_TLS=tcp, say) reach both trees.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# Each tree's bench results, in round order.
Runs = dict[str, list[dict[str, Any]]]


def _export(ref: str, into: Path) -> Path:
    """The tree of `ref`, as files under `into` (no checkout is touched)."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref], capture_output=True, check=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_bench(tree: Path, mode: str, extra: list[str]) -> dict[str, Any]:
    """One `ecshare bench fetch --mode MODE --json` of `tree`, its parsed result."""
    env = {**os.environ, "PYTHONPATH": str(tree), "UCX_NET_DEVICES": "lo"}
    env.update({k: v for k, v in os.environ.items() if k.startswith("UCX_")})
    command = ["bench", "fetch", "--mode", mode, "--json", "--quiet", *extra]
    proc = subprocess.run(
        [sys.executable, "-m", "ecshare", *command],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        timeout=1200,
    )
    if proc.returncode != 0:
        raise SystemExit(f"bench failed in {tree}:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def interleaved(description: str, mode: str) -> tuple[argparse.Namespace, Runs]:
    """Parse the command line (a ref to compare against, `--after`, `--rounds`, `--json`,
    the bench's own arguments after `--`) and run the bench in `mode` on both trees,
    in alternating order each round; each tree's results in round order."""
    parser = argparse.ArgumentParser(description=description.split("\n")[0])
    parser.add_argument("before", help="git ref of the tree to compare against")
    parser.add_argument("--after", help="git ref (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write every run's result here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]  # the rest goes to `ecshare bench fetch`
    runs: Runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ecshare-ab-") as tmp:
        trees = {
            "before": _export(args.before, Path(tmp) / "before"),
            "after": _export(args.after, Path(tmp) / "after") if args.after else ROOT,
        }
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                runs[name].append(run_bench(trees[name], mode, extra))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(runs))
    return args, runs


def _rows(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {r["size_bytes"]: r for r in result["rows"] if r["mode"] == "sporadic"}


def main() -> None:
    args, runs = interleaved(__doc__, "sporadic")
    sizes = sorted(_rows(runs["before"][0]))
    print(f"{args.rounds} rounds, medians over rounds (ms); after = "
          f"{args.after or 'working tree'}, before = {args.before}")  # fmt: skip
    head = ("size", "tree", "eco p50", "eco p99", "raw p50", "eco-raw", "eco/raw")
    print(f"{head[0]:>9} {head[1]:>7} " + " ".join(f"{h:>8}" for h in head[2:]))
    for size in sizes:
        for name in ("before", "after"):
            rows = [_rows(r)[size] for r in runs[name]]
            eco = np.median([r["ecshare_p50_ms"] for r in rows])
            p99 = np.median([r["ecshare_p99_ms"] for r in rows])
            raw = np.median([r["raw_nixl_p50_ms"] for r in rows])
            excess = np.median([r["ecshare_p50_ms"] - r["raw_nixl_p50_ms"] for r in rows])
            print(
                f"{size:>9} {name:>7} {eco:8.3f} {p99:8.3f} {raw:8.3f} {excess:8.3f} "
                f"{raw / eco:7.2f}x"
            )
        paired = [
            (_rows(a)[size]["ecshare_p50_ms"] - _rows(a)[size]["raw_nixl_p50_ms"])
            - (_rows(b)[size]["ecshare_p50_ms"] - _rows(b)[size]["raw_nixl_p50_ms"])
            for a, b in zip(runs["after"], runs["before"], strict=True)
        ]
        print(f"{'':>9} {'change':>7} added cost after - before, median over rounds: "
              f"{np.median(paired):+.3f} ms")  # fmt: skip
    for name in ("before", "after"):
        cpu = [r["producer_cpu"] for r in runs[name] if r.get("producer_cpu")]
        if cpu:
            share = np.median([c["sporadic_share"] for c in cpu])
            held = np.median([c["held_grant_share"] for c in cpu])
            per = np.median([c["sporadic_us_per_fetch"] for c in cpu])
            print(f"producer thread CPU, {name}: {share:.2%} of a core under sporadic "
                  f"fetches ({per:.0f} us per fetch), {held:.2%} with a grant held")  # fmt: skip
    for size in sizes:
        for name in ("before", "after"):
            steps: dict[str, list[float]] = {}
            for r in runs[name]:
                for k, v in _rows(r)[size]["ecshare_phases_ms"].items():
                    steps.setdefault(k, []).append(v)
            line = ", ".join(f"{k} {np.median(v):.3f}" for k, v in steps.items())
            print(f"{name} steps at {size} bytes (median ms): {line}")


if __name__ == "__main__":
    main()
