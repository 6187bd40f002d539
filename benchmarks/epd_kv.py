"""E→P→D against E→PD and a single instance, on the same requests, in the same run.

    python benchmarks/epd_kv.py [--requests 12] [--rounds 3] [--max-tokens 16] [--json PATH]

It starts, over the tiny Qwen2-VL (`ecshare.vllm.tiny_model`) on the CPU test settings:

* `single`: one plain `vllm serve` (it encodes its own images);
* `epd`: `ecshare launch --encoders 1 --pd 1` (1E1PD);
* `epd_kv`: `ecshare launch --encoders 1 --prefill 1 --decode 1` (1E1P1D, vLLM's
  NixlConnector moving the KV from prefill to decode);

each launch's proxy with `--route-headers`, so that every answer says where the proxy's
time went (`Server-Timing`). Then, per round, the same requests (each with an image of
its own, drawn afresh for the round so that no cache carries it over) go one at a time
to each set-up in turn, the order of the set-ups rotated each round, streamed, greedy,
`--max-tokens` tokens each. Per set-up it reports the client's TTFT (to the first
streamed token) and TPOT (time per output token after the first, as `vllm bench serve`
counts it: ITL averaged over a request), p50 and p99, and
checks every answer's tokens against the single instance's. Per E→P→D request, what
each stage adds (medians):

* encode: the proxy's `encode` step (its encoder call);
* EC transfer: the prefill instance's exposed latency (its scheduler asking for the item
  to the item being local, `ecshare_exposed_latency_seconds`, by mode);
* prefill: the proxy's `prefill` step (sending the prefill request to its whole
  one-token answer: the prefill instance's queueing, EC wait and compute);
* KV transfer: the decode instance's NIXL transfer time (`vllm:nixl_xfer_time_seconds`);
* decode to first token: TTFT less everything the proxy did before it sent the request
  to decode (the KV transfer and the first decode step, and the stream's first hop).

On a 2-core host three instances share the cores (vLLM's NixlConnector also moves both
KV instances' engine threads onto the last core): a record, not a target. Quote the
ranges over rounds with the load (`uptime`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from launch_push import stop_launch  # the same SIGTERM, then SIGKILL to its group
from prometheus_client.parser import text_string_to_metric_families

from ecshare.apps.ready import LaunchReady, parse_ready
from ecshare.vllm.servers import (
    SERVED_MODEL_NAME,
    ServerSpec,
    VllmServer,
    chat_request,
    ensure_tiny_model,
    free_port,
    popen_session,
    random_image_url,
)
from ecshare.vllm.tiny_model import transformers_version

REPO = Path(__file__).resolve().parents[1]
SETUPS = ("single", "epd", "epd_kv")


def start_launch(model: Path, workdir: Path, *flags: str) -> tuple[subprocess.Popen[str], Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "launch.log"
    command = [
        sys.executable, "-m", "ecshare", "launch", "--model", str(model), "--cpu",
        "--port", str(free_port()), "--served-model-name", SERVED_MODEL_NAME,
        "--workdir", str(workdir / "work"), "--extra-proxy-args=--route-headers",
        "--ec-extra-config", json.dumps({"region_bytes": 64 << 20}), *flags,
    ]  # fmt: skip
    out = open(log, "w")  # noqa: SIM115 - the launch's own, until it is stopped
    proc = popen_session(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def wait_launch(proc: subprocess.Popen[str], log: Path, timeout_s: float = 900) -> LaunchReady:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            ready = parse_ready(line, LaunchReady)
            if ready is not None:
                return ready
        if proc.poll() is not None:
            raise RuntimeError(f"ecshare launch exited:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    raise TimeoutError(f"ecshare launch not ready:\n{log.read_text()[-3000:]}")


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: its token ids, TTFT, the gaps between its tokens, and the
    proxy's Server-Timing steps (ms), if it sent them."""
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    began = time.perf_counter()
    ids: list[int] = []
    times: list[float] = []
    with urllib.request.urlopen(request, timeout=600) as resp:
        timing = resp.headers.get("Server-Timing", "")
        for line in resp:
            data = line.decode().strip().removeprefix("data:").strip()
            if not data or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: {event}")
            for choice in event.get("choices", []):
                got = choice.get("token_ids") or []
                if got:
                    ids += got
                    times += [time.perf_counter() - began] * len(got)
    steps = {}
    for part in filter(None, (p.strip() for p in timing.split(","))):
        name, _, dur = part.partition(";dur=")
        steps[name] = float(dur)
    # Time per output token after the first, as `vllm bench serve` counts it: events that
    # reach the client together would read as 0 ms apart, one by one.
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return {"ids": ids, "ttft": times[0] if times else None, "tpot": tpot, "steps": steps}


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "engine"))
            out[(s.name, labels)] = out.get((s.name, labels), 0.0) + s.value
    return out


