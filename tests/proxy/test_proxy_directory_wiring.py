"""The proxy app wired to the item directory: with `events_port` its router asks the
directory that real item feeds fill, and `/metrics` shows the directory's and the
membership's series; `/v1/members` answers its admin key alone, whatever the API keys."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from ecshare.apps.proxy.config import ProxyConfig
from ecshare.apps.proxy.metrics import MULTIPROC_DIR_ENV
from ecshare.apps.proxy.routing import NoDirectory
from ecshare.apps.proxy.server import start_proxy
from ecshare.control import generate_keypair, load_keypair
from tests.proxy.test_directory_feed import children, keys, start, until  # noqa: F401

BACKEND = "http://127.0.0.1:9"  # nothing listens: the feed is what is watched
ADMIN_KEY = "admin-key-0123456789abcdef"
API_KEY = "api-key-0123456789abcdef"
AS_ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # /metrics needs a key where keys are set


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def test_router_uses_the_directory_the_item_feeds_fill(
    keys: dict[str, Any],  # noqa: F811
    children: list[Any],  # noqa: F811
    tmp_path: Path,
) -> None:
    proxy_files = generate_keypair(tmp_path, "proxy")
    keys["proxy"] = load_keypair(proxy_files.secret_path)  # the key the feed admits
    child = start(children, keys)
    config = ProxyConfig(
        prefill_decode=(BACKEND,),
        port=0,
        api_key=API_KEY,
        events_port=child.port,
        events_key_file=str(proxy_files.secret_path),
        events_encoder_key=keys["instance"].public_text,
        admin_key=ADMIN_KEY,
    )

    async def run() -> None:
        running = await start_proxy(config)
        try:
            proxy = running.proxy
            assert proxy.membership is not None
            assert proxy.router.directory is proxy.membership.directory
            child("put a")
            await until(lambda: bool(proxy.router.directory.holders("a")), "a held")
            assert proxy.router.directory.holders("a") == {BACKEND}
            async with aiohttp.ClientSession() as session:
                async with session.get(running.url + "/metrics", headers=AS_ADMIN) as r:
                    text = await r.text()
                assert _sample(text, "ecshare_proxy_directory_items") == 1.0
                assert _sample(text, 'ecshare_proxy_members{role="prefill_decode"}') == 1.0
                snapshots = _sample(text, "ecshare_proxy_directory_snapshots_total")
                assert snapshots is not None and snapshots >= 1.0
                # The admin key opens /v1/members; the API key does not, nor does nothing.
                for auth, status in ((ADMIN_KEY, 200), (API_KEY, 401), (None, 401)):
                    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
                    async with session.get(running.url + "/v1/members", headers=headers) as r:
                        assert r.status == status, auth
                        if status == 200:
                            body = await r.json()
                            assert body["members"] == [
                                {"role": "prefill_decode", "url": BACKEND, "sources": ["static"]}
                            ]
                async with session.get(running.url + "/metrics", headers=AS_ADMIN) as r:
                    text = await r.text()
                unauthorized = 'ecshare_proxy_membership_changes_total{change="unauthorized"}'
                assert _sample(text, unauthorized) == 2.0
        finally:
            await running.stop()

    asyncio.run(run())


def test_without_an_events_port_the_router_knows_nothing_held_and_members_do_not_exist() -> None:
    config = ProxyConfig(prefill_decode=(BACKEND,), port=0)

    async def run() -> None:
        running = await start_proxy(config)
        try:
            assert running.proxy.membership is None
            assert isinstance(running.proxy.router.directory, NoDirectory)
            async with aiohttp.ClientSession() as session:
                async with session.get(running.url + "/v1/members") as r:
                    assert r.status == 404
                async with session.get(running.url + "/metrics") as r:
                    text = await r.text()
            assert _sample(text, 'ecshare_proxy_members{role="prefill_decode"}') == 1.0
            assert _sample(text, "ecshare_proxy_directory_items") == 0.0
        finally:
            await running.stop()

    asyncio.run(run())


_SHARED_MODE = """
from ecshare.apps.proxy.metrics import ProxyMetrics
metrics = ProxyMetrics()
assert metrics.multiprocess
stats = {"directory_applied": 3, "directory_entries": 7, "directory_gaps": 1}
metrics.track_membership(lambda: (stats, {"encoder": 2, "prefill_decode": 1}))
stats["directory_applied"] = 5  # counted since: the next scrape adds the difference
print(metrics.exposition().decode())
"""


def test_membership_series_follow_their_counts_in_the_workers_shared_metrics_mode(
    tmp_path: Path,
) -> None:
    # prometheus_client picks its shared-file values when imported: a process of its own.
    env = {**os.environ, MULTIPROC_DIR_ENV: str(tmp_path)}
    text = subprocess.run(
        [sys.executable, "-c", _SHARED_MODE], env=env, capture_output=True, text=True, check=True
    ).stdout

    assert _sample(text, 'ecshare_proxy_directory_messages_total{outcome="applied"}') == 5.0
    assert _sample(text, 'ecshare_proxy_directory_forgotten_total{cause="gap"}') == 1.0
    assert _sample(text, "ecshare_proxy_directory_items") == 7.0
    assert _sample(text, 'ecshare_proxy_members{role="encoder"}') == 2.0
