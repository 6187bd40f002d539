"""PNG plots of bench results (matplotlib, Agg backend: no display needed).

Throughput against entry size (log-x), one panel per way of moving items: ecshare's
fetch beside a raw NIXL READ of the same bytes and memcpy, and the store's put and get
where a store result is given. The proxy's latencies, direct and through the proxy, go
to a figure of their own.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ecshare.apps.bench.synthetic import format_size

if TYPE_CHECKING:
    from ecshare.apps.bench.fetch import FetchBenchResult
    from ecshare.apps.bench.proxy import ProxyBenchResult
    from ecshare.apps.bench.store import StoreBenchResult

    BenchResult = StoreBenchResult | FetchBenchResult | ProxyBenchResult

__all__ = ["plot_reports"]

# One colour per series, whatever the file; the line style tells files apart.
_COLOURS = {
    "ecshare fetch": "tab:blue",
    "raw NIXL": "tab:orange",
    "memcpy": "tab:gray",
    "store put": "tab:green",
    "store get": "tab:purple",
}
_STYLES = ("-", "--", ":", "-.")
_MODES = {
    "single": "one item at a time",
    "batch": "a batch of items at a time",
    "sporadic": "a fresh item after an idle gap (p50)",
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ImportError("the plot needs matplotlib: pip install 'ecshare[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reports(named: Sequence[tuple[str, BenchResult]], path: Path) -> list[Path]:
    """Plot `named` results (name, result); returns the PNGs written.

    Fetch and store results go to `path`; proxy results too when there are no others,
    else to ``<path stem>-proxy.png``.
    """
    from ecshare.apps.bench.proxy import ProxyBenchResult

    throughput = [(n, r) for n, r in named if not isinstance(r, ProxyBenchResult)]
    proxy = [(n, r) for n, r in named if isinstance(r, ProxyBenchResult)]
    written = []
    if throughput:
        _plot_throughput(throughput, path)
        written.append(path)
    if proxy:
        proxy_path = path if not throughput else path.with_name(f"{path.stem}-proxy.png")
        _plot_proxy(proxy, proxy_path)
        written.append(proxy_path)
    return written


def _series(result: BenchResult) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{panel mode: {series name: [(size, GB/s)]}} of one fetch or store result."""
    from ecshare.apps.bench.fetch import FetchBenchResult
    from ecshare.apps.bench.store import StoreBenchResult

    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    if isinstance(result, FetchBenchResult):
        for row in result.rows:
            panel = out.setdefault(row.mode, {})
            panel.setdefault("ecshare fetch", []).append((row.size_bytes, row.ecshare_gbps))
            panel.setdefault("raw NIXL", []).append((row.size_bytes, row.raw_nixl_gbps))
            panel.setdefault("memcpy", []).append((row.size_bytes, row.memcpy_gbps))
    elif isinstance(result, StoreBenchResult):
        panel = out.setdefault("single", {})
        for c in result.copies:
            panel.setdefault("store put", []).append((c.size_bytes, c.put_gbps))
            panel.setdefault("store get", []).append((c.size_bytes, c.get_gbps))
            panel.setdefault("memcpy", []).append((c.size_bytes, c.memcpy_gbps))
    return out


def _plot_throughput(named: Sequence[tuple[str, BenchResult]], path: Path) -> None:
    plt = _pyplot()
    per_result = [(name, _series(r)) for name, r in named]
    modes = [m for m in _MODES if any(m in series for _, series in per_result)]
    fig, axes = plt.subplots(
        1, len(modes), figsize=(6.4 * len(modes), 4.8), squeeze=False, sharey=True
    )
    sizes: set[int] = set()
    for ax, mode in zip(axes[0], modes, strict=True):
        for i, (name, series) in enumerate(per_result):
            for label, points in series.get(mode, {}).items():
                points.sort()
                xs = [p[0] for p in points]
                sizes.update(xs)
                shown = label if len(per_result) == 1 else f"{label} ({name})"
                ax.plot(
                    xs,
                    [p[1] for p in points],
                    _STYLES[i % len(_STYLES)],
                    marker="o",
                    color=_COLOURS.get(label),
                    label=shown,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(_MODES[mode])
        ax.set_xlabel("entry size")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    ticks = sorted(sizes)
    for ax in axes[0]:
        ax.set_xticks(ticks, [format_size(s) for s in ticks], rotation=30)
        ax.minorticks_off()
    axes[0][0].set_ylabel("throughput (GB/s)")
    fig.suptitle(_title(named))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_proxy(named: Sequence[tuple[str, BenchResult]], path: Path) -> None:
    from ecshare.apps.bench.proxy import ProxyBenchResult

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12.8, 4.8), squeeze=False)
    for ax, quantile in zip(axes[0], ("p50", "p99"), strict=True):
        labels: list[str] = []
        bars: dict[str, list[float]] = {}
        for name, r in named:
            assert isinstance(r, ProxyBenchResult)
            suffix = "" if len(named) == 1 else f" ({name})"
            for row in r.rows:
                labels.append(f"{row.scenario}, {row.mode}\n{row.concurrency} clients{suffix}")
                for side in ("direct", "proxy"):
                    latency = getattr(row, side)
                    bars.setdefault(side, []).append(getattr(latency, f"{quantile}_ms"))
        width = 0.4
        xs = range(len(labels))
        for j, (side, values) in enumerate(bars.items()):
            ax.bar([x + (j - 0.5) * width for x in xs], values, width, label=side)
        ax.set_xticks(list(xs), labels, fontsize="small")
        ax.set_yscale("log")
        ax.set_ylabel(f"{quantile} latency (ms)")
        ax.set_title(f"{quantile} latency, stub backends directly and through the proxy")
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(_title(named))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _title(named: Sequence[tuple[str, BenchResult]]) -> str:
    machines = {(r.machine.hostname, r.machine.cpus, r.machine.git_commit) for _, r in named}
    if len(machines) == 1:
        host, cpus, commit = machines.pop()
        return f"ecshare bench on {host} ({cpus} CPUs), ecshare {commit}"
    return "ecshare bench: " + ", ".join(name for name, _ in named)
