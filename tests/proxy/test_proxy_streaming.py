"""Streamed answers pass through chunk by chunk, and a client that leaves cancels upstream."""

from __future__ import annotations

import socket
import time

import httpx
import msgspec
from proxy_testing import IMAGE_A, Rig, chat
from waiting import wait_until

CHAT = "/v1/chat/completions"


def test_streamed_chat_passes_sse_chunks_through(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.stream_chunks = 5
    proxy = rig.start_proxy()
    stream = proxy.openai().chat.completions.create(**chat(IMAGE_A), stream=True)
    texts = [chunk.choices[0].delta.content for chunk in stream]
    assert texts == [f"tok{i} " for i in range(5)]
    (forwarded,) = rig.prefill_decode[0].bodies()
    assert forwarded["stream"] is True and forwarded["ec_transfer_params"]


def test_streamed_completions_pass_through(rig: Rig) -> None:
    proxy = rig.start_proxy()
    stream = proxy.openai().completions.create(model="stub-model", prompt="hi", stream=True)
    assert [chunk.choices[0].text for chunk in stream] == ["tok0 ", "tok1 ", "tok2 "]


def test_each_chunk_reaches_the_client_before_the_next_is_written(rig: Rig) -> None:
    stub = rig.prefill_decode[0].behaviour
    stub.stream_chunks, stub.chunk_interval_s = 3, 0.3
    proxy = rig.start_proxy()
    arrivals = []
    with httpx.stream("POST", proxy.url + CHAT, json=chat(stream=True), timeout=15) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
    assert len(arrivals) == 3
    assert arrivals[1] - arrivals[0] > 0.2 and arrivals[2] - arrivals[1] > 0.2


def test_client_disconnect_mid_stream_cancels_the_upstream_request(rig: Rig) -> None:
    pd = rig.prefill_decode[0]
    pd.behaviour.stream_forever, pd.behaviour.chunk_interval_s = True, 0.05
    proxy = rig.start_proxy()
    with httpx.stream("POST", proxy.url + CHAT, json=chat(stream=True), timeout=15) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # one chunk seen: leave
    wait_until(pd.aborted.is_set)
    wait_until(lambda: proxy.metric("client_disconnects_total") == 1)
    wait_until(lambda: proxy.metric("in_flight") == 0)


def test_client_disconnect_while_waiting_cancels_the_upstream_request(rig: Rig) -> None:
    pd = rig.prefill_decode[0]
    pd.behaviour.delay_s = 30
    proxy = rig.start_proxy()
    host, port = proxy.url.removeprefix("http://").split(":")
    body = msgspec.json.encode(chat())
    head = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        wait_until(lambda: len(pd.calls) == 1)
    wait_until(pd.aborted.is_set)
    wait_until(lambda: proxy.metric("client_disconnects_total") == 1)


def test_stream_broken_upstream_ends_with_an_error_event(rig: Rig) -> None:
    rig.prefill_decode[0].behaviour.break_stream_after = 2
    proxy = rig.start_proxy()
    with httpx.stream("POST", proxy.url + CHAT, json=chat(stream=True), timeout=15) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 3
    last = msgspec.json.decode(events[-1].removeprefix("data: "))
    assert last["error"]["code"] == 502 and "broke off" in last["error"]["message"]
    assert proxy.metric("upstream_errors_total", reason="broken_stream") == 1


def test_a_streamed_answers_first_bytes_are_timed_once_and_a_whole_answer_not_at_all(
    rig: Rig,
) -> None:
    """`ttft_seconds` times the first bytes of a streamed answer from the request's
    arrival: once per answer, before its last chunk; an answer sent whole is not a stream,
    and `request_seconds` alone times it."""
    pd = rig.prefill_decode[0]
    pd.behaviour.stream_chunks = 4
    pd.behaviour.chunk_interval_s = 0.2
    proxy = rig.start_proxy()
    stream = proxy.openai().chat.completions.create(**chat(IMAGE_A), stream=True)
    assert len([chunk for chunk in stream]) == 4
    assert proxy.metric("ttft_seconds_count", endpoint="chat") == 1
    ttft = proxy.metric("ttft_seconds_sum", endpoint="chat")
    whole = proxy.metric("request_seconds_sum", endpoint="chat")
    assert ttft > 0 and ttft + 0.5 < whole  # the 3 chunks after the first took 0.6 s
    proxy.openai().chat.completions.create(**chat(IMAGE_A))
    assert proxy.metric("ttft_seconds_count", endpoint="chat") == 1
    assert proxy.metric("request_seconds_count", endpoint="chat") == 2
