"""No anonymous client can lock others out at the connection layer (DESIGN.md invariant 13).

Each attack of issue 40 is a real client on raw sockets against a real proxy in front of
the stub backends. The attacker connects from its own loopback addresses (127.0.0.2 and
up: all of 127/8 is loopback on Linux), the victim from 127.0.0.1, as two hosts would.
Each mechanism's test is arranged so that it fails with that mechanism switched off: the
other bounds are set out of the way (`LOOSE`), and the test says what would happen.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest
from proxy_testing import ProxyUnderTest, Rig, chat
from waiting import wait_until

from ecshare.apps.proxy import edge
from ecshare.apps.proxy.edge import EVICT_AFTER_S, EVICT_YOUNG_S

CHAT = "/v1/chat/completions"
KEYS = {"key-of-the-victim-0123": "victim", "key-of-the-flood-0123": "flood"}
VICTIM = {"Authorization": "Bearer key-of-the-victim-0123"}
SLOW_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
    b"Content-Type: application/json\r\nContent-Length: 100000\r\n"
)
HALF_HEADER = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Ty"
# Bounds a test does not exercise, out of its way.
LOOSE: dict[str, Any] = {
    "first_byte_timeout_s": 120.0,
    "header_timeout_s": 120.0,
    "keepalive_timeout_s": 120.0,
}


def attacker(url: str, n: int) -> socket.socket:
    """A connection to the proxy from the loopback address 127.0.0.`n` (n >= 2)."""
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection(
        (host, int(port)), timeout=15, source_address=(f"127.0.0.{n}", 0)
    )


@contextmanager
def sockets(
    url: str, count: int, *, addresses: int = 1, send: bytes = b""
) -> Iterator[list[socket.socket]]:
    """`count` attacker connections spread over `addresses` source addresses, each having
    sent `send`; closed at the end."""
    with ExitStack() as stack:
        held = []
        for i in range(count):
            sock = stack.enter_context(attacker(url, 2 + i % addresses))
            if send:
                sock.sendall(send)
            held.append(sock)
        yield held


def refusals(proxy: ProxyUnderTest) -> list[str]:
    """The proxy's refusals so far, those counted at least once (for a failure's detail)."""
    lines = proxy.proxy.metrics.exposition().decode().splitlines()
    return [line for line in lines if "rejected_total{" in line and not line.endswith(" 0.0")]


def served(url: str, headers: dict[str, str] | None = None) -> int:
    """The status of one chat request on a new connection from 127.0.0.1."""
    with httpx.Client(timeout=15) as client:
        return client.post(url + CHAT, json=chat(), headers=headers).status_code


def closed(sock: socket.socket, within_s: float) -> bytes | None:
    """What the proxy sent `sock` before closing it within `within_s`; None if still open."""
    sock.settimeout(within_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return data


def test_idle_and_half_header_sockets_of_one_address_leave_other_clients_served(rig: Rig) -> None:
    """The issue's attack on `--max-connections 20`: half the sockets send nothing, half a
    header. With one cap for all (per address = 20), the victim got 503 for as long as
    they stayed open."""
    proxy = rig.start_proxy(max_connections=20, max_preauth_connections=20, **LOOSE)
    with sockets(proxy.url, 15), sockets(proxy.url, 15, send=HALF_HEADER):
        # The address holds 2 (20 // 8); the proxy refuses the other 28 as it accepts them.
        wait_until(
            lambda: proxy.metric("rejected_total", reason="address") == 28,
            detail=lambda: refusals(proxy),
        )
        for _ in range(5):
            assert served(proxy.url) == 200
    assert proxy.metric("rejected_total", reason="connections") == 0


def test_anonymous_sockets_of_many_addresses_never_take_a_key_holders_connection(
    rig: Rig,
) -> None:
    """Sockets from 15 addresses, each under its per-address cap, fill the pre-auth pool
    (5 of 20) and the rest are refused. A tenant's connection that has shown its key keeps
    being served, and a new connection, once the anonymous ones have idled
    `EVICT_AFTER_S`, takes the place of the oldest, which is closed. Without a pool of
    their own (pre-auth = 20), the anonymous sockets take all 20 and every new
    connection is refused."""
    proxy = rig.start_proxy(api_keys=KEYS, max_connections=20, max_preauth_connections=5, **LOOSE)
    with httpx.Client(timeout=15) as tenant:
        assert tenant.post(proxy.url + CHAT, json=chat(), headers=VICTIM).status_code == 200
        with sockets(proxy.url, 30, addresses=15) as anonymous:
            wait_until(
                lambda: proxy.metric("rejected_total", reason="preauth") == 25,
                detail=lambda: refusals(proxy),
            )
            for _ in range(3):  # the trusted keep-alive connection
                answer = tenant.post(proxy.url + CHAT, json=chat(), headers=VICTIM)
                assert answer.status_code == 200
            time.sleep(EVICT_AFTER_S)
            # New connections: the first takes the oldest idle anonymous one's place; once
            # served, it has left the pool, and the next finds a place free.
            for _ in range(5):
                assert served(proxy.url, VICTIM) == 200
            still_open = [sock for sock in anonymous if closed(sock, 0.2) is None]
            assert len(still_open) == 4
            assert anonymous[0] not in still_open  # the longest idle: the first accepted
    assert proxy.metric("rejected_total", reason="evicted") == 1
    assert proxy.metric("rejected_total", reason="connections") == 0


def test_an_address_that_fills_the_pool_yields_a_place_to_another_at_once(rig: Rig) -> None:
    """One address holds all 5 places of the pool with sockets a quarter second old: a
    client from another address takes the place of one of them at once, without waiting
    for them to idle `EVICT_AFTER_S` (by age alone, it was refused 503 while they stayed
    young)."""
    proxy = rig.start_proxy(max_connections_per_address=10, max_preauth_connections=5, **LOOSE)
    with sockets(proxy.url, 5) as held:
        time.sleep(EVICT_YOUNG_S)
        for _ in range(3):
            assert served(proxy.url) == 200
        still_open = [sock for sock in held if closed(sock, 0.2) is None]
    assert len(still_open) == 4  # once the first client was served, the pool had room
    assert proxy.metric("rejected_total", reason="evicted") == 1
    assert proxy.metric("rejected_total", reason="preauth") == 0


def test_a_connection_still_arriving_is_never_taken_for_another_addresss_newcomer(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection younger than `EVICT_YOUNG_S` may have its request on the way, read a
    turn of the loop after its accept: a newcomer from another address does not take its
    place, and is refused 503 (`preauth`) instead. Without the age, the evicted client saw
    its request cut ("Can not write request body"). Both ages are set to a minute here, so
    that the sockets stay young however slow the host."""
    monkeypatch.setattr(edge, "EVICT_YOUNG_S", 60.0)
    monkeypatch.setattr(edge, "EVICT_AFTER_S", 60.0)  # nor does the oldest idle rule
    proxy = rig.start_proxy(max_connections_per_address=10, max_preauth_connections=5, **LOOSE)
    with sockets(proxy.url, 5) as held:
        with attacker(proxy.url, 9) as newcomer:
            answer = closed(newcomer, 15)
            assert answer is not None and answer.startswith(b"HTTP/1.1 503")
        assert all(closed(sock, 0.05) is None for sock in held)
    assert proxy.metric("rejected_total", reason="preauth") == 1
    assert proxy.metric("rejected_total", reason="evicted") == 0


