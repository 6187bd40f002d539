"""The encoder stage: find a request's media items, encode them on the encoders, merge the params.

Each media content part goes to an encoder in a request of its own (or with up to
`batch_size - 1` others, or as many more as keep a request within `max_calls` calls):
the same model and processor options as the original, the items as one user message,
`max_tokens: 1`. The calls run concurrently, each to the encoder routing prefers for
its content (`routing.rendezvous`) while that one is healthy, else to the healthy
encoder with the fewest calls in flight. At most `max_in_flight` calls are at once over
all requests, and at most `per_encoder` for each encoder in rotation: what an encoder
cannot start at once would queue inside it first come first served, where one tenant's
burst delays everyone's calls; held back here, they are handed out to the tenants in
turn. One tenant has at most `max_tenant_in_flight` of them (half, unless set; `slots`:
the others wait their turn, a bounded time, then the request is answered 429 and its
other calls cancelled). The `ec_transfer_params` they return
(`ecshare.protocol.TransferParam`) are merged by mm_hash. Each item's
`item_indices` (its positions among the call's items) tell which part of the request an
mm_hash is, so that the parts can be sent on as their placeholder metadata only (`media`).

An encoder that cannot be reached is ejected and the call tried once on another. A call
that still fails, times out, or answers without params or with params that are not
valid (`ecshare.protocol.TransferParam`; counted as `params`) costs only time: its items are
left out of the params, so the prefill/decode instance encodes them itself. Every such
item is logged and counted (`encoder_fallbacks{reason}`).

What the encoder call keeps of the original request is everything except the fields that
steer decoding (`_DECODING_FIELDS`): `mm_processor_kwargs`, `media_io_kwargs` and any field
the proxy does not know pass untouched, so that the encoder tokenizes and hashes each item
exactly as prefill/decode will.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import msgspec

from ecshare.apps.proxy.backends import Backend, BackendPool, describe
from ecshare.apps.proxy.metrics import ProxyMetrics
from ecshare.apps.proxy.parts import MEDIA_PART_TYPES
from ecshare.apps.proxy.slots import StageSlots
from ecshare.apps.proxy.tenants import DEFAULT_TENANT
from ecshare.protocol import ParamsError, PushRequest, TransferParam, decode_items

log = logging.getLogger(__name__)

JSON = dict[str, Any]
T = TypeVar("T")

# Fields that steer decoding, structured output or templating of the reply, not how media
# is processed; some would make a one-token, one-message encode call fail or run long.
# `request_id` would give the engine several requests of one id.
_DECODING_FIELDS = frozenset(
    {
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
        "n",
        "best_of",
        "logprobs",
        "top_logprobs",
        "prompt_logprobs",
        "echo",
        "stop",
        "stop_token_ids",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "continue_final_message",
        "add_generation_prompt",
        "request_id",
        "ec_transfer_params",
        "kv_transfer_params",
    }
)

_CHAT_PATH = "/v1/chat/completions"
_NO_ENCODER_LOG_EVERY_S = 10.0
_ENCODE = msgspec.json.Encoder(order="sorted")


@dataclass
class MediaScan:
    """A chat request's media: each distinct part once, in order, and where each occurs."""

    parts: list[JSON]
    # (message index, content index, index in `parts`) of every media part, in order.
    where: list[tuple[int, int, int]]


@dataclass
class Encoded:
    """What the encoders answered for a request's distinct media parts."""

    params: dict[str, TransferParam]  # merged ec_transfer_params, by mm_hash
    hashes: list[str | None]  # each part's mm_hash, None where unknown (aligned with parts)


def scan_media(body: Mapping[str, Any]) -> MediaScan:
    """The media content parts of a chat request (see `MediaScan`)."""
    scan = MediaScan([], [])
    messages = body.get("messages")
    if not isinstance(messages, list):
        return scan
    # One item sent twice is encoded once. Parts are told apart by a sketch that reads a
    # few bytes of each long string, and parts with the same sketch by their encoding:
    # encoding a 4 MB data URL for every request would cost milliseconds.
    seen: dict[Hashable, list[int]] = {}
    for m, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for c, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") in MEDIA_PART_TYPES:
                alike = seen.setdefault(_sketch(part), [])
                index = next((i for i in alike if _same(scan.parts[i], part)), None)
                if index is None:
                    index = len(scan.parts)
                    alike.append(index)
                    scan.parts.append(part)
                scan.where.append((m, c, index))
    return scan


