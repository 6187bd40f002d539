"""Helpers for the tests that serve the tiny model with real `vllm serve` processes.

`start_proxy` runs `ecshare proxy` as operators do (a subprocess) and reads its ready
line; `single_instance_tokens` is the reference every EPD answer must equal: the same
request answered by one instance that encodes its images itself; `wait_metric` and
`delta` read the connector's counters (`vllm:ecshare_*`) on an instance's Prometheus
endpoint.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import random
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from ecshare.apps.ready import ProxyReady, parse_ready
from ecshare.vllm.servers import VllmServer, post_chat, random_image_url, read_metrics

NUM_PROMPTS = 16  # few: CI has two cores; enough for a p99 that is not the maximum alone
BENCH_MODEL_NAME = "tiny"  # the served model name the launches under `vllm bench serve` use


def token_ids(answer: dict[str, Any]) -> list[int]:
    ids = answer["choices"][0]["token_ids"]
    assert isinstance(ids, list) and ids, answer
    return ids


def wait_metric(
    server: VllmServer, key: str, at_least: float, timeout_s: float = 15.0
) -> dict[str, float]:
    """The server's ecshare metrics once `key` reaches `at_least`, or as they are at the timeout.

    vLLM's frontend records a step's stats while it streams the step's
    outputs, so a response can arrive a moment before its counters move.
    """
    return wait_metrics(server, {key: at_least}, timeout_s)


def wait_metrics(
    server: VllmServer, at_least: dict[str, float], timeout_s: float = 15.0
) -> dict[str, float]:
    """As `wait_metric`, until every key of `at_least` has reached its value. vLLM's
    frontend moves one counter after another, and a scrape may fall between them
    (items counted, their bytes not yet): wait for each counter a check reads."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        reached = all(metrics.get(k, 0.0) >= v for k, v in at_least.items())
        if reached or time.monotonic() > deadline:
            return metrics
        time.sleep(0.1)


def settled_metrics(
    server: VllmServer | str, quiet_s: float = 0.3, timeout_s: float = 10.0
) -> dict[str, float]:
    """The server's metrics (a server, or its URL) once two scrapes `quiet_s` apart agree:
    what an earlier request left moving (a save reported a step later, say) is counted by
    then."""
    url = server.url if isinstance(server, VllmServer) else server
    deadline = time.monotonic() + timeout_s
    metrics = read_metrics(url)
    while True:
        time.sleep(quiet_s)
        again = read_metrics(url)
        if again == metrics or time.monotonic() > deadline:
            return again
        metrics = again


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def proxy_token_ids(url: str, body: dict[str, Any], *, stream: bool = False) -> list[int]:
    """The token ids of the answer at `url` (a proxy or an instance) to `body`, streamed
    or not; a streamed error event fails the test."""
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": stream}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        if not stream:
            return token_ids(json.loads(resp.read()))
        ids: list[int] = []
        for line in resp:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            assert "error" not in event, event
            for choice in event.get("choices", []):
                ids += choice.get("token_ids") or []
        return ids


def fresh_images(*sizes: tuple[int, int]) -> list[str]:
    """Images no instance has seen (an instance that had would answer from its own
    encoder cache first), one per (width, height)."""
    seed = random.SystemRandom().randrange(1 << 40)
    return [random_image_url(seed + i, w, h) for i, (w, h) in enumerate(sizes)]


def single_instance_tokens(server: VllmServer, body: dict[str, Any]) -> list[int]:
    """The request's tokens from `server` alone: its images under uuids no encoder
    announced, so that it encodes them itself (checked on its counters)."""
    alone = copy.deepcopy(body)
    images = 0
    for part in (p for m in alone["messages"] for p in m["content"]):
        if part["type"] == "image_url":
            part["uuid"] = f"single-{random.getrandbits(64):x}-{images}"
            images += 1
    before = server.metrics()
    tokens = token_ids(post_chat(server.url, alone))
    key = "local_encodes_total"
    after = wait_metric(server, key, before.get(key, 0) + images)
    assert delta(after, before, key) == images  # it really encoded them
    return tokens


def start_proxy(
    encoder: str, prefill_decode: str, log: Path, *flags: str
) -> tuple[subprocess.Popen[str], str]:
    """`ecshare proxy` in front of `encoder` and `prefill_decode` (a `--pd` value) on a
    free port; the process and its URL. Its output goes to `log`."""
    return run_proxy(["--encoder", encoder, "--pd", prefill_decode, "--port", "0", *flags], log)


def run_proxy(argv: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    """`ecshare proxy *argv`, once it is ready: the process and its URL. Its output goes
    to `log`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ecshare", "proxy", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        ready = parse_ready(line, ProxyReady)
        if ready is not None:
            break
    else:
        raise AssertionError("ecshare proxy did not get ready:\n" + "".join(lines[-30:]))

    def drain() -> None:  # keep its pipe from filling up
        with open(log, "w") as out:
            out.writelines(lines)
            for rest in proc.stdout or ():
                out.write(rest)

    threading.Thread(target=drain, daemon=True).start()
    return proc, ready.url


def wait_all_ready(servers: list[VllmServer]) -> None:
    """Wait until every one of `servers` is ready; on any failure, stop them all."""
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise


# -- vllm bench serve ----------------------------------------------------------------------


def bench_serve_args(base_url: str, tokenizer: Path, result: Path, seed: int) -> list[str]:
    """The recipe's arguments (docs/PERFORMANCE.md, "vllm bench serve"), drawing its
    random requests from `seed`."""
    return [
        "--backend", "openai-chat", "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", BENCH_MODEL_NAME, "--tokenizer", str(tokenizer),
        "--dataset-name", "random-mm", "--num-prompts", str(NUM_PROMPTS),
        "--random-input-len", "32", "--random-output-len", "8", "--ignore-eos",
        "--random-mm-base-items-per-request", "1",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
        "--request-rate", "inf", "--max-concurrency", "4",
        "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result.parent),
        "--result-filename", result.name, "--disable-tqdm", "--seed", str(seed),
    ]  # fmt: skip


def run_bench_serve(
    base_url: str, tokenizer: Path, tmp: Path, name: str, seed: int
) -> dict[str, Any]:
    """`vllm bench serve` against `base_url`; its saved result. What it prints goes to a
    log. It seeds the global `random` and numpy generators and freezes the garbage
    collector's heap (`gc.freeze`) for its run: both are put back after it."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = tmp / f"{name}.json"
    args = parser.parse_args(bench_serve_args(base_url, tokenizer, result, seed))
    log = tmp / f"{name}.bench.log"
    states = random.getstate(), np.random.get_state()
    try:
        with open(log, "w") as out, contextlib.redirect_stdout(out):
            main(args)
    finally:
        gc.unfreeze()
        random.setstate(states[0])
        np.random.set_state(states[1])
    tail = log.read_text()[-6000:]
    assert result.exists(), f"vllm bench serve saved no result for {name}:\n{tail}"
    # What it printed is what it saved: the same figures, under these headings.
    assert "P50 TTFT (ms):" in tail and "P99 TTFT (ms):" in tail, tail
    saved: dict[str, Any] = json.loads(result.read_text())
    return saved


def check_result(name: str, result: dict[str, Any]) -> None:
    assert result["completed"] == NUM_PROMPTS, (name, result["completed"], result["failed"])
    assert result["failed"] == 0, (name, result["failed"])
    for key in ("p50_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput"):
        value = result.get(key)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, key, value)
    assert result["p50_ttft_ms"] <= result["p99_ttft_ms"], (name, result)
