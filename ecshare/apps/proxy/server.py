"""Running the proxy: in a caller's event loop (`start_proxy`) or as one proxy process
(`serve_worker`).

`ecshare proxy` starts in `ecshare.apps.proxy.workers.run_proxy`, which serves through
`serve_worker` here, or, with `workers` > 1, runs that many proxy processes on one port,
each of them serving through `serve_worker`. This module imports nothing of that one.

Handler cancellation is on: when a client disconnects, its handler is cancelled at once,
which closes the upstream connection, even while the proxy waits on a silent backend.
Client connections are bounded (`edge`): caps overall, per client address and before a
key, and deadlines for a new connection's first byte and header.
`serve_worker` uses uvloop when it is installed, prints one ready line
(`ecshare.apps.ready.ProxyReady`, with the URL) once it accepts
connections, and stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from ecshare.apps.proxy.app import PROXY_KEY, Proxy, build_app
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.edge import EdgeLimits, EdgeSite
from ecshare.apps.proxy.link import SupervisorLink
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.ready import ProxyReady, print_ready

log = logging.getLogger(__name__)


@dataclass
class RunningProxy:
    """A proxy serving in the current event loop."""

    runner: web.AppRunner
    url: str
    proxy: Proxy

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_proxy(
    config: ProxyConfig,
    metrics: ProxyMetrics | None = None,
    *,
    reuse_port: bool = False,
    link: SupervisorLink | None = None,
) -> RunningProxy:
    """Serve a proxy for `config` in the running loop until `stop()` is awaited.

    `reuse_port` lets other sockets with it set listen on the same port (the workers of
    `ecshare proxy --workers N`); the kernel spreads connections across them, and `link`
    is a worker's channel to their supervisor (`ecshare.apps.proxy.link`).
    """
    app = build_app(config, metrics, link=link)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=logging.getLogger("ecshare.apps.proxy.access") if config.access_log else None,
        keepalive_timeout=config.keepalive_timeout_s,
    )
    await runner.setup()
    proxy = app[PROXY_KEY]
    site = EdgeSite(
        runner,
        config.host,
        config.port,
        limits=EdgeLimits.of(config),
        refused=proxy.metrics.refused,
        backlog=1024,
        reuse_port=reuse_port,
    )
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    shown = f"[{host}]" if ":" in host else host
    return RunningProxy(runner, f"http://{shown}:{port}", proxy)


def use_uvloop() -> str:
    """Make uvloop the event loop of later `asyncio.run` calls, when it is installed."""
    try:
        uvloop = importlib.import_module("uvloop")  # optional: imported by name, not typed
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def serve_until_signalled(
    config: ProxyConfig,
    announce: Callable[[RunningProxy], None],
    *,
    reuse_port: bool = False,
    channel: socket.socket | None = None,
) -> None:
    """Run the proxy, call `announce` once it listens, and stop it on SIGINT or SIGTERM."""
    link = SupervisorLink(channel) if channel is not None else None
    running = await start_proxy(config, reuse_port=reuse_port, link=link)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    announce(running)
    try:
        await stop.wait()
    finally:
        await running.stop()


def serve_worker(
    config: ProxyConfig, *, reuse_port: bool, channel: socket.socket | None = None
) -> int:
    """Serve one proxy process until SIGINT or SIGTERM, printing its ready line; `channel`
    is a worker's to its supervisor."""
    loop_name = use_uvloop()

    def announce(running: RunningProxy) -> None:
        print_ready(proxy_ready(config, running.url, loop_name, (os.getpid(),)))

    try:
        asyncio.run(serve_until_signalled(config, announce, reuse_port=reuse_port, channel=channel))
    except OSError as exc:  # the port is taken, the address is not ours
        return cannot_listen(config, exc)
    return 0


def cannot_listen(config: ProxyConfig, exc: OSError) -> int:
    """Say why the proxy cannot listen where it was told to; the exit status."""
    print(f"ecshare proxy: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
    return 1


def proxy_ready(config: ProxyConfig, url: str, loop: str, pids: tuple[int, ...]) -> ProxyReady:
    """What the proxy's ready line says."""
    return ProxyReady(
        url=url,
        encoders=config.encoders,
        prefill_decode=config.prefill_decode,
        api_key=bool(config.keys()),
        loop=loop,
        pids=pids,
    )
