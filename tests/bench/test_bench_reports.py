"""`ecshare bench ... --out DIR` writes a result file, a Markdown table and a plot that hold.

Each bench runs for real, briefly (tiny sizes, --quick, a few --samples): the store bench
in this machine's memory, the fetch bench between a producer process and this one over
NIXL + CURVE, the proxy bench against stub backends through a real proxy process. Only the
files are checked, never the speed. The same runs show where the progress bar goes: the
store bench's stderr is a terminal, the proxy bench's a terminal with --quiet, the fetch
bench's a pipe. `compare` is checked on real result files, one of them with a planted
regression: once as a command of its own, then called in this process.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import msgspec
import pytest

from ecshare.apps.bench.fetch import FetchBenchResult
from ecshare.apps.bench.proxy import ProxyBenchResult
from ecshare.apps.bench.report import ReportError, decode_report, json_schema, read_report
from ecshare.apps.bench.schema import SCHEMA_VERSION
from ecshare.apps.bench.store import StoreBenchResult
from ecshare.apps.bench.synthetic import format_size
from ecshare.apps.cli import main

pytestmark = pytest.mark.cpu_bound

SIZES = (64 << 10, 256 << 10)
SIZES_ARG = "64KiB,256KiB"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MODES = ("single", "batch", "sporadic")
SAMPLES = 2  # timed samples of each figure: enough for every row, not for its figures
PROXY_REQUESTS = 16  # per round, and at least one per client: 64 at 64 clients
_TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return {**os.environ, "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")}


def _ecshare(*args: str, timeout: float = _TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ecshare", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def _in_terminal(*args: str) -> tuple[subprocess.CompletedProcess[str], bytes]:
    """`ecshare ARGS` with stdout on a pipe and stderr on a terminal; also what it showed."""
    leader, follower = pty.openpty()
    shown: list[bytes] = []

    def read() -> None:  # as it comes, so that a full terminal never blocks the bench
        try:
            while chunk := os.read(leader, 65536):
                shown.append(chunk)
        except OSError:  # EIO: every holder of the terminal's other end has closed it
            pass

    reader = threading.Thread(target=read, daemon=True)
    try:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ecshare", *args],
                stdout=subprocess.PIPE,
                stderr=follower,
                text=True,
                env=_env(),
            )
        finally:
            os.close(follower)  # the bench holds its own
        reader.start()
        try:
            stdout, _ = proc.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
        reader.join(timeout=30)
        assert not reader.is_alive(), "the bench's children still hold its terminal"
    finally:
        os.close(leader)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, ""), b"".join(shown)


class BenchRun(NamedTuple):
    dir: Path
    stderr: bytes  # what its stderr showed, a terminal or a pipe
    terminal: bool


def _run(out: Path, bench: str, *extra: str, quiet: bool, terminal: bool) -> BenchRun:
    args = ["bench", bench, "--quick", "--json", "--out", str(out), *extra]
    args += ["--quiet"] if quiet else []
    if terminal:
        proc, stderr = _in_terminal(*args)
    else:
        proc = _ecshare(*args)
        stderr = proc.stderr.encode()
    assert proc.returncode == 0, stderr[-4000:].decode(errors="replace")
    # stdout is the one JSON object, the same as the file; nothing else goes there,
    # bar or not.
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout[-2000:]
    path = out / f"{bench}.json"
    assert json.loads(lines[0]) == json.loads(path.read_text())
    return BenchRun(out, stderr, terminal)


@pytest.fixture(scope="module")
def store_run(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    out = tmp_path_factory.mktemp("store")
    samples = ("--samples", str(SAMPLES))
    return _run(out, "store", "--sizes", SIZES_ARG, *samples, quiet=False, terminal=True)


@pytest.fixture(scope="module")
def fetch_run(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    pytest.importorskip("nixl._api", reason="the fetch bench reads over NIXL")
    out = tmp_path_factory.mktemp("fetch")
    samples = ("--samples", str(SAMPLES))
    return _run(out, "fetch", "--sizes", SIZES_ARG, *samples, quiet=False, terminal=False)


@pytest.fixture(scope="module")
def proxy_run(tmp_path_factory: pytest.TempPathFactory) -> BenchRun:
    out = tmp_path_factory.mktemp("proxy")
    samples = ("--samples", str(PROXY_REQUESTS))
    return _run(out, "proxy", *samples, quiet=True, terminal=True)


@pytest.fixture(scope="module")
def store_dir(store_run: BenchRun) -> Path:
    return store_run.dir


@pytest.fixture(scope="module")
def fetch_dir(fetch_run: BenchRun) -> Path:
    return fetch_run.dir


@pytest.fixture(scope="module")
def proxy_dir(proxy_run: BenchRun) -> Path:
    return proxy_run.dir


def _table_rows(markdown: str) -> list[list[str]]:
    """Body rows of the Markdown table in `markdown`, as lists of cells."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    assert len(rows) >= 3, markdown
    assert set(rows[1].replace("|", "").split()) <= {"---:", "---"}, rows[1]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def _check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000, f"{path} is {len(data)} bytes: an empty figure?"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.image

    pixels = matplotlib.image.imread(path)
    height, width = pixels.shape[:2]
    assert height >= 300 and width >= 500
    assert pixels.std() > 0.05, "the plot is one flat colour"


