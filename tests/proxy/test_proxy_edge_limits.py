"""A bounded edge on real sockets: connections, body reads, tenants' requests, encoder calls.

Each bound is met by a real client (raw sockets where the client must misbehave) against a
real proxy in front of the stub backends; each refusal is counted by reason.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
from proxy_testing import Rig, chat
from waiting import wait_until

from ecshare.apps.ready import ProxyReady, parse_ready

CHAT = "/v1/chat/completions"
KEYS = {"key-of-team-a-0123": "team-a", "key-of-team-b-0123": "team-b"}
AS = {tenant: {"Authorization": f"Bearer {key}"} for key, tenant in KEYS.items()}


def image(i: int) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": f"https://example.com/{i}.png"}}


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=15)


def request_on(sock: socket.socket) -> bytes:
    """One keep-alive GET /health on `sock`: the answer's head and body."""
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
    return read_answer(sock)


def read_answer(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_connections_past_the_cap_are_answered_503_and_closed(rig: Rig) -> None:
    proxy = rig.start_proxy(
        max_connections=2, max_connections_per_address=2, max_preauth_connections=2
    )
    held = [connect(proxy.url) for _ in range(2)]
    try:
        # Both are served (so the proxy holds them), and stay open (keep-alive).
        for sock in held:
            assert request_on(sock).startswith(b"HTTP/1.1 200")
        with connect(proxy.url) as extra:
            answer = read_answer(extra)
            assert answer.startswith(b"HTTP/1.1 503")
            assert b"as many connections" in answer
            assert extra.recv(1) == b""  # closed
        assert proxy.metric("rejected_total", reason="connections") == 1
        # A held connection still works; one closed makes room for a new one.
        assert request_on(held[0]).startswith(b"HTTP/1.1 200")
        held.pop().close()
        wait_until(lambda: httpx.get(proxy.url + "/health", timeout=15).status_code == 200)
    finally:
        for sock in held:
            sock.close()


def test_a_burst_of_connections_is_counted_exactly(rig: Rig) -> None:
    """Ten connections accepted in one go, before any of them has started: exactly the cap
    of them stay, each of the others is answered 503 (CI once saw one under the cap
    refused, when connections were counted before their start)."""
    proxy = rig.start_proxy(
        max_connections=4, max_connections_per_address=4, max_preauth_connections=4
    )
    burst = [connect(proxy.url) for _ in range(10)]
    try:
        wait_until(lambda: proxy.metric("rejected_total", reason="connections") == 6)
        answers = []
        for sock in burst:
            sock.settimeout(0.5)
            try:
                answers.append(sock.recv(12))
            except TimeoutError:
                answers.append(b"held")
        assert sorted(answers) == [b"HTTP/1.1 503"] * 6 + [b"held"] * 4
    finally:
        for sock in burst:
            sock.close()


def test_the_ecshare_proxy_command_caps_connections_on_its_own_loop(rig: Rig) -> None:
    """As operators run it: its own process and event loop (uvloop where installed)."""
    cmd = [
        sys.executable, "-m", "ecshare", "proxy", "--pd", *rig.pd_urls, "--port", "0",
        "--max-connections", "1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = parse_ready(proc.stdout.readline(), ProxyReady)
        assert ready is not None
        with connect(ready.url) as held:
            assert request_on(held).startswith(b"HTTP/1.1 200")
            with connect(ready.url) as extra:
                assert read_answer(extra).startswith(b"HTTP/1.1 503")
        metrics = ""
        for _ in range(50):  # the held connection's close reaches the proxy
            response = httpx.get(ready.url + "/metrics", timeout=15)
            if response.status_code == 200:
                metrics = response.text
                break
        assert 'ecshare_proxy_rejected_total{reason="connections"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)


def test_a_body_that_does_not_arrive_in_time_is_answered_408(rig: Rig) -> None:
    proxy = rig.start_proxy(body_timeout_s=0.5)
    with connect(proxy.url) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\n"
            b'Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"model":'
        )
        answer = read_answer(sock)  # the rest never comes
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"--body-timeout" in answer
    assert proxy.metric("rejected_total", reason="body_timeout") == 1
    assert not rig.prefill_decode[0].calls


def test_a_tenant_past_its_requests_in_flight_is_refused_429_and_others_are_not(
    rig: Rig,
) -> None:
    proxy = rig.start_proxy(api_keys=KEYS, max_tenant_in_flight=1)
    pd = rig.prefill_decode[0]
    pd.behaviour.delay_s = 2.0
    first: list[httpx.Response] = []
    slow = threading.Thread(
        target=lambda: first.append(proxy.post(CHAT, chat(), headers=AS["team-a"]))
    )
    slow.start()
    try:
        wait_until(lambda: len(pd.calls) == 1)  # team-a's request is in flight
        second = proxy.post(CHAT, chat(), headers=AS["team-a"])
        assert second.status_code == 429
        assert "--max-tenant-in-flight" in second.json()["error"]["message"]
        assert proxy.metric("rejected_total", reason="tenant_busy") == 1
        pd.behaviour.delay_s = 0.0
        assert proxy.post(CHAT, chat(), headers=AS["team-b"]).status_code == 200
    finally:
        slow.join(15)
    assert first[0].status_code == 200
    # Its request ended: the tenant may send again.
    assert proxy.post(CHAT, chat(), headers=AS["team-a"]).status_code == 200


def test_a_requests_encoder_calls_are_bounded_by_batching_its_items(rig: Rig) -> None:
    proxy = rig.start_proxy(max_encoder_calls=2, pd_media="keep")
    assert proxy.post(CHAT, chat(*(image(i) for i in range(5)))).status_code == 200
    calls = [body for stub in rig.encoders for body in stub.bodies()]
    sizes = sorted(len(body["messages"][0]["content"]) for body in calls)
    assert sizes == [2, 3]


def test_encoder_calls_in_flight_are_bounded_across_requests(rig: Rig) -> None:
    encoder = rig.encoders[0]
    proxy = rig.start_proxy(
        encoders=(rig.encoder_urls[0],), max_encoder_in_flight=1, pd_media="keep"
    )
    encoder.behaviour.delay_s = 0.2
    answers: list[int] = []

    def send(i: int) -> None:
        answers.append(proxy.post(CHAT, chat(image(2 * i), image(2 * i + 1))).status_code)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert answers == [200, 200, 200]
    # Six calls, asked for at once by three requests, reached the encoder one at a time.
    assert len(encoder.calls) == 6
    assert encoder.peak == 1


def test_a_flooding_tenant_never_delays_another_tenants_encodes(rig: Rig) -> None:
    """team-a bursts 6 requests of 2 images on one slow encoder with 4 slots: it holds its
    share, 2, and its other calls wait. team-b's call reaches the encoder next, before
    any of team-a's waiting ones. With no share (team-a may hold all 4), team-b's call
    came fifth, after a whole encode of team-a's."""
    encoder = rig.encoders[0]
    proxy = rig.start_proxy(
        api_keys=KEYS,
        encoders=(rig.encoder_urls[0],),
        max_encoder_in_flight=4,
        max_tenant_encoder_in_flight=2,
        pd_media="keep",
    )
    encoder.behaviour.delay_s = 1.0
    answers: list[int] = []

    def send(tenant: str, i: int) -> None:
        body = chat(image(100 * i), image(100 * i + 1))
        answers.append(proxy.post(CHAT, body, headers=AS[tenant]).status_code)

    flood = [threading.Thread(target=send, args=("team-a", i)) for i in range(6)]
    for thread in flood:
        thread.start()
    try:
        wait_until(lambda: len(encoder.calls) == 2)
        assert encoder.in_flight == 2  # its share; its other 10 calls wait
        send("team-b", 99)
        urls = [body["messages"][0]["content"][0]["image_url"]["url"] for body in encoder.bodies()]
        assert urls.index("https://example.com/9900.png") == 2
    finally:
        for thread in flood:
            thread.join(60)
    assert answers == [200] * 7
    assert encoder.peak <= 4  # the slots of all tenants


def test_encoder_slots_are_sized_to_the_encoders_in_rotation_and_shared_by_default(
    rig: Rig,
) -> None:
    """Two slow encoders, 2 calls each (`max_in_flight_per_encoder`), under a global 64:
    team-a's 8 requests at once keep 2 calls on each encoder at most, its share being half
    of the 4 slots (2) unless set; team-b's call reaches an encoder before the rest of
    team-a's. With the global bound alone, all 8 went to the encoders at once, to queue
    inside them first come first served."""
    proxy = rig.start_proxy(
        api_keys=KEYS,
        encoders=tuple(rig.encoder_urls[:2]),
        max_in_flight_per_encoder=2,
        pd_media="keep",
    )
    for encoder in rig.encoders[:2]:
        encoder.behaviour.delay_s = 1.0
    answers: list[int] = []

    def send(tenant: str, i: int) -> None:
        answers.append(proxy.post(CHAT, chat(image(i)), headers=AS[tenant]).status_code)

    def started() -> list[str]:
        bodies = [b for e in rig.encoders[:2] for b in e.bodies()]
        return [b["messages"][0]["content"][0]["image_url"]["url"] for b in bodies]

    flood = [threading.Thread(target=send, args=("team-a", i)) for i in range(8)]
    for thread in flood:
        thread.start()
    try:
        wait_until(lambda: len(started()) == 2)
        time.sleep(0.3)
        assert len(started()) == 2  # team-a's share; its 6 other calls wait in the proxy
        flood.append(threading.Thread(target=send, args=("team-b", 99)))
        flood[-1].start()
        wait_until(lambda: len(started()) == 3)  # team-a's next can start only in ~1 s
        assert "https://example.com/99.png" in started()
    finally:
        for thread in flood:
            thread.join(60)
    assert answers == [200] * 9
    assert all(e.peak <= 2 for e in rig.encoders[:2]), [e.peak for e in rig.encoders[:2]]
    assert sum(len(e.calls) for e in rig.encoders[:2]) == 9


def test_prefill_decode_slots_keep_a_flooding_tenant_to_its_share_of_an_instance(
    rig: Rig,
) -> None:
    """`--max-in-flight-per-pd 2` on one slow instance: team-a's 5 requests at once reach
    it one at a time (its share, half of 2), and team-b's request reaches it next, not
    after team-a's other 4. Without the bound, all 5 reached the instance at once, to be
    queued inside it first come first served."""
    pd = rig.prefill_decode[0]
    proxy = rig.start_proxy(api_keys=KEYS, max_in_flight_per_pd=2)
    pd.behaviour.delay_s = 0.6
    answers: list[int] = []

    def send(tenant: str, text: str) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": text}]}
        answers.append(proxy.post(CHAT, body, headers=AS[tenant]).status_code)

    def reached() -> list[str]:
        return [b["messages"][0]["content"] for b in pd.bodies()]

    threads = [threading.Thread(target=send, args=("team-a", f"a{i}")) for i in range(5)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(reached()) == 1)
        time.sleep(0.2)
        assert len(reached()) == 1  # team-a's share; its other 4 wait in the proxy
        threads.append(threading.Thread(target=send, args=("team-b", "b")))
        threads[-1].start()
        wait_until(lambda: len(reached()) == 2)
        assert reached()[1] == "b"
    finally:
        for thread in threads:
            thread.join(60)
    assert answers == [200] * 6
    assert pd.peak == 2


def test_a_request_past_the_prefill_decode_slot_wait_is_answered_429(rig: Rig) -> None:
    pd = rig.prefill_decode[0]
    proxy = rig.start_proxy(max_in_flight_per_pd=1, pd_slot_wait_s=0.3)
    pd.behaviour.delay_s = 3.0
    first: list[httpx.Response] = []
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    holder = threading.Thread(target=lambda: first.append(proxy.post(CHAT, text)))
    holder.start()
    try:
        wait_until(lambda: pd.in_flight == 1)
        refused = proxy.post(CHAT, text)
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert "--pd-slot-wait" in refused.json()["error"]["message"]
        assert proxy.metric("rejected_total", reason="pd_busy") == 1
        assert len(pd.calls) == 1  # the refused request never reached it
    finally:
        holder.join(30)
    assert first[0].status_code == 200


def test_a_request_that_waits_past_the_slot_bound_is_answered_429_with_retry_after(
    rig: Rig,
) -> None:
    encoder = rig.encoders[0]
    proxy = rig.start_proxy(
        encoders=(rig.encoder_urls[0],),
        max_encoder_in_flight=1,
        encoder_slot_wait_s=0.3,
        pd_media="keep",
    )
    encoder.behaviour.delay_s = 3.0
    first: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: first.append(proxy.post(CHAT, chat(image(1)))))
    holder.start()
    try:
        wait_until(lambda: encoder.in_flight == 1)
        refused = proxy.post(CHAT, chat(image(2)))
        assert refused.status_code == 429
        assert refused.headers["Retry-After"] == "1"
        assert "--encoder-slot-wait" in refused.json()["error"]["message"]
        assert proxy.metric("rejected_total", reason="encoder_busy") == 1
        assert len(encoder.calls) == 1  # the refused request's item never reached it
    finally:
        holder.join(30)
    assert first[0].status_code == 200
