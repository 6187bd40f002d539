"""``ecshare bench proxy``: the latency and throughput the EPD proxy adds over its backends.

Three processes on 127.0.0.1: stub backends that answer instantly with prepared bytes
(`ecshare.proxy.stubs --canned`, one encoder and one prefill/decode instance), a real
``ecshare proxy`` in front of them, and this process, the load: closed-loop clients, each
sending its next request when the last answer is read in full.

Per scenario and concurrency the same load goes to the stub prefill/decode instance
directly (the baseline) and through the proxy, in alternating rounds so that background
load hits both alike. The overhead is proxy minus direct, at p50 and at p99.

Scenarios: ``text`` is a chat request without media (the proxy passes the bytes on);
``image`` has one image, so the proxy also makes an encoder call and re-encodes the
request with its `ec_transfer_params`: its overhead includes a whole extra round trip,
which the direct baseline does not make. The target (p50 overhead <= 2 ms at 64 clients)
is judged on ``text``.

With closed-loop clients, latency at 64 clients is mostly queueing: about 64 divided by
the throughput of the slowest process. On a machine with fewer cores than processes, the
load generator, the proxy and the stub share cores, and the overhead at 64 measures the
proxy's CPU cost per request times the queue, more than its added hop.
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

from ecshare.proxy.server import use_uvloop

__all__ = ["run_proxy_bench"]

TARGET_P50_OVERHEAD_MS = 2.0
TARGET_CONCURRENCY = 64
CONCURRENCIES = (1, 64)
ROUNDS = 4
_STUBS_READY = "ecshare-stubs-ready "
_PROXY_READY = "ecshare-proxy-ready "

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
    requests: int
    direct: Latency
    proxy: Latency
    overhead_p50_ms: float
    overhead_p99_ms: float
    # CPU time (user + system) per request: of the stub when sent directly, and of the
    # proxy process alone when sent through it. Less sensitive to a busy machine than
    # latency. None where /proc cannot be read.
    stub_cpu_us: float | None
    proxy_cpu_us: float | None


class ProxyBenchResult(msgspec.Struct):
    cpus: int
    load_average: tuple[float, float]  # 1-minute load at the start and at the end
    python: str
    loop: str
    rounds: int
    target_p50_overhead_ms: float
    target_concurrency: int
    rows: list[Row]
    meets_target: bool


def run_proxy_bench(json_output: bool = False, quick: bool = False) -> int:
    per_round = {1: 100, 64: 640} if quick else {1: 500, 64: 5000}
    rounds = 2 if quick else ROUNDS
    load_before = os.getloadavg()[0]
    with _servers() as servers:
        loop_name = use_uvloop()
        rows = asyncio.run(_measure_all(servers, per_round, rounds))
    text64 = next(r for r in rows if r.scenario == "text" and r.concurrency == TARGET_CONCURRENCY)
    result = ProxyBenchResult(
        cpus=os.cpu_count() or 0,
        load_average=(round(load_before, 2), round(os.getloadavg()[0], 2)),
        python=platform.python_version(),
        loop=loop_name,
        rounds=rounds,
        target_p50_overhead_ms=TARGET_P50_OVERHEAD_MS,
        target_concurrency=TARGET_CONCURRENCY,
        rows=rows,
        meets_target=text64.overhead_p50_ms <= TARGET_P50_OVERHEAD_MS,
    )
    if json_output:
        sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    else:
        _print_table(result)
    return 0


@dataclass(frozen=True)
class _Servers:
    stub_url: str  # the prefill/decode stub
    stub_pid: int
    proxy_url: str
    proxy_pid: int


@contextlib.contextmanager
def _servers() -> Iterator[_Servers]:
    """Start the stub backends and a proxy in front of them, each its own process."""
    procs: list[subprocess.Popen[str]] = []
    try:
        roles = ["--role", "prefill_decode", "--role", "encoder"]
        stubs = _spawn(["-m", "ecshare.proxy.stubs", *roles, "--canned"], procs)
        stub_urls: dict[str, str] = msgspec.json.decode(_ready(stubs, _STUBS_READY))["urls"]
        proxy_args = ["-m", "ecshare", "proxy", "--port", "0"]
        proxy_args += ["--pd", stub_urls["prefill_decode"], "--encoder", stub_urls["encoder"]]
        proxy = _spawn(proxy_args, procs)
        proxy_url: str = msgspec.json.decode(_ready(proxy, _PROXY_READY))["url"]
        yield _Servers(stub_urls["prefill_decode"], stubs.pid, proxy_url, proxy.pid)
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


def _ready(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith(prefix):
        raise RuntimeError(f"proxy bench: a server did not start (exit {proc.poll()}): {line!r}")
    return line.removeprefix(prefix)


async def _measure_all(servers: _Servers, per_round: dict[int, int], rounds: int) -> list[Row]:
    direct_url, proxy_url = servers.stub_url, servers.proxy_url
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for scenario, body in SCENARIOS.items():
            payload = msgspec.json.encode(body)
            for concurrency in CONCURRENCIES:
                n = per_round[concurrency]
                direct: list[float] = []
                proxied: list[float] = []
                direct_s = proxied_s = stub_cpu = proxy_cpu = 0.0
                for url in (direct_url, proxy_url):  # warm connections and caches
                    await _load(session, url, payload, concurrency, n // 4)
                for _ in range(rounds):
                    cpu = _cpu_seconds(servers.stub_pid)
                    times, seconds = await _load(session, direct_url, payload, concurrency, n)
                    stub_cpu += _cpu_seconds(servers.stub_pid) - cpu
                    direct += times
                    direct_s += seconds
                    cpu = _cpu_seconds(servers.proxy_pid)
                    times, seconds = await _load(session, proxy_url, payload, concurrency, n)
                    proxy_cpu += _cpu_seconds(servers.proxy_pid) - cpu
                    proxied += times
                    proxied_s += seconds
                d, p = _latency(direct, direct_s), _latency(proxied, proxied_s)
                rows.append(
                    Row(
                        scenario=scenario,
                        concurrency=concurrency,
                        requests=len(direct),
                        direct=d,
                        proxy=p,
                        overhead_p50_ms=round(p.p50_ms - d.p50_ms, 3),
                        overhead_p99_ms=round(p.p99_ms - d.p99_ms, 3),
                        stub_cpu_us=_per_request_us(stub_cpu, len(direct)),
                        proxy_cpu_us=_per_request_us(proxy_cpu, len(proxied)),
                    )
                )
    return rows


async def _load(
    session: aiohttp.ClientSession, base_url: str, payload: bytes, concurrency: int, total: int
) -> tuple[list[float], float]:
    """Send `total` requests from `concurrency` closed-loop clients; latencies and wall time."""
    url = base_url + "/v1/chat/completions"
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    left = total

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            t0 = time.perf_counter()
            async with session.post(url, data=payload, headers=headers) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"proxy bench: {url} answered {resp.status}")
            latencies.append(time.perf_counter() - t0)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies, time.perf_counter() - started


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (NaN where /proc is unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return math.nan
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _per_request_us(seconds: float, requests: int) -> float | None:
    return None if math.isnan(seconds) else round(seconds / requests * 1e6, 1)


def _latency(samples: list[float], seconds: float) -> Latency:
    ms = np.asarray(samples) * 1000
    return Latency(
        p50_ms=round(float(np.percentile(ms, 50)), 3),
        p99_ms=round(float(np.percentile(ms, 99)), 3),
        rps=round(len(samples) / seconds, 1),
    )


def _print_table(result: ProxyBenchResult) -> None:
    print(
        f"ecshare proxy overhead over instant stub backends ({result.cpus} CPUs, load "
        f"{result.load_average[0]} -> {result.load_average[1]}, Python {result.python}, "
        f"{result.loop}, {result.rounds} rounds)"
    )
    print(
        f"{'scenario':<8} {'clients':>7} {'requests':>8}  {'direct p50/p99 ms':>18} "
        f"{'proxy p50/p99 ms':>18}  {'overhead p50/p99 ms':>20}  {'direct rps':>10} "
        f"{'proxy rps':>10}  {'CPU us/req: stub':>16} {'proxy':>6}"
    )
    for r in result.rows:
        print(
            f"{r.scenario:<8} {r.concurrency:>7} {r.requests:>8}  "
            f"{r.direct.p50_ms:>8.3f} / {r.direct.p99_ms:<7.3f} "
            f"{r.proxy.p50_ms:>8.3f} / {r.proxy.p99_ms:<7.3f}  "
            f"{r.overhead_p50_ms:>9.3f} / {r.overhead_p99_ms:<8.3f}  "
            f"{r.direct.rps:>10.0f} {r.proxy.rps:>10.0f}  "
            f"{_shown(r.stub_cpu_us):>16} {_shown(r.proxy_cpu_us):>6}"
        )
    verdict = "meets" if result.meets_target else "misses"
    print(
        f"target: p50 overhead <= {result.target_p50_overhead_ms} ms at "
        f"{result.target_concurrency} clients (text): {verdict}"
    )


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
