"""Bench result files: decode them strictly, and write a run's JSON, Markdown and plot.

A run with ``--out DIR`` writes ``DIR/<bench>.json`` (the result, see
`ecshare.apps.bench.schema`), ``DIR/<bench>.md`` (a Markdown table, a row per size) and
``DIR/<bench>.png`` (`ecshare.apps.bench.plot`). ``ecshare bench report FILE... --out DIR``
renders the same from saved results, merging several onto one plot.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from ecshare.apps.bench.fetch import FetchBenchResult
from ecshare.apps.bench.proxy import ProxyBenchResult
from ecshare.apps.bench.schema import SCHEMA_VERSION, Machine
from ecshare.apps.bench.store import StoreBenchResult
from ecshare.apps.bench.synthetic import format_size

__all__ = [
    "BenchResult",
    "ReportError",
    "decode_report",
    "emit",
    "json_schema",
    "read_report",
    "render_markdown",
    "run_report",
    "write_outputs",
]

BenchResult = StoreBenchResult | FetchBenchResult | ProxyBenchResult
R = TypeVar("R", StoreBenchResult, FetchBenchResult, ProxyBenchResult)


class ReportError(ValueError):
    """A result file that cannot be read: names the file and what is wrong."""


class _Version(msgspec.Struct):
    schema_version: int = 0


def decode_report(data: bytes, source: str = "<input>") -> BenchResult:
    """One result, any bench; a clear `ReportError` for anything else."""
    try:
        version = msgspec.json.decode(data, type=_Version).schema_version
    except msgspec.DecodeError as exc:
        raise ReportError(f"{source}: not a bench result file: {exc}") from None
    if version == 0:
        raise ReportError(
            f"{source}: no schema_version: written before bench results had a schema; "
            "run the bench again"
        )
    if version > SCHEMA_VERSION:
        raise ReportError(
            f"{source}: schema version {version} is newer than this ecshare reads "
            f"({SCHEMA_VERSION}); upgrade ecshare"
        )
    try:
        return msgspec.json.decode(data, type=BenchResult)
    except msgspec.ValidationError as exc:
        raise ReportError(f"{source}: invalid bench result: {exc}") from None


def read_report(path: Path) -> BenchResult:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ReportError(f"{path}: cannot read: {exc.strerror}") from None
    return decode_report(data, str(path))


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a result file, generated from the structs."""
    return msgspec.json.schema(BenchResult)


def bench_name(result: BenchResult) -> str:
    return type(result).__struct_config__.tag  # type: ignore[return-value]


# -- Markdown ----------------------------------------------------------------------------