def test_a_pre_auth_connection_inside_a_request_is_never_evicted_and_a_full_pool_refuses(
    rig: Rig,
) -> None:
    """Pre-auth connections that are each inside a request (a body on its way) are not
    closed for a newcomer: the newcomer is refused 503, counted `preauth`."""
    proxy = rig.start_proxy(max_connections=20, max_preauth_connections=2, **LOOSE)
    body_coming = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    with sockets(proxy.url, 2, addresses=2, send=body_coming) as slow:
        wait_until(lambda: proxy.proxy.metrics.in_flight == 2)  # both inside the guard
        time.sleep(EVICT_AFTER_S)  # old enough to be evicted, were they not in a request
        with attacker(proxy.url, 9) as newcomer:
            answer = closed(newcomer, 15)
            assert answer is not None and answer.startswith(b"HTTP/1.1 503")
        assert all(closed(sock, 0.05) is None for sock in slow)
    assert proxy.metric("rejected_total", reason="preauth") == 1
    assert proxy.metric("rejected_total", reason="evicted") == 0


def test_a_socket_that_sends_nothing_is_closed_at_the_first_byte_deadline(rig: Rig) -> None:
    proxy = rig.start_proxy(
        first_byte_timeout_s=0.5, header_timeout_s=60.0, keepalive_timeout_s=60.0
    )
    with attacker(proxy.url, 2) as idle:
        began = time.monotonic()
        assert closed(idle, 15) == b""
        assert 0.4 <= time.monotonic() - began < 10
    assert proxy.metric("rejected_total", reason="first_byte_timeout") == 1


