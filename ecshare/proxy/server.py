"""Running the proxy: in a caller's event loop (`start_proxy`) or as `ecshare proxy` (`run_proxy`).

Handler cancellation is on: when a client disconnects, its handler is cancelled at once,
which closes the upstream connection, even while the proxy waits on a silent backend.
`run_proxy` uses uvloop when it is installed, prints one ready line (`READY_PREFIX` and a
JSON object with the URL) once it accepts connections, and stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from ecshare.proxy.app import PROXY_KEY, Proxy, build_app
from ecshare.proxy.config import ProxyConfig
from ecshare.proxy.metrics import ProxyMetrics

log = logging.getLogger(__name__)

READY_PREFIX = "ecshare-proxy-ready "


class ReadyLine(msgspec.Struct):
    url: str
    encoders: tuple[str, ...]
    prefill_decode: tuple[str, ...]
    api_key: bool
    loop: str


@dataclass
class RunningProxy:
    """A proxy serving in the current event loop."""

    runner: web.AppRunner
    url: str
    proxy: Proxy

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_proxy(config: ProxyConfig, metrics: ProxyMetrics | None = None) -> RunningProxy:
    """Serve a proxy for `config` in the running loop until `stop()` is awaited."""
    app = build_app(config, metrics)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("ecshare.proxy.access") if config.access_log else None,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=1024)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    return RunningProxy(runner, f"http://{shown}:{port}", app[PROXY_KEY])


def use_uvloop() -> str:
    """Make uvloop the event loop of later `asyncio.run` calls, when it is installed."""
    try:
        uvloop = importlib.import_module("uvloop")  # optional: imported by name, not typed
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def serve_until_signalled(
    config: ProxyConfig, announce: Callable[[RunningProxy], None]
) -> None:
    """Run the proxy, call `announce` once it listens, and stop it on SIGINT or SIGTERM."""
    running = await start_proxy(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    announce(running)
    try:
        await stop.wait()
    finally:
        await running.stop()


def run_proxy(config: ProxyConfig) -> int:
    """Serve until SIGINT or SIGTERM; the `ecshare proxy` command."""
    loop_name = use_uvloop()
    if config.api_key is None and config.host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "serving on %s without an API key: anyone who can connect may use it", config.host
        )

    def announce(running: RunningProxy) -> None:
        ready = ReadyLine(
            url=running.url,
            encoders=config.encoders,
            prefill_decode=config.prefill_decode,
            api_key=config.api_key is not None,
            loop=loop_name,
        )
        print(READY_PREFIX + msgspec.json.encode(ready).decode(), flush=True)

    try:
        asyncio.run(serve_until_signalled(config, announce))
    except OSError as exc:  # the port is taken, the address is not ours
        print(
            f"ecshare proxy: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr
        )
        return 1
    return 0