def _table(heads: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(heads) + " |", "|" + "|".join(" ---: " for _ in heads) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _machine_line(m: Machine, created_at: str) -> str:
    load = m.load_average_1m
    return (
        f"{created_at} on `{m.hostname}`: {m.cpu_model}, {m.cpus} CPUs, "
        f"{m.memory_bytes / (1 << 30):.0f} GiB; Python {m.python}, NIXL {m.nixl}, "
        f"ecshare {m.ecshare} ({m.git_commit}); 1-minute load {load[0]} -> {load[1]}"
    )


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _fetch_markdown(r: FetchBenchResult) -> list[str]:
    rows = [
        [
            format_size(row.size_bytes),
            row.mode,
            str(row.items),
            f"{row.ecshare_gbps:.2f}",
            f"{row.raw_nixl_gbps:.2f}",
            f"{row.memcpy_gbps:.2f}",
            _x(row.ratio_vs_raw_nixl),
            _x(row.ecshare_gbps / row.memcpy_gbps),
            f"{row.ecshare_ms:.3f}",
            f"{row.raw_nixl_ms:.3f}",
        ]
        for row in r.rows
    ]
    heads = ["size", "mode", "items", "ecshare GB/s", "raw NIXL GB/s", "memcpy GB/s"]
    heads += ["ecshare / raw NIXL", "ecshare / memcpy", "ecshare ms", "raw NIXL ms"]
    lines = ["Fetch from a producer process over NIXL + CURVE, medians after warm-up.", ""]
    lines += _table(heads, rows)
    if r.latency_64k_p50_ms is not None:
        lines += [
            "",
            f"64 KiB fetch latency over {r.latency_64k_samples} sequential fetches: "
            f"p50 {_ms(r.latency_64k_p50_ms)} ms, p99 {_ms(r.latency_64k_p99_ms)} ms "
            f"(raw NIXL read p50 {_ms(r.raw_nixl_64k_p50_ms)} ms).",
        ]
    sporadic = [row for row in r.rows if row.mode == "sporadic"]
    if sporadic:
        lines += [
            "",
            f"Sporadic: per sample a fresh entry, {sporadic[0].gap_ms:g} ms idle, then one "
            "fetch (and one raw NIXL READ of the same extents after the same pattern).",
            "",
        ]
        lines += _table(
            ["size", "samples", "ecshare p50 ms", "ecshare p99 ms", "raw NIXL p50 ms",
             "ecshare - raw ms", "raw / ecshare"],
            [
                [
                    format_size(row.size_bytes),
                    str(row.samples),
                    _ms(row.ecshare_p50_ms),
                    _ms(row.ecshare_p99_ms),
                    _ms(row.raw_nixl_p50_ms),
                    _ms((row.ecshare_p50_ms or 0.0) - (row.raw_nixl_p50_ms or 0.0)),
                    _x(row.ratio_vs_raw_nixl),
                ]
                for row in sporadic
            ],
        )  # fmt: skip
        for row in sporadic:
            steps = ", ".join(f"{k} {v:.3f}" for k, v in (row.ecshare_phases_ms or {}).items())
            lines += ["", f"{format_size(row.size_bytes)} fetch, median ms per step: {steps}."]
    if r.producer_cpu is not None:
        cpu = r.producer_cpu
        held = "-" if cpu.held_grant_share is None else f"{cpu.held_grant_share:.2%}"
        lines += [
            "",
            f"Producer network thread CPU: {cpu.sporadic_share:.2%} of a core under the "
            f"sporadic fetches ({cpu.sporadic_us_per_fetch:.0f} us per fetch), {held} while "
            "a grant is held and nothing moves.",
        ]
    lines += ["", f"Targets: {'met' if r.meets_targets else 'MISSED'}."]
    return lines


def _store_markdown(r: StoreBenchResult) -> list[str]:
    rows = [
        [
            format_size(c.size_bytes),
            f"{c.put_gbps:.2f}",
            f"{c.get_gbps:.2f}",
            f"{c.memcpy_gbps:.2f}",
            _x(c.put_ratio),
            _x(c.get_ratio),
        ]
        for c in r.copies
    ]
    heads = ("size", "put GB/s", "get GB/s", "memcpy GB/s", "put / memcpy", "get / memcpy")
    t = r.table
    return [
        f"Region put/get against memcpy, {r.samples} samples, block {format_size(r.block_size)}.",
        "",
        *_table(heads, rows),
        "",
        f"Entry table with {t.live_entries} live entries: allocate + commit + free "
        f"{t.alloc_commit_free_us:.2f} us, pin + unpin {t.pin_unpin_us:.2f} us.",
        "",
        f"Targets: {'met' if r.meets_targets else 'MISSED'}.",
    ]


def _proxy_markdown(r: ProxyBenchResult) -> list[str]:
    rows = [
        [
            row.scenario,
            str(row.concurrency),
            row.mode,
            "-" if row.offered_rps is None else f"{row.offered_rps:.0f}",
            str(row.requests),
            _ms(row.direct.p50_ms),
            _ms(row.proxy.p50_ms),
            _ms(row.overhead_p50_ms),
            _ms(row.direct.p99_ms),
            _ms(row.proxy.p99_ms),
            _ms(row.overhead_p99_ms),
            f"{row.direct.rps:.0f}",
            f"{row.proxy.rps:.0f}",
        ]
        for row in r.rows
    ]
    heads = ["scenario", "clients", "mode", "offered rps", "requests", "direct p50 ms"]
    heads += ["proxy p50 ms", "overhead p50 ms", "direct p99 ms", "proxy p99 ms"]
    heads += ["overhead p99 ms", "direct rps", "proxy rps"]
    return [
        f"The proxy in front of instant stub backends against the stubs directly, "
        f"{r.rounds} rounds, {r.loop}.",
        "",
        *_table(heads, rows),
        "",
        f"Target (text, {r.target_concurrency} clients, p50 overhead <= "
        f"{r.target_p50_overhead_ms} ms): {'met' if r.meets_target else 'MISSED'}.",
    ]


def render_markdown(result: BenchResult) -> str:
    body: list[str]
    if isinstance(result, FetchBenchResult):
        body = _fetch_markdown(result)
    elif isinstance(result, StoreBenchResult):
        body = _store_markdown(result)
    else:
        body = _proxy_markdown(result)
    head = [
        f"## ecshare bench {bench_name(result)}",
        "",
        _machine_line(result.machine, result.created_at),
        "",
    ]
    return "\n".join(head + body) + "\n"


# -- writing a run's files ---------------------------------------------------------------


def write_outputs(result: BenchResult, out_dir: Path) -> list[Path]:
    """Write ``<bench>.json``, ``.md`` and ``.png`` into `out_dir`; returns the paths."""
    from ecshare.apps.bench.plot import plot_reports  # matplotlib loads only when plotting

    out_dir.mkdir(parents=True, exist_ok=True)
    name = bench_name(result)
    json_path = out_dir / f"{name}.json"
    json_path.write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    md_path = out_dir / f"{name}.md"
    md_path.write_text(render_markdown(result), encoding="utf-8")
    return [json_path, md_path, *plot_reports([(name, result)], out_dir / f"{name}.png")]


def emit(
    result: R,
    *,
    json_output: bool,
    out_dir: Path | None,
    quiet: bool,
    text: Callable[[R], None],
) -> int:
    """Print `result` (one JSON line, or the bench's table) and write its files."""
    if json_output:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        text(result)
    sys.stdout.flush()
    if out_dir is None:
        return 0
    try:
        written = write_outputs(result, out_dir)
    except (OSError, ImportError) as exc:
        print(f"ecshare bench: cannot write the report files: {exc}", file=sys.stderr)
        return 2
    if not quiet:
        for path in written:
            print(f"wrote {path}", file=sys.stderr)
    return 0


def run_report(paths: Sequence[str], out_dir: Path, name: str = "report") -> int:
    """``ecshare bench report``: one Markdown file and plot(s) from saved results."""
    from ecshare.apps.bench.plot import plot_reports

    try:
        results = [(Path(p).stem, read_report(Path(p))) for p in paths]
    except ReportError as exc:
        print(f"ecshare bench report: {exc}", file=sys.stderr)
        return 2
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        md_path = out_dir / f"{name}.md"
        md_path.write_text(
            "\n".join(f"<!-- {stem} -->\n{render_markdown(r)}" for stem, r in results),
            encoding="utf-8",
        )
        written = [md_path, *plot_reports(results, out_dir / f"{name}.png")]
    except (OSError, ImportError) as exc:
        print(f"ecshare bench report: cannot write the report files: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0