def test_a_half_header_is_answered_408_and_closed_at_the_header_deadline(rig: Rig) -> None:
    proxy = rig.start_proxy(
        first_byte_timeout_s=60.0, header_timeout_s=0.5, keepalive_timeout_s=60.0
    )
    with attacker(proxy.url, 2) as half:
        half.sendall(HALF_HEADER)
        began = time.monotonic()
        answer = closed(half, 15)
        assert 0.4 <= time.monotonic() - began < 10
    assert answer is not None and answer.startswith(b"HTTP/1.1 408")
    assert b"--header-timeout" in answer
    assert proxy.metric("rejected_total", reason="header_timeout") == 1
    assert proxy.metric("rejected_total", reason="first_byte_timeout") == 0


def test_an_idle_connection_between_requests_is_closed_at_the_keepalive_timeout(rig: Rig) -> None:
    proxy = rig.start_proxy(keepalive_timeout_s=0.5)
    with attacker(proxy.url, 2) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
        began = time.monotonic()
        answer = closed(sock, 15)
        assert 0.4 <= time.monotonic() - began < 10
    assert answer is not None and answer.startswith(b"HTTP/1.1 200")


def test_a_refused_pre_auth_connection_is_closed_after_its_answer(rig: Rig) -> None:
    """A client without a key gets its 401 and the connection ends: it cannot park on it."""
    proxy = rig.start_proxy(api_keys=KEYS, **LOOSE)
    with attacker(proxy.url, 2) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n")
        answer = closed(sock, 15)
    assert answer is not None and answer.startswith(b"HTTP/1.1 401")
    with httpx.Client(timeout=15) as tenant:  # one with the key keeps its connection
        for _ in range(2):
            assert tenant.get(proxy.url + "/v1/models", headers=VICTIM).status_code == 200
    assert proxy.metric("rejected_total", reason="auth") == 1


def test_slow_bodies_on_a_keyless_proxy_never_take_another_clients_requests(rig: Rig) -> None:
    """Eight bodies that never finish, from eight addresses, on a proxy without keys (every
    client is the tenant `default`, whose requests in flight are capped at 4). A request
    counts against that cap only once its body has arrived, so the victim is served; where
    it counted before its body was read, the victim got 429 until the slow ones timed out."""
    proxy = rig.start_proxy(max_tenant_in_flight=4, body_timeout_s=60.0, **LOOSE)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{"
    )
    stop = threading.Event()
    with sockets(proxy.url, 8, addresses=8, send=head) as slow:

        def trickle() -> None:
            while not stop.wait(0.5):
                for sock in slow:
                    sock.sendall(b" ")

        dripping = threading.Thread(target=trickle)
        dripping.start()
        try:
            for _ in range(5):
                assert served(proxy.url) == 200
        finally:
            stop.set()
            dripping.join(15)
    assert proxy.metric("rejected_total", reason="tenant_busy") == 0


def test_a_tenants_slow_bodies_hold_its_own_requests_never_the_pool_without_a_key(
    rig: Rig,
) -> None:
    """With keys, a tenant's bodies on their way count against its own requests in flight
    (4 here) from its key on, and its connections leave the pre-auth pool (2 places): its
    fifth slow body is refused 429 at once, and another tenant's new connections are
    served. Were they held in the pool until their bodies arrived, the pool would be full
    of connections inside a request, and every newcomer refused 503."""
    proxy = rig.start_proxy(
        api_keys=KEYS, max_preauth_connections=2, max_tenant_in_flight=4, **LOOSE
    )
    head = SLOW_HEAD + b"Authorization: Bearer key-of-the-flood-0123\r\n\r\n{"
    with ExitStack() as stack:
        slow = []
        for n in range(4):  # one at a time: never two young ones in the pool at once
            sock = stack.enter_context(attacker(proxy.url, 2 + n))
            sock.sendall(head)
            slow.append(sock)
            wait_until(lambda: proxy.proxy.metrics.in_flight == len(slow))
        with attacker(proxy.url, 9) as fifth:
            fifth.sendall(head)
            answer = closed(fifth, 15)
        assert answer is not None and answer.startswith(b"HTTP/1.1 429")
        for _ in range(3):
            assert served(proxy.url, VICTIM) == 200
        assert all(closed(sock, 0.05) is None for sock in slow)  # still sending
    assert proxy.metric("rejected_total", reason="tenant_busy") == 1
    assert proxy.metric("rejected_total", reason="preauth") == 0
