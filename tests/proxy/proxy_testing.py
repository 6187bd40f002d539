"""The proxy's test rig: stub backends and a proxy, real servers on 127.0.0.1.

Everything serves from one event loop on a background thread (`LoopThread`), so that a
test talks to the proxy with ordinary blocking clients (the official `openai` client,
`httpx`) from its own thread, as a user would. The stubs record what reached them, and
their `behaviour` can be changed between requests.

`rig` gives two stub encoders and one stub prefill/decode instance; `rig.start_proxy()`
starts a proxy in front of them (or in front of other URLs), with any config overridden.

The proxy in front of real vLLM instances is tested in tests/vllm/test_launch_e2e.py.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
import openai
import pytest
from aiohttp import web
from proxy_stubs import ENCODER, PREFILL_DECODE, StubBackend, serve_stubs

from ecshare.apps.proxy.app import Proxy
from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.server import RunningProxy, start_proxy
from ecshare.peer.items import ItemEvent, ItemSnapshot

T = TypeVar("T")

IMAGE_A = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
IMAGE_B = {"type": "image_url", "image_url": {"url": "https://example.com/b.jpg"}}
AUDIO = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
VIDEO = {"type": "video_url", "video_url": {"url": "https://example.com/c.mp4"}}


def chat(*parts: dict[str, Any], text: str = "describe", **fields: Any) -> dict[str, Any]:
    """A chat completion request whose one user message holds `parts` and `text`."""
    content = [*parts, {"type": "text", "text": text}]
    return {"model": "stub-model", "messages": [{"role": "user", "content": content}], **fields}


def dead_url() -> str:
    """A base URL on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class Feeds:
    """What the instances' item feeds would say, fed to a real `ItemDirectory` through its
    own `apply`: a first snapshot of nothing, then one "stored" event per item, in order."""

    INCARNATION = 1

    def __init__(self, directory: ItemDirectory | None = None) -> None:
        self.directory = directory if directory is not None else ItemDirectory()
        self._seq: dict[str, int] = {}

    def store(self, backend: str, *mm_hashes: str, encoder: bool = False) -> None:
        """`backend` reports `mm_hashes` stored (it is watched from its first report)."""
        if backend not in self._seq:
            self.directory.watch(backend, encoder=encoder)
            snapshot = ItemSnapshot(self.INCARNATION, 0, ())
            assert not self.directory.apply(backend, snapshot, time.monotonic())
            self._seq[backend] = 0
        for mm_hash in mm_hashes:
            self._seq[backend] += 1
            event = ItemEvent(self.INCARNATION, self._seq[backend], "stored", mm_hash, 1)
            assert not self.directory.apply(backend, event, time.monotonic())


class LoopThread:
    """An asyncio loop serving on a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@dataclass
class ProxyUnderTest:
    """A running proxy and ways to talk to it."""

    url: str
    proxy: Proxy
    api_key: str | None

    def openai(self, api_key: str | None = None) -> openai.OpenAI:
        key = api_key or self.api_key or "unused"
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=15)

    def post(self, path: str, body: Any, **kwargs: Any) -> httpx.Response:
        headers = kwargs.pop("headers", {})
        if self.api_key and "Authorization" not in headers:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return httpx.post(self.url + path, json=body, headers=headers, timeout=15, **kwargs)

    def get(self, path: str) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(self.url + path, headers=headers, timeout=15)

    def metric(self, name: str, **labels: str) -> float:
        return self.proxy.metrics.value(name, **labels)


@dataclass
class Rig:
    """Stub backends serving on a loop thread, and the proxies started in front of them."""

    loop: LoopThread
    encoders: list[StubBackend]
    prefill_decode: list[StubBackend]
    encoder_urls: list[str]
    pd_urls: list[str]
    _running: list[RunningProxy] = field(default_factory=list)
    _runners: list[web.AppRunner] = field(default_factory=list)

    def start_proxy(self, **overrides: Any) -> ProxyUnderTest:
        values: dict[str, Any] = {
            "encoders": tuple(self.encoder_urls),
            "prefill_decode": tuple(self.pd_urls),
            "host": "127.0.0.1",
            "port": 0,
            "health_interval_s": 60.0,
        }
        values.update(overrides)
        config = ProxyConfig(**values)
        running = self.loop.run(start_proxy(config))
        self._running.append(running)
        return ProxyUnderTest(running.url, running.proxy, config.api_key)

    def close(self) -> None:
        async def stop() -> None:
            for running in self._running:
                await running.stop()
            for runner in self._runners:
                await runner.cleanup()

        self.loop.run(stop())
        self.loop.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    loop = LoopThread()
    encoders = [StubBackend(ENCODER), StubBackend(ENCODER)]
    pd = [StubBackend(PREFILL_DECODE)]
    started = loop.run(serve_stubs([*encoders, *pd]))
    urls = [url for _, url in started]
    rig = Rig(loop, encoders, pd, urls[:2], urls[2:], _runners=[r for r, _ in started])
    try:
        yield rig
    finally:
        rig.close()
