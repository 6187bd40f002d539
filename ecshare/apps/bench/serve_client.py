"""The client side of ``ecshare bench serve``: requests at their offered times, streamed.

`send_all` sends each request at its arrival time, or later once its chat's previous
turn has been answered (a chat client waits for the answer before its next turn), and
records per request when it was sent, its time to first token (the first streamed event
that carries a token), when it ended, its generated token ids, the proxy's steps (its
`Server-Timing` header, `ecshare.apps.proxy.routing`, sent by a proxy started with
`--route-headers`) and any error. A failed request is
recorded, never raised: the report counts it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ecshare.apps.proxy.routing import ROUTE_HEADER, TIMING_HEADER

__all__ = ["Record", "reference_tokens", "send_all", "server_timing"]

TIMEOUT_S = 300.0


@dataclass
class Record:
    sent_s: float = 0.0  # from the run's start
    ttft_s: float | None = None
    ended_s: float = 0.0
    tokens: list[int] = field(default_factory=list)
    steps: dict[str, float] = field(default_factory=dict)  # the proxy's, in seconds
    route: str = ""  # the proxy's x-ecshare-route header
    error: str | None = None


async def send_all(
    base_url: str,
    bodies: list[dict[str, Any]],
    at_s: list[float],
    previous: list[int | None],
) -> list[Record]:
    """Stream every body to `base_url`'s chat endpoint (see the module's docstring)."""
    records = [Record() for _ in bodies]
    done = [asyncio.Event() for _ in bodies]
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def one(n: int) -> None:
            try:
                await asyncio.sleep(max(0.0, start + at_s[n] - time.perf_counter()))
                earlier = previous[n]
                if earlier is not None:
                    await done[earlier].wait()
                records[n].sent_s = time.perf_counter() - start
                await _stream(session, base_url, bodies[n], records[n])
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
                records[n].error = f"{type(exc).__name__}: {exc}"[:300]
            finally:
                records[n].ended_s = time.perf_counter() - start
                done[n].set()

        await asyncio.gather(*(one(n) for n in range(len(bodies))))
    return records


async def _stream(
    session: aiohttp.ClientSession, base_url: str, body: dict[str, Any], record: Record
) -> None:
    started = time.perf_counter()
    async with session.post(base_url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            record.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            return
        record.steps = server_timing(resp.headers.get(TIMING_HEADER, ""))
        record.route = resp.headers.get(ROUTE_HEADER, "")
        async for event in sse_events(resp):
            if event is None:
                break
            if "error" in event:
                record.error = f"stream error: {str(event['error'])[:200]}"
                return
            for choice in event.get("choices") or ():
                ids = choice.get("token_ids") or []
                if ids and record.ttft_s is None:
                    record.ttft_s = time.perf_counter() - started
                record.tokens += ids
    if not record.tokens:
        record.error = "the stream carried no token"


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any] | None]:
    """The JSON events of an OpenAI-style streamed answer, in order, then None for its
    `[DONE]`: an answer cut short ends without the None. ValueError for an event that
    is not JSON."""
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        yield json.loads(data)


def server_timing(value: str) -> dict[str, float]:
    """The steps of a `Server-Timing` header value, in seconds (`name;dur=MS, ...`); a
    step without a readable duration is left out."""
    steps: dict[str, float] = {}
    for metric in value.split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, dur = param.partition("=")
            if name and key == "dur" and _is_number(dur):
                steps[name] = steps.get(name, 0.0) + float(dur) / 1e3
    return steps


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


async def reference_tokens(
    base_url: str, bodies: list[dict[str, Any] | None], concurrency: int = 2
) -> list[list[int] | None]:
    """The token ids `base_url` generates for each body (None where the body is None),
    asked without streaming, `concurrency` at a time; raises on any failure: the
    reference must be whole."""
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(body: dict[str, Any] | None) -> list[int] | None:
            if body is None:
                return None
            async with (
                limit,
                session.post(
                    base_url + "/v1/chat/completions", json={**body, "stream": False}
                ) as resp,
            ):
                if resp.status != 200:
                    raise RuntimeError(
                        f"the plain instance answered {resp.status}: {await resp.text()}"
                    )
                answer = await resp.json()
            ids = answer["choices"][0].get("token_ids")
            if not isinstance(ids, list) or not ids:
                raise RuntimeError(f"the plain instance gave no token ids: {str(answer)[:300]}")
            return [int(i) for i in ids]

        return list(await asyncio.gather(*(one(b) for b in bodies)))
