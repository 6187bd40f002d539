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

from typing import Any

import numpy as np
from ab_sporadic import interleaved


def _rows(result: dict[str, Any]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["size_bytes"], r["mode"]): r for r in result["rows"] if r["mode"] != "sporadic"}


def main() -> None:
    args, runs = interleaved(__doc__, "back-to-back")
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
