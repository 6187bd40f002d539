"""``ecshare bench proxy``: the latency and throughput the EPD proxy adds over its backends.

Three processes on 127.0.0.1: stub backends that answer instantly with prepared bytes
(`ecshare.apps.bench.instant`, one encoder and one prefill/decode instance), a real
``ecshare proxy`` in front of them (``--workers N`` processes), and this process, the load.

Per scenario and concurrency the same load goes to the stub prefill/decode instance
directly (the baseline) and through the proxy, in alternating rounds so that background
load hits both alike. The overhead is proxy minus direct, at p50 and at p99.

Scenarios: ``text`` is a chat request without media (the proxy passes the bytes on);
``image`` has one image, so the proxy also makes an encoder call and re-encodes the
request with its `ec_transfer_params`: its overhead includes a whole extra round trip,
which the direct baseline does not make.

Two kinds of load, in separate rows:

* ``closed``: each client sends its next request as soon as it has read its answer. This
  measures throughput: the load is whatever the slowest process can take, and latency at
  64 clients is mostly queueing, about 64 divided by that throughput. On a machine with
  fewer cores than processes, the load generator, the proxy and the stub share cores, and
  the overhead at 64 is the proxy's CPU cost per request times the queue.
* ``paced``: the same 64 clients, with request i due at i / rate, the rate being
  `PACED_LOAD` of what the proxy carried closed-loop in the same run; a request's latency
  counts from when it was due, so requests held up by busy clients count as late. This
  measures what the proxy adds to a request at 64 concurrent clients under a load it can
  carry, and the target (p50 overhead <= 2 ms at 64 clients) is judged on its ``text`` row.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import msgspec
import numpy as np

from ecshare.apps.bench.progress import BenchProgress
from ecshare.apps.bench.schema import ReportHeader, machine_info, utc_now
from ecshare.apps.proxy.server import use_uvloop
from ecshare.apps.ready import AnyReady, ProxyReady, StubsReady, parse_ready

__all__ = ["measure_proxy", "print_table"]

TARGET_P50_OVERHEAD_MS = 2.0
TARGET_CONCURRENCY = 64
CONCURRENCIES = (1, 64)
# The paced row offers this share of the proxy's closed-loop throughput, at 64 clients.
PACED_LOAD = 0.5
ROUNDS = 4

_TEXT = {
    "model": "stub-model",
    "messages": [{"role": "user", "content": "Say something short."}],
    "max_tokens": 8,
}
_IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1024}}
_IMAGE = {
    "model": "stub-model",
    "messages": [{"role": "user", "content": [_IMAGE_PART, {"type": "text", "text": "What?"}]}],
    "max_tokens": 8,
}
SCENARIOS = {"text": _TEXT, "image": _IMAGE}


class Latency(msgspec.Struct):
    p50_ms: float
    p99_ms: float
    rps: float


class Row(msgspec.Struct):
    scenario: str
    concurrency: int
    # "closed": each client sends again as soon as it has its answer, so the load is as
    # much as the slowest process can take; "paced": requests due at `offered_rps`.
    mode: str
    offered_rps: float | None
    requests: int
    direct: Latency
    proxy: Latency
    overhead_p50_ms: float
    overhead_p99_ms: float
    # CPU time (user + system) per request: of the stub when sent directly, and of the
    # proxy processes alone when sent through them. Less sensitive to a busy machine than
    # latency. None where /proc cannot be read.
    stub_cpu_us: float | None
    proxy_cpu_us: float | None


class ProxyParameters(msgspec.Struct):
    concurrencies: list[int]
    requests_per_round: list[int]  # per concurrency
    rounds: int
    quick: bool
    workers: int  # proxy processes (`ecshare proxy --workers`)
    paced_load: float  # share of the closed-loop proxy throughput the paced row offers


class ProxyBenchResult(ReportHeader, tag_field="bench", tag="proxy"):
    parameters: ProxyParameters
    cpus: int
    load_average: tuple[float, float]  # 1-minute load at the start and at the end
    python: str
    loop: str
    rounds: int
    target_p50_overhead_ms: float
    target_concurrency: int
    rows: list[Row]
    meets_target: bool


def measure_proxy(
    quick: bool = False,
    quiet: bool = False,
    workers: int = 1,
    samples: int | None = None,
) -> ProxyBenchResult:
    """Run the bench (the caller prints it: `ecshare.apps.bench.report.emit`).

    `samples`, when given, is the requests per round at each concurrency (at least one
    per client) instead of 500 and 5000 (with `quick` 100 and 640)."""
    per_round = {1: 100, 64: 640} if quick else {1: 500, 64: 5000}
    if samples is not None:
        per_round = {c: max(c, samples) for c in CONCURRENCIES}
    rounds = 2 if quick else ROUNDS
    load_before = os.getloadavg()[0]
    # One step per load run: a warm-up per URL, then a direct and a proxied run per round.
    steps = len(SCENARIOS) * (len(CONCURRENCIES) + 1) * 2 * (1 + rounds)
    with _servers(workers) as servers, BenchProgress(steps, "proxy", quiet=quiet) as bar:
        loop_name = use_uvloop()
        rows = asyncio.run(_measure_all(servers, per_round, rounds, bar))
    judged = next(
        r
        for r in rows
        if (r.scenario, r.concurrency, r.mode) == ("text", TARGET_CONCURRENCY, "paced")
    )
    result = ProxyBenchResult(
        created_at=utc_now(),
        machine=machine_info(round(load_before, 2)),
        parameters=ProxyParameters(
            concurrencies=list(CONCURRENCIES),
            requests_per_round=[per_round[c] for c in CONCURRENCIES],
            rounds=rounds,
            quick=quick,
            workers=workers,
            paced_load=PACED_LOAD,
        ),
        cpus=os.cpu_count() or 0,
        load_average=(round(load_before, 2), round(os.getloadavg()[0], 2)),
        python=platform.python_version(),
        loop=loop_name,
        rounds=rounds,
        target_p50_overhead_ms=TARGET_P50_OVERHEAD_MS,
        target_concurrency=TARGET_CONCURRENCY,
        rows=rows,
        meets_target=judged.overhead_p50_ms <= TARGET_P50_OVERHEAD_MS,
    )
    return result


@dataclass(frozen=True)
class _Servers:
    stub_url: str  # the prefill/decode stub
    stub_pids: tuple[int, ...]
    proxy_url: str
    proxy_pids: tuple[int, ...]  # the workers


@contextlib.contextmanager
def _servers(workers: int) -> Iterator[_Servers]:
    """Start the stub backends and a proxy in front of them, each its own process."""
    procs: list[subprocess.Popen[str]] = []
    try:
        roles = ["--role", "prefill_decode", "--role", "encoder"]
        stubs = _spawn(["-m", "ecshare.apps.bench.instant", *roles], procs)
        stub_urls = _ready(stubs, StubsReady).urls
        proxy_args = ["-m", "ecshare", "proxy", "--port", "0", "--workers", str(workers)]
        proxy_args += ["--pd", stub_urls["prefill_decode"], "--encoder", stub_urls["encoder"]]
        proxy = _spawn(proxy_args, procs)
        ready = _ready(proxy, ProxyReady)
        yield _Servers(stub_urls["prefill_decode"], (stubs.pid,), ready.url, ready.pids)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _spawn(args: list[str], procs: list[subprocess.Popen[str]]) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True)
    procs.append(proc)
    return proc


def _ready(proc: subprocess.Popen[str], kind: type[AnyReady]) -> AnyReady:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    ready = parse_ready(line, kind)
    if ready is None:
        raise RuntimeError(f"proxy bench: a server did not start (exit {proc.poll()}): {line!r}")
    return ready


async def _measure_all(
    servers: _Servers, per_round: dict[int, int], rounds: int, bar: BenchProgress
) -> list[Row]:
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for scenario, body in SCENARIOS.items():
            payload = msgspec.json.encode(body)
            for concurrency in CONCURRENCIES:
                bar.advance(0, step=f"{scenario}, {concurrency} clients")
                run = _Run(session, servers, scenario, payload, concurrency, per_round[concurrency])
                rows.append(await run.row(rounds, bar))
            # The same clients, paced: a fixed share of what the proxy managed closed-loop.
            saturated = rows[-1].proxy.rps
            bar.advance(0, step=f"{scenario}, {TARGET_CONCURRENCY} clients paced")
            n = per_round[TARGET_CONCURRENCY]
            run = _Run(session, servers, scenario, payload, TARGET_CONCURRENCY, n)
            rows.append(await run.row(rounds, bar, rate=round(PACED_LOAD * saturated, 1)))
    return rows


@dataclass
class _Run:
    """One row's measurement: alternating direct and proxied rounds of the same load."""

    session: aiohttp.ClientSession
    servers: _Servers
    scenario: str
    payload: bytes
    concurrency: int
    requests: int

    async def row(self, rounds: int, bar: BenchProgress, rate: float | None = None) -> Row:
        servers = self.servers
        direct: list[float] = []
        proxied: list[float] = []
        direct_s = proxied_s = stub_cpu = proxy_cpu = 0.0
        for url in (servers.stub_url, servers.proxy_url):  # warm connections and caches
            await self._load(url, self.requests // 4, rate)
            bar.advance()
        for _ in range(rounds):
            cpu = _cpu_seconds(servers.stub_pids)
            times, seconds = await self._load(servers.stub_url, self.requests, rate)
            stub_cpu += _cpu_seconds(servers.stub_pids) - cpu
            direct += times
            direct_s += seconds
            bar.advance()
            cpu = _cpu_seconds(servers.proxy_pids)
            times, seconds = await self._load(servers.proxy_url, self.requests, rate)
            proxy_cpu += _cpu_seconds(servers.proxy_pids) - cpu
            proxied += times
            proxied_s += seconds
            bar.advance()
        d, p = _latency(direct, direct_s), _latency(proxied, proxied_s)
        return Row(
            scenario=self.scenario,
            concurrency=self.concurrency,
            mode="closed" if rate is None else "paced",
            offered_rps=rate,
            requests=len(direct),
            direct=d,
            proxy=p,
            overhead_p50_ms=round(p.p50_ms - d.p50_ms, 3),
            overhead_p99_ms=round(p.p99_ms - d.p99_ms, 3),
            stub_cpu_us=_per_request_us(stub_cpu, len(direct)),
            proxy_cpu_us=_per_request_us(proxy_cpu, len(proxied)),
        )

    async def _load(
        self, base_url: str, total: int, rate: float | None
    ) -> tuple[list[float], float]:
        """Send `total` requests from the clients; their latencies and the wall time.

        Closed loop (`rate` None): each client sends its next request when the last answer
        is read. Paced: request i is due at `i / rate` seconds from the start; a client
        takes the next due request, waits for its time, and its latency counts from that
        time, so a request delayed by busy clients is counted as late, not left out.
        """
        url = base_url + "/v1/chat/completions"
        headers = {"Content-Type": "application/json"}
        latencies: list[float] = []
        due = iter(range(total))
        started = time.perf_counter()

        async def client() -> None:
            for i in due:
                t0 = time.perf_counter()
                if rate is not None:
                    t0 = started + i / rate
                    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
                async with self.session.post(url, data=self.payload, headers=headers) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"proxy bench: {url} answered {resp.status}")
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(client() for _ in range(self.concurrency)))
        return latencies, time.perf_counter() - started