def _sketch(value: Any) -> Hashable:
    """A hashable stand-in for a JSON value that equal values share, cheap to compute."""
    if isinstance(value, str):
        return value if len(value) <= 96 else (len(value), value[:32], value[-32:])
    if isinstance(value, dict):
        return tuple(sorted((k, _sketch(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_sketch(v) for v in value)
    return (type(value), value)


def _same(a: JSON, b: JSON) -> bool:
    return a is b or _ENCODE.encode(a) == _ENCODE.encode(b)


def media_parts(body: Mapping[str, Any]) -> list[JSON]:
    """The media content parts of a chat request, in order, each distinct part once."""
    return scan_media(body).parts


def encoder_request(
    body: Mapping[str, Any], parts: list[JSON], push_to: tuple[str, ...] = ()
) -> JSON:
    """The encode-only chat request for `parts` of `body`; with `push_to`, asking the
    encoder to push the items to those prefill/decode push names (ecshare.vllm.pushes)."""
    request = {k: v for k, v in body.items() if k not in _DECODING_FIELDS}
    request["messages"] = [{"role": "user", "content": parts}]
    request["max_tokens"] = 1
    request["stream"] = False
    if push_to:
        request["ec_transfer_params"] = msgspec.to_builtins(PushRequest(push_to=push_to))
    return request


class EncoderStage:
    """Sends a request's media items to the encoders and merges what they answer."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pool: BackendPool,
        metrics: ProxyMetrics,
        *,
        batch_size: int,
        timeout_s: float,
        connect_timeout_s: float,
        max_calls: int = 8,
        max_in_flight: int = 64,
        per_encoder: int = 0,
        max_tenant_in_flight: int | None = None,
        slot_wait_s: float = 10.0,
    ) -> None:
        self._session = session
        self._pool = pool
        self._metrics = metrics
        self._batch_size = batch_size
        self._max_calls = max_calls
        self.stage_slots = StageSlots(
            pool,
            per_backend=per_encoder,
            max_total=max_in_flight,
            tenant_share=max_tenant_in_flight,
            wait_s=slot_wait_s,
            calls="encoder calls",
            wait_flag="--encoder-slot-wait",
            reason="encoder_busy",
        )
        self.slots = self.stage_slots.slots
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._warned_no_encoder_at = -math.inf

    async def encode(
        self,
        body: Mapping[str, Any],
        parts: list[JSON],
        request_id: str,
        push_to: tuple[str, ...] = (),
        prefer: Sequence[Backend | None] = (),
        tenant: str = DEFAULT_TENANT,
    ) -> Encoded:
        """The merged `ec_transfer_params` for `parts` (empty when every call failed), and
        which mm_hash each part is; the encoders push the items to `push_to`. With
        `prefer` (an encoder or None for each part), each call goes to the encoder its
        first part prefers while that one is in rotation (with one part a call, the
        default, every part to its own). Each call takes one of `tenant`'s encoder slots
        (`slots`); where one does not come free in time, `ProxyError` 429."""
        started = time.perf_counter()
        size = max(self._batch_size, math.ceil(len(parts) / self._max_calls))
        batches = self._batches(len(parts), size, prefer)
        calls = [
            self._encode_batch(
                encoder_request(body, [parts[i] for i in batch], push_to),
                len(batch),
                f"{request_id}-enc{b}",
                tenant,
                first,
            )
            for b, (first, batch) in enumerate(batches)
        ]
        encoded = Encoded({}, [None] * len(parts))
        for (_, batch), params in zip(batches, await _all_or_none(calls), strict=True):
            for mm_hash, where in params.items():
                encoded.params.setdefault(mm_hash, where)
                for i in _item_indices(where, len(batch), len(params)):
                    encoded.hashes[batch[i]] = mm_hash
        self._metrics.encode_seconds.observe(time.perf_counter() - started)
        return encoded

    @staticmethod
    def _batches(
        count: int, size: int, prefer: Sequence[Backend | None]
    ) -> list[tuple[Backend | None, list[int]]]:
        """The calls for `count` parts, `size` a call: each with its parts, and the encoder
        to try first (the one its first part with a preference prefers)."""
        batches = []
        for start in range(0, count, size):
            batch = list(range(start, min(start + size, count)))
            first = next((prefer[i] for i in batch if i < len(prefer) and prefer[i]), None)
            batches.append((first, batch))
        return batches

    async def _encode_batch(
        self, request: JSON, items: int, call_id: str, tenant: str, first: Backend | None = None
    ) -> dict[str, TransferParam]:
        payload = msgspec.json.encode(request)
        tried: list[Backend] = []
        reason = "no_encoder"
        # One retry, and only after a refused connection: the encoder never saw the call.
        while len(tried) < 2:
            # Picked once a slot is free: the least busy then.
            async with self.stage_slots.slot(tenant):
                if first is not None and first.healthy and not tried:
                    backend: Backend | None = first
                else:
                    backend = self._pool.pick(exclude=tried)
                if backend is None:
                    break
                tried.append(backend)
                params, reason = await self._call(backend, payload, call_id)
            if params is not None:
                self._metrics.encoded_items.inc(items)
                return params
            if reason != "unreachable":
                break
        if reason == "no_encoder":
            self._warn_no_encoder(call_id)
        self._metrics.fallback(reason, items)
        return {}

    def _warn_no_encoder(self, call_id: str) -> None:
        # Every request would say the same while no encoder is in rotation: once in a while.
        now = time.monotonic()
        if now - self._warned_no_encoder_at >= _NO_ENCODER_LOG_EVERY_S:
            self._warned_no_encoder_at = now
            log.warning(
                "%s: no encoder in rotation; media is encoded on prefill/decode "
                '(counted in encoder_fallbacks_total{reason="no_encoder"})',
                call_id,
            )

    async def _call(
        self, backend: Backend, payload: bytes, call_id: str
    ) -> tuple[dict[str, TransferParam] | None, str]:
        """The params `backend` answers, or None and why not."""
        url = backend.url_for(_CHAT_PATH)
        headers = {"Content-Type": "application/json", "X-Request-Id": call_id}
        try:
            with self._pool.call(backend):
                async with self._session.post(
                    url, data=payload, headers=headers, timeout=self._timeout
                ) as resp:
                    status, raw = resp.status, await resp.read()
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
            self._pool.failed(backend, f"unreachable: {describe(exc)}", eject=True)
            return self._fell_back(call_id, url, "unreachable", describe(exc))
        except asyncio.TimeoutError:
            self._pool.failed(backend, "timed out")
            return self._fell_back(call_id, url, "timeout", f"no answer in {self._timeout.total}s")
        except aiohttp.ClientError as exc:
            self._pool.failed(backend, describe(exc))
            return self._fell_back(call_id, url, "error", describe(exc))
        if status != 200:
            if status >= 500:
                self._pool.failed(backend, f"answered {status}")
            return self._fell_back(call_id, url, "status", f"{status}: {raw[:300]!r}")
        self._pool.succeeded(backend)
        try:
            answer = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            answer = None
        raw_params = answer.get("ec_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(raw_params, dict) or not raw_params:
            return self._fell_back(call_id, url, "answer", "no ec_transfer_params in the answer")
        try:
            params = decode_items(raw_params)
        except ParamsError as exc:
            return self._fell_back(call_id, url, "params", str(exc))
        return params, "ok"

    @staticmethod
    def _fell_back(call_id: str, url: object, reason: str, detail: str) -> tuple[None, str]:
        log.warning("%s: encoder %s failed (%s: %s)", call_id, url, reason, detail)
        return None, reason


async def _all_or_none(calls: list[Coroutine[Any, Any, T]]) -> list[T]:
    """The results of `calls`, run at once; where one raises, the others are cancelled (so
    that they give their slots back) and its error is raised."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def _item_indices(where: TransferParam, items: int, hashes: int) -> list[int]:
    """The positions among a call's `items` that one mm_hash of its answer names: its
    `item_indices`, or the only item of a call answered with one mm_hash."""
    if not where.item_indices:
        return [0] if items == 1 and hashes == 1 else []
    return [i for i in where.item_indices if i < items]
