"""Before and after in one run: back-to-back fetches (single and batch) of two trees.

The companion of `ab_sporadic.py` for ``ecshare bench fetch --mode back-to-back``:
each round runs the bench once per tree, in alternating order, each against its
own raw NIXL baseline measured in the same run; the report gives, per size, mode
and tree, the median over rounds of ecshare's and the raw READs' time and of the
ratio raw / ecshare (the bench's ``ratio_vs_raw_nixl``), and the after-minus-before
change of that ratio, median over rounds.

    UCX_NET_DEVICES=lo .venv/bin/python benchmarks/ab_batch.py HEAD~1 --rounds 4 \\
        -- --sizes 64KiB,1MiB,4MiB --quick

``--after REF`` compares two refs; arguments after ``--`` go to ``ecshare bench fetch``.
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
from ab_sporadic import ROOT, _export


def _run(tree: Path, extra: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree), "UCX_NET_DEVICES": "lo"}
    command = ["bench", "fetch", "--mode", "back-to-back", "--json", "--quiet", *extra]
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


def _rows(result: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["size_bytes"], r["mode"]): r for r in result["rows"] if r["mode"] != "sporadic"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("before", help="git ref of the tree to compare against")
    parser.add_argument("--after", help="git ref (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write every run's result here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    with tempfile.TemporaryDirectory(prefix="ecshare-ab-") as tmp:
        trees = {
            "before": _export(args.before, Path(tmp) / "before"),
            "after": _export(args.after, Path(tmp) / "after") if args.after else ROOT,
        }
        for i in range(args.rounds):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for name in order:
                runs[name].append(_run(trees[name], extra))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(runs))
    print(f"{args.rounds} rounds, medians over rounds (ms); after = "
          f"{args.after or 'working tree'}, before = {args.before}")  # fmt: skip
    head = ("size", "mode", "tree", "eco ms", "raw ms", "raw/eco")
    print(f"{head[0]:>9} {head[1]:>7} {head[2]:>7} " + " ".join(f"{h:>8}" for h in head[3:]))
    for key in sorted(_rows(runs["before"][0])):
        for name in ("before", "after"):
            rows = [_rows(r)[key] for r in runs[name]]
            eco = np.median([r["ecshare_ms"] for r in rows])
            raw = np.median([r["raw_nixl_ms"] for r in rows])
            ratio = np.median([r["ratio_vs_raw_nixl"] for r in rows])
            print(f"{key[0]:>9} {key[1]:>7} {name:>7} {eco:8.3f} {raw:8.3f} {ratio:7.2f}x")
        change = [
            _rows(a)[key]["ratio_vs_raw_nixl"] - _rows(b)[key]["ratio_vs_raw_nixl"]
            for a, b in zip(runs["after"], runs["before"], strict=True)
        ]
        print(f"{'':>9} {'':>7} {'change':>7} ratio after - before, median over rounds: "
              f"{np.median(change):+.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