def test_store_bench_files_hold_a_row_per_size(store_dir: Path) -> None:
    result = read_report(store_dir / "store.json")
    assert isinstance(result, StoreBenchResult)
    assert result.schema_version == SCHEMA_VERSION
    assert result.machine.cpus == os.cpu_count()
    assert result.parameters.sizes == list(SIZES) and result.parameters.quick
    assert result.parameters.samples == result.parameters.table_samples == SAMPLES
    assert [c.size_bytes for c in result.copies] == list(SIZES)
    for c in result.copies:
        assert c.put_gbps > 0 and c.memcpy_gbps > 0
        assert c.put_ratio == pytest.approx(c.put_gbps / c.memcpy_gbps)
    rows = _table_rows((store_dir / "store.md").read_text())
    assert [r[0] for r in rows] == [format_size(s) for s in SIZES]
    _check_png(store_dir / "store.png")


def test_fetch_bench_files_hold_ecshare_raw_nixl_and_memcpy_per_size(fetch_run: BenchRun) -> None:
    fetch_dir = fetch_run.dir
    result = read_report(fetch_dir / "fetch.json")
    assert isinstance(result, FetchBenchResult)
    assert result.parameters.sizes == list(SIZES)
    assert result.parameters.sporadic_sizes == list(SIZES)
    for counts in ("single_samples", "batch_samples", "sporadic_samples"):
        assert getattr(result.parameters, counts) == [SAMPLES] * len(SIZES), counts
    assert result.latency_64k_samples == SAMPLES
    assert {(r.size_bytes, r.mode) for r in result.rows} == {(s, m) for s in SIZES for m in MODES}
    for r in result.rows:
        assert min(r.ecshare_gbps, r.raw_nixl_gbps, r.memcpy_gbps) > 0
        assert r.samples == SAMPLES
    markdown = (fetch_dir / "fetch.md").read_text()
    rows = _table_rows(markdown.split("\n\nSporadic:")[0])
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (format_size(s), m) for s in SIZES for m in MODES
    )
    sporadic = _table_rows(markdown.split("\n\nSporadic:")[1])
    assert [r[0] for r in sporadic] == [format_size(s) for s in SIZES]
    assert "Producer network thread CPU" in markdown
    _check_png(fetch_dir / "fetch.png")
    # Its stderr was a pipe: no bar, and the "wrote" lines name the files.
    assert not fetch_run.terminal and b"fetch: " not in fetch_run.stderr, fetch_run.stderr
    wrote = [line for line in fetch_run.stderr.decode().splitlines() if line.startswith("wrote ")]
    assert wrote == [f"wrote {fetch_dir / ('fetch' + ext)}" for ext in (".json", ".md", ".png")]


def test_proxy_bench_files_hold_a_row_per_scenario(proxy_dir: Path) -> None:
    result = read_report(proxy_dir / "proxy.json")
    assert isinstance(result, ProxyBenchResult)
    per_round = {1: PROXY_REQUESTS, 64: 64}
    assert result.parameters.concurrencies == list(per_round)
    assert result.parameters.requests_per_round == list(per_round.values())
    for r in result.rows:
        assert r.requests == per_round[r.concurrency] * result.rounds, r
    rows = _table_rows((proxy_dir / "proxy.md").read_text())
    assert len(rows) == len(result.rows)
    assert {(r[0], r[1]) for r in rows} == {(r.scenario, str(r.concurrency)) for r in result.rows}
    _check_png(proxy_dir / "proxy.png")


def test_report_merges_results_onto_one_plot(
    store_dir: Path, fetch_dir: Path, tmp_path: Path
) -> None:
    proc = _ecshare(
        "bench", "report", str(store_dir / "store.json"), str(fetch_dir / "fetch.json"),
        "--out", str(tmp_path), "--name", "both",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "both.md"), str(tmp_path / "both.png")]
    markdown = (tmp_path / "both.md").read_text()
    assert "## ecshare bench store" in markdown and "## ecshare bench fetch" in markdown
    _check_png(tmp_path / "both.png")


def _planted(fetch_dir: Path, tmp_path: Path, factor: float) -> Path:
    """A copy of the fetch result whose 256 KiB single fetch ran at `factor` the speed."""
    data = json.loads((fetch_dir / "fetch.json").read_text())
    for row in data["rows"]:
        if (row["size_bytes"], row["mode"]) == (256 << 10, "single"):
            row["ecshare_gbps"] *= factor
            row["ratio_vs_raw_nixl"] *= factor
    path = tmp_path / f"after-{factor}.json"
    path.write_text(json.dumps(data))
    return path