def _cpu_seconds(pids: tuple[int, ...]) -> float:
    """User + system CPU seconds of processes `pids` so far (NaN where /proc is unreadable)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return math.nan
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _per_request_us(seconds: float, requests: int) -> float | None:
    return None if math.isnan(seconds) else round(seconds / requests * 1e6, 1)


def _latency(samples: list[float], seconds: float) -> Latency:
    ms = np.asarray(samples) * 1000
    return Latency(
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        rps=round(len(samples) / seconds, 1),
    )


def print_table(result: ProxyBenchResult) -> None:
    print(
        f"ecshare proxy overhead over instant stub backends ({result.cpus} CPUs, load "
        f"{result.load_average[0]} -> {result.load_average[1]}, Python {result.python}, "
        f"{result.loop}, {result.rounds} rounds, {result.parameters.workers} proxy workers)"
    )
    print(
        f"{'scenario':<8} {'clients':>7} {'mode':>12} {'requests':>8}  {'direct p50/p99 ms':>18} "
        f"{'proxy p50/p99 ms':>18}  {'overhead p50/p99 ms':>20}  {'direct rps':>10} "
        f"{'proxy rps':>10}  {'CPU us/req: stub':>16} {'proxy':>6}"
    )
    for r in result.rows:
        print(
            f"{r.scenario:<8} {r.concurrency:>7} {_mode(r):>12} {r.requests:>8}  "
            f"{r.direct.p50_ms:>8.3f} / {r.direct.p99_ms:<7.3f} "
            f"{r.proxy.p50_ms:>8.3f} / {r.proxy.p99_ms:<7.3f}  "
            f"{r.overhead_p50_ms:>9.3f} / {r.overhead_p99_ms:<8.3f}  "
            f"{r.direct.rps:>10.0f} {r.proxy.rps:>10.0f}  "
            f"{_shown(r.stub_cpu_us):>16} {_shown(r.proxy_cpu_us):>6}"
        )
    verdict = "meets" if result.meets_target else "misses"
    print(
        f"target: p50 overhead <= {result.target_p50_overhead_ms} ms at "
        f"{result.target_concurrency} clients (text, paced): {verdict}"
    )


def _mode(row: Row) -> str:
    return row.mode if row.offered_rps is None else f"{row.offered_rps:.0f}/s"


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
