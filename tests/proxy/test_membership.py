"""Membership at run time, with real HTTP: instances registered and unregistered through
`/v1/members` (only with the admin key), and discovered from a DNS name through a resolver
the test controls (the host's resolver cannot be pointed at test names here: /etc/hosts
is not ours to write). A member is in rotation once its health check passes, and the item
directory forgets what a member held when it leaves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families
from proxy_testing import Rig
from test_directory_feed import BACKEND, Child, children, claims, keys, start  # noqa: F401

from ecshare.apps.cli import parse_args
from ecshare.apps.proxy.backends import ENCODER, PREFILL_DECODE, BackendPool
from ecshare.apps.proxy.config import ProxyConfig, config_from_args
from ecshare.apps.proxy.directory import ItemDirectory
from ecshare.apps.proxy.discovery import (
    Membership,
    base_url,
    discovery_from_config,
    member_routes,
    resolve_addresses,
)
from ecshare.apps.proxy.feeds import DirectoryFeeds
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.config import ConfigError
from ecshare.control import KeyPair, generate_keypair
from ecshare.peer.items import ItemSnapshot

ADMIN_KEY = "an-admin-key-of-some-length"
WAIT_S = 30.0


async def until(check: Callable[[], bool], what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not check():
        assert loop.time() < deadline, f"never: {what}"
        await asyncio.sleep(0.01)


async def serve(app: web.Application, host: str = "127.0.0.1") -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, host, 0)
    await site.start()
    addresses = runner.addresses
    return runner, int(addresses[0][1])


def instance_app(healthy: bool = True) -> web.Application:
    """A backend as far as membership sees it: its /health."""

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    return app


def pools() -> dict[str, BackendPool]:
    metrics = ProxyMetrics()
    return {
        role: BackendPool(role, [], eject_after=3, metrics=metrics)
        for role in (ENCODER, PREFILL_DECODE)
    }


def test_registration_needs_the_admin_key_and_a_member_serves_once_healthy() -> None:
    async def run() -> None:
        members = pools()
        membership = Membership(members, health_timeout_s=2.0)
        admin = web.Application()
        admin.add_routes(member_routes(membership, ADMIN_KEY))
        admin_runner, admin_port = await serve(admin)
        instance_runner, instance_port = await serve(instance_app())
        sick_runner, sick_port = await serve(instance_app(healthy=False))
        url = f"http://127.0.0.1:{instance_port}"
        sick = f"http://127.0.0.1:{sick_port}"
        members_url = f"http://127.0.0.1:{admin_port}/v1/members"
        auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with aiohttp.ClientSession() as session:
            await membership.start(session)
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN_KEY}):
                async with session.post(
                    members_url, json={"role": "encoder", "url": url}, headers=headers
                ) as resp:
                    assert resp.status == 401
            assert len(members[ENCODER]) == 0
            assert membership.stats()["unauthorized"] == 3

            for body in (
                {"role": "encoder", "url": "ftp://x:1"},
                {"role": "encoder", "url": "http://x:1/v1"},
                {"role": "encoder", "url": "http://user:pw@x:1"},
                {"role": "router", "url": url},
                {"role": "encoder"},
            ):
                async with session.post(members_url, json=body, headers=auth) as resp:
                    assert resp.status == 400, body
            assert len(members[ENCODER]) == 0

            async with session.post(
                members_url, json={"role": "encoder", "url": url}, headers=auth
            ) as resp:
                assert resp.status == 200 and (await resp.json()) == {"joined": True}
            async with session.post(
                members_url, json={"role": "encoder", "url": sick}, headers=auth
            ) as resp:
                assert (await resp.json()) == {"joined": True}
            # In rotation once its health check passed; the sick one is a member, ejected.
            assert [b.url for b in members[ENCODER].healthy()] == [url]
            assert members[ENCODER].pick() is members[ENCODER].get(url)
            async with session.get(members_url, headers=auth) as resp:
                listed = (await resp.json())["members"]
            assert {m["url"] for m in listed} == {url, sick}

            async with session.delete(
                members_url, json={"role": "encoder", "url": url}, headers=auth
            ) as resp:
                assert (await resp.json()) == {"left": True}
            assert members[ENCODER].get(url) is None
            assert members[ENCODER].pick() is None
            assert membership.stats()["joined"] == 2 and membership.stats()["left"] == 1
            await membership.close()
        for runner in (admin_runner, instance_runner, sick_runner):
            await runner.cleanup()

    asyncio.run(run())


def test_listing_and_removal_without_the_admin_key_are_refused_counted_and_change_nothing(
    rig: Rig,
) -> None:
    proxy = rig.start_proxy(admin_key=ADMIN_KEY)
    members_url = proxy.url + "/v1/members"
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    member = {"role": "encoder", "url": "http://127.0.0.1:9"}
    joined = httpx.post(members_url, json=member, headers=auth, timeout=10)
    assert joined.status_code == 200 and joined.json() == {"joined": True}

    refusals = 0
    for headers in ({}, {"Authorization": "Bearer " + ADMIN_KEY[:-1] + "x"}):
        for method in ("GET", "DELETE"):
            refused = httpx.request(method, members_url, json=member, headers=headers, timeout=10)
            refusals += 1
            assert refused.status_code == 401, (method, headers, refused.text)
            assert "members" not in refused.text  # nothing listed to a caller without the key

    listed = httpx.get(members_url, headers=auth, timeout=10).json()
    assert member["url"] in {m["url"] for m in listed["members"]}  # still a member
    assert listed["stats"]["unauthorized"] == refusals
    scraped = httpx.get(proxy.url + "/metrics", headers=auth, timeout=10).text
    counted = [
        s.value
        for family in text_string_to_metric_families(scraped)
        for s in family.samples
        if s.name == "ecshare_proxy_membership_changes_total"
        and s.labels == {"change": "unauthorized"}
    ]
    assert counted == [refusals]


def test_dns_discovery_follows_the_names_answers_and_keeps_members_when_lookups_fail() -> None:
    async def run() -> None:
        members = pools()
        membership = Membership(members, health_timeout_s=2.0)
        runner, port = await serve(instance_app())
        answers: dict[str, Any] = {"pd.svc": ["127.0.0.1"]}
        lookups = 0

        async def resolve(name: str) -> list[str]:
            nonlocal lookups
            lookups += 1
            answer = answers[name]
            if isinstance(answer, Exception):
                raise answer
            return list(answer)

        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            await membership.start(
                session, {PREFILL_DECODE: ("pd.svc", port)}, interval_s=0.02, resolve=resolve
            )
            await until(lambda: [b.url for b in members[PREFILL_DECODE].healthy()] == [url], "up")
            membership.directory.apply(url, ItemSnapshot(1, 0, (("x", 1),)), 0.0)
            assert membership.directory.holders("x") == {url}

            answers["pd.svc"] = OSError("SERVFAIL")
            seen = lookups
            await until(lambda: lookups >= seen + 3, "lookups while failing")
            assert members[PREFILL_DECODE].get(url) is not None
            assert membership.stats()["dns_failures"] >= 3

            answers["pd.svc"] = []
            await until(lambda: members[PREFILL_DECODE].get(url) is None, "left")
            assert membership.directory.holders("x") == frozenset()
            await membership.close()
        await runner.cleanup()

    asyncio.run(run())


def test_a_registered_instances_items_reach_the_directory_and_go_when_it_leaves(
    keys: dict[str, Any],  # noqa: F811 - the fixture
    children: list[Child],  # noqa: F811 - the fixture
) -> None:
    child = start(children, keys)

    async def run() -> None:
        members = pools()
        feeds = DirectoryFeeds(ItemDirectory(), keys=keys["proxy"], resync_s=0.2)
        membership = Membership(
            members,
            health_timeout_s=1.0,
            directory=feeds.directory,
            feeds=feeds,
            events_port=child.port,
            server_keys={ENCODER: keys["instance"].public},
        )
        async with aiohttp.ClientSession() as session:
            await membership.start(session)
            # Its HTTP port does not answer: a member, ejected, and its items still known.
            assert await membership.join(ENCODER, BACKEND, "registered")
            child("put a")
            await until(lambda: claims(membership.directory, ["a"]) == {"a"}, "a held")
            assert membership.leave(ENCODER, BACKEND, "registered")
            assert membership.directory.holders("a") == frozenset()
            assert BACKEND not in membership.directory.watched()
            await membership.close()

    asyncio.run(run())


def test_the_default_resolver_answers_a_real_name() -> None:
    assert "127.0.0.1" in asyncio.run(resolve_addresses("localhost"))


def test_base_url_takes_only_a_backends_base() -> None:
    assert base_url("http://10.0.0.5:8000/") == "http://10.0.0.5:8000"
    assert base_url("https://[::1]:8000") == "https://[::1]:8000"
    for bad in ("http://h:1/x", "http://h:1?q=1", "ws://h:1", "http://:1", "x" * 3000):
        assert base_url(bad) is None


def _config(*flags: str) -> ProxyConfig:
    return config_from_args(parse_args(["proxy", *flags]), {})


def test_membership_flags_decode_into_the_config_and_the_admin_key_never_shows(
    tmp_path: Path,
) -> None:
    admin = tmp_path / "admin"
    admin.write_text(ADMIN_KEY + "\n")
    admin.chmod(0o600)
    instance = KeyPair.generate()
    proxy_key = generate_keypair(tmp_path, "proxy")
    config = _config(
        "--events-port", "5800",
        "--events-key", str(proxy_key.secret_path),
        "--events-encoder-key", instance.public_text,
        "--events-timeout", "3",
        "--directory-max-items", "1000",
        "--admin-key-file", str(admin),
        "--discover-pd", "pd.ns.svc.cluster.local:8000",
        "--discover-interval", "2",
    )  # fmt: skip
    assert (config.events_port, config.events_timeout_s, config.directory_max_items) == (
        5800,
        3.0,
        1000,
    )
    assert config.events_pd_key is None and config.events_encoder_key == instance.public_text
    assert config.admin_key == ADMIN_KEY
    assert config.prefill_decode == ()  # they will be discovered
    assert discovery_from_config(config) == {PREFILL_DECODE: ("pd.ns.svc.cluster.local", 8000)}
    assert ADMIN_KEY not in repr(config)


def test_a_z85_key_that_starts_with_a_dash_is_taken_as_the_key_flags_value(
    tmp_path: Path,
) -> None:
    # Z85 holds "-": one public key in 85 starts with it, and argparse alone would read
    # such a key as the next flag (a CI run met one at random).
    key = "-" + KeyPair.generate().public_text[1:]
    proxy_key = generate_keypair(tmp_path, "proxy")
    config = _config(
        "--events-port", "5800",
        "--events-key", str(proxy_key.secret_path),
        "--events-encoder-key", key,
        "--events-pd-key", key,
        "--pd", "http://pd:1",
    )  # fmt: skip
    assert (config.events_encoder_key, config.events_pd_key) == (key, key)
    status = parse_args(["status", "tcp://127.0.0.1:5701", "--server-key", key])
    assert status.server_key == key


@pytest.mark.parametrize(
    ("flags", "blamed"),
    [
        (["--pd", "http://pd:1", "--events-port", "5800"], "--events-port"),
        (["--pd", "http://pd:1", "--discover-encoders", "enc.svc"], "--discover-encoders"),
        (["--pd", "http://pd:1", "--discover-pd", "pd.svc:99999"], "--discover-pd"),
        (["--pd", "http://pd:1", "--events-timeout", "0"], "--events-timeout"),
        (["--pd", "http://pd:1", "--directory-max-items", "0"], "--directory-max-items"),
        ([], "--pd"),
    ],
)
def test_bad_membership_flags_are_one_clear_config_error(flags: list[str], blamed: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _config(*flags)
    assert blamed in str(caught.value)


def test_a_short_admin_key_is_refused(tmp_path: Path) -> None:
    admin = tmp_path / "admin"
    admin.write_text("short\n")
    admin.chmod(0o600)
    with pytest.raises(ConfigError, match="--admin-key-file"):
        _config("--pd", "http://pd:1", "--admin-key-file", str(admin))