def _compare(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`ecshare bench compare ARGS`, called in this process (the command runs as one of its
    own in test_compare_passes_identical_files)."""
    capsys.readouterr()
    code = main(["bench", "compare", *args])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["compare", *args], code, out, err)


def test_compare_passes_identical_files(fetch_dir: Path) -> None:
    before = str(fetch_dir / "fetch.json")
    proc = _ecshare("bench", "compare", before, before, "--fail-on-regression", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 regression(s)" in proc.stdout
    assert "REGRESSION" not in proc.stdout
    rows = _table_rows(proc.stdout)
    # every row, each sporadic one's p99 too, and the 64 KiB latency
    assert len(rows) == 4 * len(SIZES) + 1
    assert all(r[4] == "1.000x" for r in rows)


@pytest.mark.parametrize("by", ["ecshare", "ratio"])
def test_compare_flags_a_planted_regression(
    fetch_dir: Path, tmp_path: Path, by: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = str(fetch_dir / "fetch.json"), str(_planted(fetch_dir, tmp_path, 0.5))
    proc = _compare(capsys, before, after, "--by", by)
    assert proc.returncode == 0, proc.stderr  # flagged, but not asked to fail
    flagged = [r for r in _table_rows(proc.stdout) if "**REGRESSION**" in r[-1]]
    assert [(r[0], r[4], r[5]) for r in flagged] == [("256 KiB single", "0.500x", "-50.0% (worse)")]
    proc = _compare(capsys, before, after, "--by", by, "--fail-on-regression", "20")
    assert proc.returncode == 1
    assert "256 KiB single" in proc.stderr and "50.0% worse" in proc.stderr
    # A 10% slowdown fails a 5% gate and passes a 20% one.
    after = str(_planted(fetch_dir, tmp_path, 0.9))
    assert _compare(capsys, before, after, "--fail-on-regression", "5").returncode == 1
    assert _compare(capsys, before, after, "--fail-on-regression", "20").returncode == 0


def test_compare_counts_a_faster_run_as_no_regression(
    fetch_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before, after = str(fetch_dir / "fetch.json"), str(_planted(fetch_dir, tmp_path, 2.0))
    proc = _compare(capsys, before, after, "--fail-on-regression", "0")
    assert proc.returncode == 0, proc.stderr
    assert "+100.0% (better)" in proc.stdout


def test_compare_refuses_bad_files_with_a_clear_error(
    store_dir: Path, fetch_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fetch, store = str(fetch_dir / "fetch.json"), str(store_dir / "store.json")
    cases = {
        "mixed": (store, "cannot compare a store bench result with a fetch bench result"),
        "missing": (str(tmp_path / "nope.json"), "cannot read"),
    }
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    cases["garbage"] = (str(garbage), "not a bench result file")
    for name, (before, message) in cases.items():
        proc = _compare(capsys, before, fetch)  # an exception would fail the test here
        assert proc.returncode == 2, name
        assert message in proc.stderr, (name, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_decode_refuses_old_newer_and_malformed_results(fetch_dir: Path) -> None:
    data = json.loads((fetch_dir / "fetch.json").read_text())
    assert isinstance(decode_report(json.dumps(data).encode()), FetchBenchResult)
    with pytest.raises(ReportError, match="newer than this ecshare reads"):
        decode_report(json.dumps({**data, "schema_version": SCHEMA_VERSION + 1}).encode())
    legacy = {k: v for k, v in data.items() if k not in ("schema_version", "bench")}
    with pytest.raises(ReportError, match="no schema_version"):
        decode_report(json.dumps(legacy).encode())
    broken = {**data, "rows": [{**data["rows"][0], "ecshare_gbps": "fast"}]}
    with pytest.raises(ReportError, match=r"ecshare_gbps"):
        decode_report(json.dumps(broken).encode())


def test_schema_command_prints_the_json_schema_of_every_bench() -> None:
    proc = _ecshare("bench", "schema", timeout=60)
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert schema == msgspec.json.decode(msgspec.json.encode(json_schema()))
    names = set(schema["$defs"])
    assert {"StoreBenchResult", "FetchBenchResult", "ProxyBenchResult", "Machine"} <= names


def test_progress_bar_goes_to_a_terminal_stderr_only(
    store_run: BenchRun, proxy_run: BenchRun
) -> None:
    """On a terminal the bar shows on stderr; with --quiet there is none (nor piped: see
    the fetch bench's test).

    The bar's line is its label and the step, e.g. "store: 64 KiB entries"; the "wrote"
    lines name the files, and --quiet leaves them out too. Each run's stdout held the
    result alone (see `_run`).
    """
    assert store_run.terminal and b"store: " in store_run.stderr, store_run.stderr[-500:]
    assert b"wrote " in store_run.stderr
    assert proxy_run.terminal
    assert b"proxy: " not in proxy_run.stderr and b"wrote " not in proxy_run.stderr, (
        proxy_run.stderr[-500:]
    )