def summed(values: dict[Any, float], name: str) -> float:
    return sum(v for (n, _), v in values.items() if n == name)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_tiny_model(REPO / ".work" / f"tiny-qwen2vl-{transformers_version()}")
    tmp = Path(tempfile.mkdtemp(prefix="ecshare-epd-kv-"))
    plain = VllmServer(ServerSpec(model, free_port(), core=0), tmp / "single.log").start()
    launches = {
        "epd": start_launch(model, tmp / "epd", "--encoders", "1", "--pd", "1"),
        "epd_kv": start_launch(
            model, tmp / "epd_kv", "--encoders", "1", "--prefill", "1", "--decode", "1"
        ),
    }
    try:
        plain.wait_ready(900)
        ready = {name: wait_launch(proc, log) for name, (proc, log) in launches.items()}
        urls = {"single": plain.url, **{name: r.url for name, r in ready.items()}}
        split = ready["epd_kv"]
        (prefill,), (decode,) = split.prefill_decode, split.decode
        for n in range(3):  # sessions, handshakes, first-use paths; then the load settles
            warm = chat_request([random_image_url(n + 1)], max_tokens=2)
            for url in urls.values():
                stream(url, warm)
        time.sleep(args.settle_s)
        per: dict[str, dict[str, list[float]]] = {s: {"ttft": [], "tpot": []} for s in SETUPS}
        stages: dict[str, list[float]] = {
            "encode": [], "ec_transfer": [], "prefill": [], "kv_transfer": [], "decode_first": [],
        }  # fmt: skip
        wrong = 0
        for round_ in range(args.rounds):
            order = SETUPS[round_ % 3 :] + SETUPS[: round_ % 3]
            seed = int.from_bytes(os.urandom(4), "big")
            for i in range(args.requests):
                body = chat_request([random_image_url(seed + i)], max_tokens=args.max_tokens)
                answers = {}
                for setup in order:
                    before = (samples(prefill), samples(decode)) if setup == "epd_kv" else None
                    answer = stream(urls[setup], body)
                    answers[setup] = answer
                    per[setup]["ttft"].append(answer["ttft"] * 1e3)
                    if answer["tpot"] is not None:
                        per[setup]["tpot"].append(answer["tpot"] * 1e3)
                    if before is not None:
                        time.sleep(0.3)  # the last step's counters
                        after = (samples(prefill), samples(decode))
                        steps = answer["steps"]
                        stages["encode"].append(steps.get("encode", 0.0))
                        stages["prefill"].append(steps.get("prefill", 0.0))
                        ec = "vllm:ecshare_exposed_latency_seconds"
                        n = summed(after[0], ec + "_count") - summed(before[0], ec + "_count")
                        s = summed(after[0], ec + "_sum") - summed(before[0], ec + "_sum")
                        stages["ec_transfer"].append(s / n * 1e3 if n else 0.0)
                        kv = "vllm:nixl_xfer_time_seconds"
                        n = summed(after[1], kv + "_count") - summed(before[1], kv + "_count")
                        s = summed(after[1], kv + "_sum") - summed(before[1], kv + "_sum")
                        stages["kv_transfer"].append(s / n * 1e3 if n else 0.0)
                        before_decode = sum(v for k, v in steps.items() if k != "decode")
                        stages["decode_first"].append(answer["ttft"] * 1e3 - before_decode)
                wrong += sum(
                    1 for s in ("epd", "epd_kv") if answers[s]["ids"] != answers["single"]["ids"]
                )
        report: dict[str, Any] = {"requests": args.requests, "rounds": args.rounds, "wrong": wrong}
        report["setups"] = {
            s: {
                "ttft_p50_ms": pct(v["ttft"], 0.5),
                "ttft_p99_ms": pct(v["ttft"], 0.99),
                "tpot_p50_ms": pct(v["tpot"], 0.5),
                "tpot_p99_ms": pct(v["tpot"], 0.99),
            }
            for s, v in per.items()
        }
        report["stages_p50_ms"] = {k: statistics.median(v) for k, v in stages.items() if v}
        report["load"] = os.getloadavg()
        return report
    finally:
        for proc, _ in launches.values():
            stop_launch(proc)
        plain.stop()


def table(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    rows = [
        "| set-up | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in report["setups"].items():
        rows.append(
            f"| {name} | {ms(r['ttft_p50_ms'])} | {ms(r['ttft_p99_ms'])} | "
            f"{ms(r['tpot_p50_ms'])} | {ms(r['tpot_p99_ms'])} |"
        )
    rows += ["", "| E→P→D stage (p50) | ms |", "| --- | --- |"]
    rows += [f"| {k} | {v:.2f} |" for k, v in report["stages_p50_ms"].items()]
    rows.append("")
    rows.append(
        f"{report['requests']} requests x {report['rounds']} rounds per set-up; answers "
        f"differing from the single instance's: {report['wrong']}; load "
        + ", ".join(f"{x:.2f}" for x in report["load"])
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--settle-s", type=float, default=20.0, help="idle after warm-up")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args)
    print(table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if report["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
